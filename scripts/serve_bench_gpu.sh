#!/usr/bin/env bash
# nanograph serve on one GPU machine without network: a random-weight Qwen3-0.6B served with --device cuda,
# `nanograph bench serve` at request rate inf (1,000 prompts x 1,024 input, 128 output tokens), at concurrency 1
# and at Poisson rates 4, 16 and 64 req/s; then LLM.generate on the same 1,000 requests and
# `nanograph bench latency` on the same prompt and output lengths, for the two comparisons:
#   output tok/s through the server / LLM.generate's (target >= 0.90);
#   the server's TPOT at concurrency 1 / bench latency's ms per token (target within 10%).
# Run from the repository root with the core built (`pip install .`, or the in-tree build on PYTHONPATH).
#
# The serve extra (fastapi, uvicorn, pydantic and their needs) must be importable: on a machine without network,
# carry their wheels and install them first (README: Serve). NUM_PROMPTS, and the counts of the slower runs
# (CONCURRENCY_1_PROMPTS, RATE_4_PROMPTS, RATE_16_PROMPTS, RATE_64_PROMPTS), size the runs; RATE_INF_RUNS (default 1)
# repeats the rate-inf run, run k on the prompts of seed k - 1 (new prompts, so that none is in the prefix cache), each
# compared with LLM.generate on the same prompts. The other runs have prompts of their own too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$PWD/serve-wheels}
OUT=${OUT:-/tmp/serve-bench}
MODEL=${MODEL:-/tmp/models/qwen3-0.6b}
PORT=${PORT:-8000}
MAX_MODEL_LEN=2048  # the server, LLM.generate and bench latency all size their engines with it
N=${NUM_PROMPTS:-1000}
mkdir -p "$OUT"
$PY -c "import fastapi, uvicorn, pydantic, prometheus_client, aiohttp, httpx, nanograph
print('serve packages ok; core', nanograph.core_available())"

echo "== model"
timeout 900 $PY -c "from tests.hf_models import make_random_model; print(make_random_model('$MODEL', 'qwen3-0.6b'))"

echo "== nanograph serve"
$PY -m nanograph.cli serve "$MODEL" --device cuda --host 127.0.0.1 --port "$PORT" --max-model-len $MAX_MODEL_LEN \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true' EXIT
timeout 900 $PY - "$PORT" "$SERVER" <<'EOF'
import os, sys, time, httpx
port, pid = sys.argv[1], int(sys.argv[2])
while True:
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited; see server.log")
    time.sleep(1)
print("server healthy")
EOF
grep -E "KV cache|model|listening" "$OUT/server.log" || true

bench() {  # name, then bench serve arguments
  local name=$1; shift
  echo "== bench serve: $name"
  timeout 600 $PY -m nanograph.cli bench serve --base-url "http://127.0.0.1:$PORT" --prompt-len 1024 \
    --output-len 128 --result-file "$OUT/$name.json" "$@" | tee "$OUT/$name.txt" || echo "bench $name failed"
}
RUNS=${RATE_INF_RUNS:-1}
for run in $(seq $RUNS); do bench rate_inf_$run --num-prompts $N --seed $((run - 1)); done
bench concurrency_1 --num-prompts ${CONCURRENCY_1_PROMPTS:-200} --max-concurrency 1 --seed 101
bench rate_4 --num-prompts ${RATE_4_PROMPTS:-400} --request-rate 4 --seed 102
bench rate_16 --num-prompts ${RATE_16_PROMPTS:-1000} --request-rate 16 --seed 103
bench rate_64 --num-prompts ${RATE_64_PROMPTS:-1000} --request-rate 64 --seed 104
timeout 30 $PY -c "import httpx; print(httpx.get('http://127.0.0.1:$PORT/metrics').text)" > "$OUT/metrics.txt"
grep -E "^nanograph:(num_requests|kv_cache_usage|num_preemptions_total|generation_tokens_total|request_success_total)" \
  "$OUT/metrics.txt" || true

echo "== stop the server (SIGTERM)"
kill -TERM $SERVER
trap - EXIT
for _ in $(seq 120); do kill -0 $SERVER 2>/dev/null || break; sleep 0.5; done
if kill -0 $SERVER 2>/dev/null; then echo "the server still runs 60 s after SIGTERM: killing it"; kill -KILL $SERVER; fi
set +e; wait $SERVER; code=$?; set -e
echo "server exit code $code (expected 0)"
tail -5 "$OUT/server.log"

echo "== LLM.generate on the same $N requests (each rate-inf run's)"
timeout 900 $PY - "$MODEL" "$MAX_MODEL_LEN" "$OUT" "$N" "$RUNS" <<'EOF'
import json, sys, time
from nanograph import LLM, SamplingParams
from nanograph.bench_serve import random_workload
model, max_model_len, out, num_prompts, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
llm = LLM(model, device="cuda", max_model_len=max_model_len)
for run in range(1, runs + 1):
    prompts = random_workload(num_prompts, 1024, seed=run - 1)  # bench serve's prompts for --seed run - 1
    llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    result = {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
              "total_tok_s": (tokens + 1024 * len(prompts)) / seconds}
    print(json.dumps(result))
    json.dump(result, open(f"{out}/generate_{run}.json", "w"))
EOF
[ -f "$OUT/generate_1.json" ] || echo "LLM.generate failed"

echo "== nanograph bench latency (batch 1, the same lengths)"
timeout 900 $PY -m nanograph.cli bench latency --model "$MODEL" --no-hf --prompt-len 1024 --output-len 128 \
  --max-model-len $MAX_MODEL_LEN | tee "$OUT/latency.txt" || echo "bench latency failed"

echo "== summary"
$PY - "$OUT" <<'EOF'
import json, os, re, sys
out = sys.argv[1]
load = lambda name: json.load(open(f"{out}/{name}.json"))
one = load("concurrency_1")
ms_per_token = float(re.search(r"([\d.]+) ms/token", open(f"{out}/latency.txt").read()).group(1))
run = 1
while os.path.exists(f"{out}/rate_inf_{run}.json"):
    inf, generate = load(f"rate_inf_{run}"), load(f"generate_{run}")
    print(f"rate inf, run {run}: server {inf['output_throughput']:.0f} output tok/s ({inf['completed']} completed, "
          f"{inf['failed']} failed), LLM.generate {generate['output_tok_s']:.0f}: "
          f"{inf['output_throughput'] / generate['output_tok_s']:.3f} (target >= 0.90)")
    run += 1
print(f"concurrency 1: server TPOT median {one['median_tpot_ms']:.3f} ms (mean {one['mean_tpot_ms']:.3f}), "
      f"bench latency {ms_per_token:.3f} ms/token: {one['median_tpot_ms'] / ms_per_token:.3f} (target <= 1.10)")
for name in ("rate_4", "rate_16", "rate_64"):
    r = load(name)
    print(f"{name}: TTFT p50 {r['median_ttft_ms']:.1f} ms, p99 {r['p99_ttft_ms']:.1f} ms; TPOT p50 "
          f"{r['median_tpot_ms']:.2f} ms; {r['output_throughput']:.0f} output tok/s; {r['completed']} completed, "
          f"{r['failed']} failed")
EOF
