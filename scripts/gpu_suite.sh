#!/usr/bin/env bash
# The GPU suite, for a machine with a GPU and no network: build with the machine's packages,
# run ctest and the GPU tests, optionally the sanitizers and benchmarks.
#   scripts/gpu_suite.sh [build] [ctest] [pytest PYTEST_ARGS...] [sanitize] [bench]
# Logs go to /tmp/gpu_logs, archived into $OUT/logs.tgz when $OUT is set. A libgtest-dev .deb in .deps/ is unpacked when gtest is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=/tmp/gpu_logs
mkdir -p "$LOGS"
# $OUT takes few files: everything comes back as one archive.
trap '[ -n "${OUT:-}" ] && tar czf "$OUT/logs.tgz" -C /tmp gpu_logs' EXIT
export PYTHONUNBUFFERED=1
status=0
step() { echo "== $*"; }

for stage in "$@"; do :; done
want() { [[ " $* " == *" $1 "* ]]; }

if [[ " $* " == *" build "* ]]; then
  step build
  ( time python3 -m pip install --no-build-isolation --no-deps -q . ) > "$LOGS/build.log" 2>&1 || { tail -50 "$LOGS/build.log"; exit 1; }
  tail -3 "$LOGS/build.log"
  python3 -c "import nanograph; print('core:', nanograph.core_available(), 'gpu:', nanograph.gpu_available(), nanograph.CORE_ERROR or '')"
fi
if [[ " $* " == *" ctest "* ]]; then
  step ctest
  if ! [ -f /usr/include/gtest/gtest.h ]; then
    mkdir -p /tmp/gt && for f in .deps/base/*.deb; do dpkg -x "$f" /tmp/gt; done
  fi
  cmake -S . -B build/ctest -G Ninja -DNANOGRAPH_BUILD_TESTS=ON -DNANOGRAPH_BUILD_PYTHON=OFF \
    -DCMAKE_PREFIX_PATH=/tmp/gt/usr -DCMAKE_CUDA_ARCHITECTURES=90a > "$LOGS/ctest_build.log" 2>&1 &&
  cmake --build build/ctest -j 16 >> "$LOGS/ctest_build.log" 2>&1 || { tail -30 "$LOGS/ctest_build.log"; status=1; }
  ctest --test-dir build/ctest --output-on-failure > "$LOGS/ctest.log" 2>&1 || status=1
  tail -4 "$LOGS/ctest.log"
fi
if [[ " $* " == *" pytest "* ]]; then
  step pytest
  args=$(echo " $* " | sed -n 's/.* pytest \(.*\)/\1/p' | sed 's/ sanitize / /; s/ bench / /')
  # One pytest process per file: a crash in one file must not hide the others' results.
  for f in $(ls -d ${args:-tests/kernels/test_*.py tests/engine/test_*.py}); do
    name=$(basename "$f" .py)
    python3 -m pytest "$f" -q -rs -p no:cacheprovider > "$LOGS/pytest_$name.log" 2>&1 || status=1
    echo "$f: $(tail -1 "$LOGS/pytest_$name.log")"
    grep -E "^(FAILED|ERROR)|Fatal Python" "$LOGS/pytest_$name.log" | head -10
  done
fi
if [[ " $* " == *" sanitize "* ]]; then
  step sanitize
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 build/ctest/nanograph_tests > "$LOGS/sanitize_$tool.log" 2>&1 || status=1
    tail -3 "$LOGS/sanitize_$tool.log"
  done
fi
if [[ " $* " == *" bench "* ]]; then
  step bench
  python3 benchmarks/bench_kernels.py 2>&1 | tee "$LOGS/bench_kernels.log" || status=1
fi
exit $status
