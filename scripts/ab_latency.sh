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
# Logs go to /tmp/ab/logs.
set -uo pipefail
[ $# -eq 2 ] || { sed -n 2,10p "$0"; exit 2; }
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
for spec in ${MODELS:-qwen3-0.6b}; do
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
