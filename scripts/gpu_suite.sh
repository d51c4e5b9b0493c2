#!/usr/bin/env bash
# The GPU suite, for a machine with a GPU and no network: build with the machine's packages, run
# ctest, the GPU tests, the sanitizers, the profiles and the benchmarks, in the order given.
#   scripts/gpu_suite.sh STAGE...
# Stages: build, ctest, pytest (files from $PYTEST_FILES, default: every kernel and engine test),
# sanitize (memcheck + racecheck over the gtest binary and the kernel tests),
# bench (kernel benchmarks), profile (ncu per-kernel times of one decode step of $MODEL;
# $PROFILE_ARGS: batch and context, e.g. "256 1024"),
# latency, throughput, sampler (the benchmarks of the nanograph CLI and benchmarks/).
# $MODEL is a model folder, or the name of a config in tests/hf_models.py (random weights made
# under /tmp/models); default qwen3-0.6b.
# Logs go to /tmp/gpu_logs, archived into $OUT/logs.tgz when $OUT is set. A libgtest-dev .deb in
# .deps/ is unpacked when gtest is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=/tmp/gpu_logs
mkdir -p "$LOGS"
# $OUT takes few files: everything comes back as one archive.
trap '[ -n "${OUT:-}" ] && tar czf "$OUT/logs.tgz" -C /tmp gpu_logs' EXIT
export PYTHONUNBUFFERED=1
status=0
step() { echo "== $* ($(date +%T))"; }

model_folder() {
  local name=${MODEL:-qwen3-0.6b}
  if [ -d "$name" ]; then echo "$name"; return; fi
  python3 -c "from tests.hf_models import make_random_model; print(make_random_model('/tmp/models/$name', '$name'))" | tail -1
}

