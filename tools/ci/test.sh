#!/usr/bin/env bash
# What `make test` runs once its environment is installed: the CPU test suite with the doctests,
# the documentation build, the wheel check, the kernel compile check (CUDA 13 NVRTC, every
# variant, sm_80 and sm_90a) and the CUDA 12 compile check (a sample).
#     PYTHON=.venv/bin/python bash tools/ci/test.sh
# The compile check is the longest step and needs nothing from the others, so it runs in the
# background from the start while the rest run in turn; on a 2-core machine the two lines share
# the cores and the total is about the CPU time of all steps over two. Each step's output goes
# to build/ci/<step>.log; a failing step prints its log. The last lines are a table of steps.
set -uo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
logs=build/ci
mkdir -p "$logs"
rm -f "$logs"/*.log "$logs"/*.rc "$logs"/*.seconds
start=$SECONDS

# run NAME COMMAND...: the step's output to its log, its exit status to NAME.rc, its seconds kept.
run() {
  local name=$1 began=$SECONDS
  shift
  "$@" >"$logs/$name.log" 2>&1
  echo $? >"$logs/$name.rc"
  echo $((SECONDS - began)) >"$logs/$name.seconds"
}

# In a session of its own (setsid), so that one signal stops the compiler and its worker processes:
# a background job of a non-interactive shell ignores Ctrl-C, and would run on after make stops.
setsid bash -c "$(declare -f run); logs=$logs; run compile \"\$@\"" compile \
  "$PYTHON" tools/ci/compile_kernels.py --arch sm_80 --arch sm_90a --jobs 2 --quiet --report build/compile_report.txt &
compile_pid=$!
trap 'kill -- -$compile_pid 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM

steps=(tests docs wheel cuda12)
echo "test suite (pytest) ..."
run tests "$PYTHON" -m pytest -q tests --doctest-modules bsmm -p no:cacheprovider
tail -n 3 "$logs/tests.log"
echo "documentation (mkdocs --strict) ..."
run docs env PYTHON="$PYTHON" bash tools/ci/build_docs.sh
echo "wheel (Python 3.11 and 3.12) ..."
run wheel env PYTHON="$PYTHON" bash tools/ci/check_wheel.sh
echo "CUDA 12 compile sample ..."
run cuda12 env PYTHON="$PYTHON" bash tools/ci/compile_cuda12.sh --quiet
echo "waiting for the kernel compile check ..."
wait "$compile_pid"
steps+=(compile)

failed=0
printf '\n%-10s %-6s %8s  %s\n' step status seconds "last line of its log ($logs/<step>.log)"
for step in "${steps[@]}"; do
  rc=$(cat "$logs/$step.rc")
  status=$([ "$rc" = 0 ] && echo ok || echo FAILED)
  [ "$rc" = 0 ] || failed=1
  printf '%-10s %-6s %8s  %s\n' "$step" "$status" "$(cat "$logs/$step.seconds")" "$(grep -v '^\s*$' "$logs/$step.log" | tail -n 1 | cut -c1-110)"
done
for step in "${steps[@]}"; do
  if [ "$(cat "$logs/$step.rc")" != 0 ]; then
    echo; echo "==== $step failed: the end of $logs/$step.log"; tail -n 80 "$logs/$step.log"
  fi
done
echo "make test: $((SECONDS - start)) s after set-up"
exit $failed
