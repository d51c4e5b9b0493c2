#!/usr/bin/env bash
# Batch-1 decode speed of two source trees, built and timed in one run, alternating A, B, A, B (a GPU's
# speed drifts from run to run, so a change is measured against its baseline timed beside it):
#   scripts/ab_latency.sh TREE_A TREE_B
# TREE_A and TREE_B are source folders (a checkout, `git worktree add DIR REV`, or `git archive REV | tar -x`).
# Each is built with the machine's packages into /tmp/ab/a and /tmp/ab/b. Then, for each model of $MODELS,
# `nanograph bench latency --no-hf $LATENCY_ARGS` runs $ROUNDS times per tree. A model is a folder, or the name of
# a config in tests/hf_models.py (random weights made under /tmp/models), with ":fp8" appended for
# --quantization fp8. Defaults: MODELS="qwen3-0.6b", ROUNDS=2, LATENCY_ARGS="".
# Each run prints "model tree ms/token"; the summary gives each tree's best and B's time over A's.
# KERNELS='decode_attention -k 1x32768 -k "of 40960"' also times kernel cases (benchmarks/bench_kernels.py with
# those arguments, split as a shell would; this checkout's cases) on each tree in turn, $ROUNDS times, before the
# models; the summary gives each case's best time per tree and B's over A's. MODELS="" skips the models.
# Logs go to /tmp/ab/logs.
set -uo pipefail
[ $# -eq 2 ] || { sed -n 2,14p "$0"; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
tree_a=$(cd "$1" && pwd) && tree_b=$(cd "$2" && pwd) || exit 2
logs=/tmp/ab/logs
mkdir -p "$logs"

for side in a b; do
  tree=$tree_a; [ $side = b ] && tree=$tree_b
  rm -rf "/tmp/ab/$side"
  python3 -m pip install --no-build-isolation --no-deps -q --target "/tmp/ab/$side" "$tree" \
    > "$logs/build_$side.log" 2>&1 || { tail -30 "$logs/build_$side.log"; exit 1; }
  echo "built $side: $tree"
done

model_folder() {
  if [ -d "$1" ]; then echo "$1"; return; fi
  (cd "$root" && python3 -c "from tests.hf_models import make_random_model
print(make_random_model('/tmp/models/$1', '$1'))" | tail -1)
}

summary=()
if [ -n "${KERNELS:-}" ]; then
  # Split as a shell would, so that a filter may hold spaces: KERNELS='decode_attention -k "of 40960"'.
  mapfile -t kernel_args < <(python3 -c 'import shlex, sys; print("\n".join(shlex.split(sys.argv[1])))' "$KERNELS")
  for round in $(seq "${ROUNDS:-2}"); do
    for side in a b; do
      log="$logs/kernels_${side}_$round.log"
      # From the checkout's root, so that its kernel cases are imported; nanograph from the built tree.
      (cd "$root" && PYTHONPATH="/tmp/ab/$side" timeout 900 python3 benchmarks/bench_kernels.py "${kernel_args[@]}") > "$log" 2>&1 ||
        { echo "kernels $side: failed"; tail -20 "$log"; exit 1; }
      grep -E '[0-9.]+us ' "$log" | sed "s/^/$side /"
    done
  done
  mapfile -t kernel_summary < <(python3 - "$logs" "${ROUNDS:-2}" <<'PY'
import re, sys
logs, rounds = sys.argv[1], int(sys.argv[2])
best = {}  # label -> {side: us}
for side in "ab":
    for r in range(1, rounds + 1):
        for line in open(f"{logs}/kernels_{side}_{r}.log"):
            m = re.match(r"(.*?)\s+([0-9.]+)us\s", line)
            if m:
                times = best.setdefault(m.group(1), {})
                times[side] = min(times.get(side, float("inf")), float(m.group(2)))
for label, t in best.items():
    if "a" in t and "b" in t:
        print(f"{label}: a {t['a']:.1f} us, b {t['b']:.1f} us, b/a {t['b'] / t['a']:.3f}")
PY
  )
  summary+=("${kernel_summary[@]}")
fi
for spec in ${MODELS-qwen3-0.6b}; do
  name=${spec%:fp8}
  extra=()
  [ "$spec" != "$name" ] && extra=(--quantization fp8)
  folder=$(model_folder "$name") || exit 1
  declare -A best=()
  for round in $(seq "${ROUNDS:-2}"); do
    for side in a b; do
      log="$logs/${spec//[:\/]/_}_${side}_$round.log"
      # From /tmp, so that only the built tree's nanograph is importable.
      (cd /tmp && PYTHONPATH="/tmp/ab/$side" timeout 900 python3 -m nanograph.cli bench latency --model "$folder" \
        --no-hf "${extra[@]}" ${LATENCY_ARGS:-}) > "$log" 2>&1
      ms=$(grep -oE '[0-9.]+ ms/token' "$log" | head -1 | cut -d' ' -f1)
      [ -n "$ms" ] || { echo "$spec $side: no result"; tail -20 "$log"; exit 1; }
      echo "$spec $side $ms ms/token"
      if [ -z "${best[$side]:-}" ] || awk "BEGIN{exit !($ms < ${best[$side]})}"; then best[$side]=$ms; fi
    done
  done
  summary+=("$spec: a ${best[a]} ms/token, b ${best[b]} ms/token, b/a $(awk "BEGIN{printf \"%.3f\", ${best[b]} / ${best[a]}}")")
  unset best
done
echo "== best of each tree"
printf '%s\n' "${summary[@]}" | tee "$logs/summary.txt"