for stage in "$@"; do
  case $stage in
  build)
    step build
    ( time python3 -m pip install --no-build-isolation --no-deps -q . ) > "$LOGS/build.log" 2>&1 || { tail -50 "$LOGS/build.log"; exit 1; }
    tail -3 "$LOGS/build.log"
    python3 -c "import nanograph, sys; print('core:', nanograph.core_available(), 'gpu:', nanograph.gpu_available(), nanograph.CORE_ERROR or ''); sys.exit(0 if nanograph.gpu_available() else 1)" || exit 1
    ;;
  ctest)
    step ctest
    if ! [ -f /usr/include/gtest/gtest.h ]; then
      mkdir -p /tmp/gt && for f in .deps/base/*.deb; do dpkg -x "$f" /tmp/gt; done
    fi
    cmake -S . -B build/ctest -G Ninja -DNANOGRAPH_BUILD_TESTS=ON -DNANOGRAPH_BUILD_PYTHON=OFF \
      -DCMAKE_PREFIX_PATH=/tmp/gt/usr -DCMAKE_CUDA_ARCHITECTURES=90a > "$LOGS/ctest_build.log" 2>&1 &&
    cmake --build build/ctest -j 16 >> "$LOGS/ctest_build.log" 2>&1 || { tail -30 "$LOGS/ctest_build.log"; status=1; }
    ctest --test-dir build/ctest --output-on-failure > "$LOGS/ctest.log" 2>&1 || status=1
    tail -4 "$LOGS/ctest.log"
    ;;
  pytest)
    step pytest
    # One pytest process per file: a crash in one file must not hide the others' results.
    for f in $(ls -d ${PYTEST_FILES:-tests/kernels/test_*.py tests/engine/test_*.py}); do
      name=$(basename "$f" .py)
      python3 -m pytest "$f" -q -rs -p no:cacheprovider > "$LOGS/pytest_$name.log" 2>&1 || status=1
      echo "$f: $(tail -1 "$LOGS/pytest_$name.log")"
      grep -E "^(FAILED|ERROR)|Fatal Python" "$LOGS/pytest_$name.log" | head -10
    done
    ;;
  sanitize)
    step sanitize
    for tool in memcheck racecheck; do
      if [ -x build/ctest/nanograph_tests ]; then
        compute-sanitizer --tool $tool --error-exitcode 9 build/ctest/nanograph_tests > "$LOGS/sanitize_${tool}_gtest.log" 2>&1 || status=1
        echo "gtest $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/sanitize_${tool}_gtest.log" | tail -1)"
      fi
    done
    # The kernel tests under the sanitizers, in parallel processes (each is slow, mostly on the host).
    # memcheck: every kernel test; racecheck (much slower): the cases of the kernels that use shared memory.
    # torch's caching allocator would hide out-of-bounds accesses inside its pools from memcheck.
    sanitized() {
      local tool=$1 name=$2; shift 2
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 600 compute-sanitizer --tool $tool --error-exitcode 9 \
        --target-processes all python3 -m pytest -q -p no:cacheprovider "$@" > "$LOGS/sanitize_${tool}_$name.log" 2>&1
      echo "rc=$?" >> "$LOGS/sanitize_${tool}_$name.log"
    }
    for f in tests/kernels/test_*.py; do sanitized memcheck "$(basename "$f" .py)" "$f" & done
    sanitized racecheck decode tests/kernels/test_decode_attention.py \
      -k "edges or hd64_bs256 or q8kv1 or q28kv4 or ratio16 or all_empty or max_len_0 or graph_replay" &
    sanitized racecheck prefill tests/kernels/test_prefill_attention.py \
      -k "single_sequence and (15 or 17 or 65 or 200) or decode_rows or peaked" &
    sanitized racecheck gemv tests/kernels/test_gemv.py \
      -k "deterministic or graph_replay or offset_views or argmax_matches and 9001" &
    sanitized racecheck basic tests/kernels/test_basic_kernels.py \
      -k "rmsnorm and 2048 or argmax_random or argmax_strided" &
    sanitized racecheck sample tests/kernels/test_sample_rows.py -k "any_number_of_rows or overridden or ties or greedy" &
    # The engine end to end, which the kernel tests do not cover: a small random model built with the latency
    # benchmark's limits (warm-up, KV sizing, graph capture), then greedy and sampled decoding.
    engine_run='
from tests.hf_models import make_random_model
from nanograph import LLM, SamplingParams
folder = make_random_model("/tmp/models/qwen3-small", "qwen3-0.6b", num_hidden_layers=2)
llm = LLM(folder, device="cuda", max_num_seqs=2, max_model_len=400)
prompts = [list(range(100, 228)), list(range(300, 310))]
llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.5, logprobs=3, max_tokens=32)],
             use_tqdm=False)
print("engine run: done")'
    ( PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 600 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 -c "$engine_run" > "$LOGS/sanitize_memcheck_engine.log" 2>&1
      echo "rc=$?" >> "$LOGS/sanitize_memcheck_engine.log" ) &
    wait
    for f in "$LOGS"/sanitize_*_test_*.log "$LOGS"/sanitize_racecheck_*.log "$LOGS"/sanitize_memcheck_engine.log; do
      [ -f "$f" ] && [[ "$f" != *gtest* ]] || continue
      grep -q "rc=0" "$f" || status=1
      echo "$(basename "$f" .log): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tail -1) | $(grep -E ' passed| failed' "$f" | tail -1)"
    done
    ;;
  bench)
    step bench
    python3 benchmarks/bench_kernels.py 2>&1 | tee "$LOGS/bench_kernels.log" || status=1
    ;;
  profile)
    step profile
    folder=$(model_folder)
    ncu --clock-control none --nvtx --nvtx-include "decode_step/" --metrics gpu__time_duration.sum --csv \
      python3 benchmarks/profile_decode_step.py "$folder" ${PROFILE_ARGS:-} > "$LOGS/profile.csv" 2> "$LOGS/profile.err" || { tail -20 "$LOGS/profile.err"; status=1; }
    python3 benchmarks/profile_decode_step.py --summarize "$LOGS/profile.csv" 2>&1 | tee "$LOGS/profile.txt" | head -30
    ;;
  latency)
    step latency
    python3 -m nanograph.cli bench latency --model "$(model_folder)" 2>&1 | grep -v Warning | tee "$LOGS/latency.log" | tail -8 || status=1
    ;;
  throughput)
    step throughput
    python3 -m nanograph.cli bench throughput --model "$(model_folder)" --compare hf 2>&1 | tee "$LOGS/throughput.log" | tail -8 || status=1
    ;;
  sampler)
    step sampler
    python3 benchmarks/bench_sampler.py 2>&1 | tee "$LOGS/sampler.log" || status=1
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
exit $status
