#!/usr/bin/env bash
# One pytest step of bench/gpu/run.sh, with a per-test timeout and no test able to cost the rest.
#
#   bench/gpu/pytest_steps.sh NAME WORK_DIR PYTEST_ARGS...
#
# Runs `$PY -m pytest PYTEST_ARGS` (PY defaults to python3) with bench/gpu/pytest_step_timeout.py
# loaded (ECHOPIPE_TEST_TIMEOUT_S per test, default 60), JUnit XML in WORK_DIR/NAME.xml and the
# progress of every test in WORK_DIR/NAME.progress.tsv. If a test ends the process (it hung in C
# code past its timeout, or crashed), the tests not yet started run once more without it
# (WORK_DIR/NAME.rest.xml), and the step fails; the stacks at that moment are printed
# (WORK_DIR/NAME.stacks.txt). PYTEST_LENIENT (a string of pytest options) is
# passed too when set.
set -uo pipefail
if [[ $# -lt 3 ]]; then
  echo "usage: $0 NAME WORK_DIR PYTEST_ARGS..." >&2
  exit 2
fi
name=$1 work=$2
shift 2
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY=${PY:-python3}
progress="$work/$name.progress.tsv"
mkdir -p "$work"
: > "$progress"
export ECHOPIPE_TEST_PROGRESS=$progress ECHOPIPE_TEST_STACKS="$work/$name.stacks.txt"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
args=("$@" -v -rs -p no:cacheprovider -p pytest_step_timeout)
# shellcheck disable=SC2086 # PYTEST_LENIENT is a list of options in one string
"$PY" -m pytest "${args[@]}" ${PYTEST_LENIENT:-} --junitxml="$work/$name.xml"
rc=$?
# The last test started with no result line is the one that ended the process.
ended=$(awk -F'\t' '$1 == "start" {last = $2} $1 != "start" {seen[$3] = 1}
  END {if (last != "" && !(last in seen)) print last}' "$progress")
if [[ -n $ended ]]; then
  echo "== $ended ended the process (past its per-test timeout, or a crash); stacks then:"
  cat "$ECHOPIPE_TEST_STACKS" 2> /dev/null
  echo "== running the tests not yet started"
  skip=()
  while IFS= read -r id; do
    skip+=(--deselect "$id")
  done < <(awk -F'\t' '$1 == "start" {print $2}' "$progress")
  # shellcheck disable=SC2086
  "$PY" -m pytest "${args[@]}" "${skip[@]}" ${PYTEST_LENIENT:-} --junitxml="$work/$name.rest.xml"
  rest=$?
  echo "== the rest: exit status $rest; the step fails for $ended"
  rc=1
fi
exit "$rc"
