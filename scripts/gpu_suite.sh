#!/usr/bin/env bash
# The GPU suite, for a machine with a GPU and no network: build with the machine's packages, run
# ctest, the GPU tests, the sanitizers, the profiles and the benchmarks, in the order given.
#   scripts/gpu_suite.sh STAGE...
# Stages: build, ctest, pytest (files from $PYTEST_FILES, default: every kernel and engine test),
# sanitize (memcheck + racecheck over the gtest binary and $SANITIZE_FILES' pytest runs),
# bench (kernel benchmarks), profile (ncu per-kernel times of one decode step of $MODEL),
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
    python3 -c "import nanograph; print('core:', nanograph.core_available(), 'gpu:', nanograph.gpu_available(), nanograph.CORE_ERROR or '')"
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
      for f in ${SANITIZE_FILES:-}; do
        name=$(basename "$f" .py)
        # torch's caching allocator hides out-of-bounds accesses inside its pools from memcheck.
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool --error-exitcode 9 \
          --target-processes all python3 -m pytest "$f" -q -x -p no:cacheprovider ${SANITIZE_ARGS:-} \
          > "$LOGS/sanitize_${tool}_$name.log" 2>&1 || status=1
        echo "$f $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/sanitize_${tool}_$name.log" | tail -1); $(grep -E 'passed|failed' "$LOGS/sanitize_${tool}_$name.log" | tail -1)"
      done
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
      python3 benchmarks/profile_decode_step.py "$folder" > "$LOGS/profile.csv" 2> "$LOGS/profile.err" || { tail -20 "$LOGS/profile.err"; status=1; }
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
