#!/usr/bin/env bash
# Every CUDA check and GPU benchmark of echopipe, in passes that each fit a few minutes.
#
#   bench/gpu/run.sh OUT_DIR      run the steps ECHOPIPE_GPU_STEPS selects (default: pass1)
#   bench/gpu/run.sh --plan       print the steps that would run and the budget, run nothing
#
# ECHOPIPE_GPU_STEPS is a comma list of step names and groups:
#   pass1 (about 4 minutes): environment build test_gpu bench_gather_bw train_mixed
#   pass2: test_echo_pinned train_mixed_amp bench_pipeline bench_dali_gpu
#   all:   both passes (440 s budget)
# e.g. ECHOPIPE_GPU_STEPS=build,test_gpu. `environment` always runs; `build` runs whenever a
# selected step needs the installed package, and skips the install when the build of the same
# sources is already there (a second pass on a warm machine). Steps run in the order above.
#
# Run from anywhere on a CUDA machine with torch, nvcc, cmake, pybind11 and scikit-build-core.
# DALI is optional: when `.gpu/site` exists (see /work/shared/gpu/README.md; `.gpu/unpack-dali`
# is run first if only the parts are there) the DALI plugin is built too, and `.gpu/site` is put
# on PYTHONPATH for the steps that use DALI only. If the build with the plugin fails, echopipe is
# built again without it (recorded as the step `build_dali_plugin`) and every non-DALI step runs.
#
# Every step has its own timeout and log, pytest steps a per-test timeout too
# (bench/gpu/pytest_step_timeout.py). A failed step is recorded and the script goes on; it exits
# non-zero at the end if any step failed. Exit status 77 from a step means "skipped".
# The commit comes from git when the tree has it, else from ECHOPIPE_GIT_COMMIT and
# ECHOPIPE_GIT_DIRTY (0/1) set by the caller; a hash of the sources is recorded either way.
#
# The device tool brings back at most 8 files from its $OUT, so the steps write into a work
# folder (ECHOPIPE_GPU_WORK, default a new temporary one) and OUT_DIR receives four files:
# gpu_results.json, summary.txt (the table printed last), steps.tsv and gpu_run.tar.gz (every
# log, JUnit XML and JSON of the work folder; refreshed after every step, so a run cut short
# still brings back what it did).
set -uo pipefail

PASS1=(environment build test_gpu bench_gather_bw train_mixed)
PASS2=(test_echo_pinned train_mixed_amp bench_pipeline bench_dali_gpu)
ALL_STEPS=("${PASS1[@]}" "${PASS2[@]}")
# Steps that import DALI (only these see .gpu/site) and steps that need the installed package.
DALI_STEPS=" environment build test_gpu train_mixed train_mixed_amp bench_dali_gpu "
NO_INSTALL_STEPS=" environment build "

# select_steps SPEC: the steps SPEC names, in run order, one per line; exit 2 on a bad name.
select_steps() {
  local spec=$1 part s want=" environment " install=0 named=0
  local -a parts
  IFS=, read -ra parts <<< "$spec"
  for part in "${parts[@]}"; do
    part=${part//[[:space:]]/}
    case $part in
      "") continue ;;
      pass1) want+="${PASS1[*]} " ;;
      pass2) want+="${PASS2[*]} " ;;
      all) want+="${ALL_STEPS[*]} " ;;
      *)
        if [[ " ${ALL_STEPS[*]} " != *" $part "* ]]; then
          echo "unknown step '$part' in ECHOPIPE_GPU_STEPS; steps: ${ALL_STEPS[*]};" \
            "groups: pass1 pass2 all" >&2
          return 2
        fi
        want+="$part "
        ;;
    esac
    named=1
  done
  if ((!named)); then
    echo "ECHOPIPE_GPU_STEPS='$spec' names no step" >&2
    return 2
  fi
  for s in $want; do
    [[ $NO_INSTALL_STEPS != *" $s "* ]] && install=1
  done
  ((install)) && want+="build "
  for s in "${ALL_STEPS[@]}"; do
    [[ $want == *" $s "* ]] && echo "$s"
  done
  return 0
}

SPEC=${ECHOPIPE_GPU_STEPS:-pass1}
if ! PLAN=$(select_steps "$SPEC"); then
  exit 2
fi
mapfile -t SELECTED <<< "$PLAN"
# Steps stop at the budget; each may overrun its timeout by 10 s (--kill-after), and the summary
# (20 s at most) and the tarball follow: one pass within 4 minutes, all steps within 8.
if [[ ${#SELECTED[@]} -ge ${#ALL_STEPS[@]} ]]; then
  DEFAULT_BUDGET=440
else
  DEFAULT_BUDGET=210
fi
BUDGET_S=${ECHOPIPE_GPU_BUDGET_S:-$DEFAULT_BUDGET}

if [[ ${1:-} == --plan ]]; then
  echo "steps: ${SELECTED[*]}"
  echo "budget: ${BUDGET_S}s"
  exit 0
fi
if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUT_DIR | --plan   (ECHOPIPE_GPU_STEPS selects the steps)" >&2
  exit 2
fi
selected() { [[ " ${SELECTED[*]} " == *" $1 "* ]]; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$1"
DEST="$(cd "$1" && pwd)"
OUT="${ECHOPIPE_GPU_WORK:-$(mktemp -d /tmp/echopipe-gpu.XXXXXX)}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
cd "$REPO" || exit 2
: > "$OUT/steps.tsv"
echo "work folder: $OUT; results go to $DEST; steps: ${SELECTED[*]}; budget ${BUDGET_S}s"
START_S=$SECONDS
# The CUDA image's torch lives in its python3; a bare `python` may be absent or another one.
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PY
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONUNBUFFERED=1
# The GPU image's torch and numpy differ from CI's: their deprecation notices are logged, not
# turned into failures by the strict pytest config (CI keeps them errors on its own versions).
# A string, not an array: exported functions run through `bash -c` see only exported strings.
export PYTEST_LENIENT="-W default::DeprecationWarning -W default::FutureWarning -W default::UserWarning"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
# Where the build stamp lives: it outlasts the work folder, not the machine.
STATE="${ECHOPIPE_GPU_STATE:-${XDG_CACHE_HOME:-$HOME/.cache}/echopipe-gpu}"
mkdir -p "$STATE"

# bundle: the work folder's logs, XML and JSON as DEST/gpu_run.tar.gz, with steps.tsv beside it
# (the benchmark's JPEGs and training checkpoints stay out: the device tool returns at most
# 16 MB per file).
bundle() {
  cp "$OUT/steps.tsv" "$DEST/steps.tsv"
  tar -C "$(dirname "$OUT")" --exclude="$(basename "$OUT")/data" --exclude="*/checkpoints" \
    -czf "$DEST/gpu_run.tar.gz" "$(basename "$OUT")"
}

record() {  # record NAME RC SECONDS: one line of steps.tsv
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "logs/$1.log" >> "$OUT/steps.tsv"
}

# step NAME TIMEOUT_S COMMAND...: runs COMMAND (if NAME is selected) with its output in
# logs/NAME.log, bounded by its own timeout and by what is left of the budget.
step() {
  local name=$1 limit=$2
  shift 2
  selected "$name" || return 0
  local left=$((BUDGET_S - (SECONDS - START_S)))
  if ((left < 10)); then
    echo "== $name: no time left in the ${BUDGET_S}s budget" | tee "$OUT/logs/$name.log"
    record "$name" 124 0
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $name (timeout ${limit}s)"
  # timeout(1) runs programs, not shell functions: run an exported function through bash -c.
  if declare -F "${1%% *}" > /dev/null; then
    set -- bash -c "$*"
  fi
  local t0=$SECONDS path=$BASE_PYTHONPATH
  # Only DALI steps see .gpu/site: its packed packages must not shadow the image's elsewhere.
  [[ $DALI_STEPS == *" $name "* && -n $DALI_SITE ]] && path="$DALI_SITE${path:+:$path}"
  PYTHONPATH=$path timeout --kill-after=10 "$limit" "$@" \
    > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  record "$name" "$rc" "$((SECONDS - t0))"
  bundle  # what has run so far comes back even if the device call is cut short later
  if ((rc == 0)); then
    echo "   ok ($((SECONDS - t0))s)"
  elif ((rc == 77)); then
    echo "   skipped: $(tail -n 1 "$OUT/logs/$name.log")"
  else
    echo "   FAILED rc=$rc ($((SECONDS - t0))s); last lines:"
    tail -n 15 "$OUT/logs/$name.log" | sed 's/^/   | /'
  fi
}

# ---- what is being run: commit, uncommitted changes, a hash of the sources ----------------------
# source_hash PATH...: one sha256 over the files' names and contents (caches left out).
source_hash() {
  find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path 'bench/results/*' \
    2> /dev/null | LC_ALL=C sort | xargs -d '\n' sha256sum | sha256sum | cut -c1-16
}
COMMIT=${ECHOPIPE_GIT_COMMIT:-}
DIRTY=${ECHOPIPE_GIT_DIRTY:-}
if [[ -z $COMMIT ]] && git -C "$REPO" rev-parse HEAD > /dev/null 2>&1; then
  COMMIT=$(git -C "$REPO" rev-parse HEAD)
  DIRTY=0
  [[ -n $(git -C "$REPO" status --porcelain --untracked-files=no) ]] && DIRTY=1
fi
case $DIRTY in 1 | true) DIRTY=true ;; 0 | false) DIRTY=false ;; *) DIRTY=null ;; esac
BUILD_INPUTS=(csrc python CMakeLists.txt pyproject.toml)
printf '{"commit": "%s", "dirty": %s, "sources_sha256": "%s", "steps": "%s"}\n' \
  "${COMMIT:-unknown}" "$DIRTY" "$(source_hash "${BUILD_INPUTS[@]}" bench tests)" \
  "${SELECTED[*]}" > "$OUT/source.json"
cat "$OUT/source.json"

# ---- DALI (optional) --------------------------------------------------------------------------
BASE_PYTHONPATH=${PYTHONPATH:-}
DALI_SITE=""
if [[ ! -d .gpu/site && -e .gpu/unpack-dali && -e .gpu/dali.tar.xz.part-0 ]]; then
  # unpack-dali exits 3 when a part is missing: then DALI is skipped, not a failure.
  unpack_dali() {
    # unpack-dali checks the import with `python3`: make that the interpreter the steps use.
    local shim
    shim=$(mktemp -d)
    # A wrapper, not a symlink: a venv's python found through a symlink elsewhere loses its venv.
    printf '#!/bin/sh\nexec "%s" "$@"\n' "$PY" > "$shim/python3"
    chmod +x "$shim/python3"
    PATH="$shim:$PATH" bash .gpu/unpack-dali
    local rc=$?
    rm -rf "$shim"
    if ((rc == 3)); then
      echo "DALI parts incomplete: the DALI steps are skipped"
      return 77
    fi
    return "$rc"
  }
  export -f unpack_dali
  SELECTED+=(unpack_dali)
  step unpack_dali 120 unpack_dali
fi
if [[ -d .gpu/site ]]; then
  # The DALI wheels ship an empty nvidia/__init__.py: first on the path, that regular package
  # would hide the image's own nvidia.* packages (CUDA libraries of torch). Make it a
  # pkgutil-style namespace so both folders' subpackages import.
  init=.gpu/site/nvidia/__init__.py
  if [[ -f $init && ! -s $init ]]; then
    echo "__path__ = __import__('pkgutil').extend_path(__path__, __name__)" > "$init"
  fi
  DALI_SITE="$REPO/.gpu/site"
fi
HAVE_DALI=0
if PYTHONPATH="$DALI_SITE${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}" "$PY" -c "import nvidia.dali" \
  > /dev/null 2>&1; then
  HAVE_DALI=1
fi
export PY OUT REPO HAVE_DALI STATE

# ---- environment ------------------------------------------------------------------------------
env_info() {
  date -u +%FT%TZ
  uname -a
  nvidia-smi
  nvcc --version
  echo "PYTHONPATH=${PYTHONPATH:-}"
  "$PY" "$REPO/bench/gpu/env_info.py"
}
export -f env_info
step environment 60 env_info

# ---- build: CUDA required, the DALI plugin when DALI imports, without it if that fails ---------
# The stamp names what was installed: the build inputs, the interpreter and whether the plugin
# was asked for. A second pass with the same stamp skips the install.
BUILD_STAMP="$(source_hash "${BUILD_INPUTS[@]}") $PY dali=$HAVE_DALI"
export BUILD_STAMP
build() {
  local stamp="$STATE/build.stamp"
  if [[ -f $stamp && $(head -n 1 "$stamp") == "$BUILD_STAMP" ]]; then
    # The plugin's outcome is the stamp's second line: a fallback build stays one.
    [[ $(sed -n 2p "$stamp") == plugin=failed ]] &&
      echo "the earlier build with the DALI plugin failed" > "$OUT/dali_plugin.failed"
    if check_build; then
      echo "the installed build is current (stamp: $BUILD_STAMP): install skipped"
      return 0
    fi
  fi
  rm -f "$stamp" "$OUT/dali_plugin.failed"
  local plugin=none
  if ((HAVE_DALI)); then
    plugin=ok
    if ! install_echopipe ON; then
      echo "== the build with the DALI plugin failed (above); building without it"
      echo "the build with the DALI plugin failed: see logs/build.log" > "$OUT/dali_plugin.failed"
      plugin=failed
      install_echopipe OFF || return 1
    fi
  else
    install_echopipe OFF || return 1
  fi
  check_build || return 1
  printf '%s\nplugin=%s\n' "$BUILD_STAMP" "$plugin" > "$stamp"
}
install_echopipe() {  # install_echopipe ON|OFF: pip install with or without the DALI plugin
  ECHOPIPE_REQUIRE_CUDA=ON ECHOPIPE_REQUIRE_DALI=$1 "$PY" -m pip install --no-build-isolation \
    --no-deps --no-index -v --config-settings="cmake.define.ECHOPIPE_BUILD_DALI=$1" .
}
check_build() {
  # Import from outside the source tree so the installed package (with _C) is the one checked.
  local want_dali=$HAVE_DALI
  [[ -f $OUT/dali_plugin.failed ]] && want_dali=0
  (cd "$OUT" && "$PY" -c "
import json, echopipe
info = echopipe.build_info()
print(json.dumps(info, indent=1))
open('build_info.json', 'w').write(json.dumps(info, indent=1))
for bad, why in ((not info['cuda_compiled'], 'built without CUDA kernels'),
                 (info['cuda_devices'] < 1 and not $ALLOW_NO_DEVICE,
                  'the native core sees no CUDA device'),
                 (not info['dali_plugin_built'] and $want_dali,
                  'DALI is importable but the plugin was not built')):
    if bad:
        raise SystemExit('build check failed: ' + why)
")
}
# Rehearsals on a machine without a GPU set ECHOPIPE_GPU_ALLOW_NO_DEVICE=1 to get past that check.
ALLOW_NO_DEVICE=0
[[ ${ECHOPIPE_GPU_ALLOW_NO_DEVICE:-0} == 1 ]] && ALLOW_NO_DEVICE=1
export ALLOW_NO_DEVICE
export -f build install_echopipe check_build
step build 240 build
if [[ -f $OUT/dali_plugin.failed ]]; then
  record build_dali_plugin 1 0  # a failure, but the non-DALI steps go on
  cp "$OUT/logs/build.log" "$OUT/logs/build_dali_plugin.log"
  HAVE_DALI=0
fi

# ---- tests that need CUDA ---------------------------------------------------------------------
export ECHOPIPE_GPU_EVIDENCE="$OUT"
export ECHOPIPE_TEST_TIMEOUT_S=${ECHOPIPE_TEST_TIMEOUT_S:-60}
# Per-test timeouts: a test hung past its timeout costs itself, not the rest of the step.
step test_gpu 150 bash bench/gpu/pytest_steps.sh test_gpu "$OUT" tests/test_gpu.py

# ---- benchmarks and training --------------------------------------------------------------------
step bench_gather_bw 60 "$PY" bench/gpu/gather_bw.py --out "$OUT" --quick

# The main job on the GPU: one short epoch with DALI's mixed decoder (GPU tensors reach stage 0
# from DALI's stream), then the same with bfloat16 autocast: one step each, so a hang in one
# costs only its own timeout.
train_gpu() {  # train_gpu OUT_NAME [EXTRA ARGS...]
  local name=$1
  shift
  if ((!HAVE_DALI)); then
    echo "DALI is not importable, or the plugin did not build: echopipe train needs it; skipped"
    return 77
  fi
  "$PY" -m echopipe.cli train --epochs 1 --synthetic-per-class 30 --no-progress \
    --decode mixed "$@" --output "$OUT/$name/metrics.json"
}
export -f train_gpu
step train_mixed 80 "train_gpu train_mixed"

# ---- pass 2 -------------------------------------------------------------------------------------
# With a GPU present, caches default to pinned, mapped memory: run the cache's own tests there.
echo_tests() {
  local files=()
  for f in tests/test_echo.py tests/test_echo_cache.py; do
    [[ -f $f ]] && files+=("$f")
  done
  if ((${#files[@]} == 0)); then
    echo "no echo cache test file in tests/"
    return 77
  fi
  bash bench/gpu/pytest_steps.sh test_echo_pinned "$OUT" "${files[@]}"
}
export -f echo_tests
step test_echo_pinned 90 echo_tests
step train_mixed_amp 80 "train_gpu train_mixed_amp --amp"

step bench_pipeline 120 "$PY" bench/pipeline.py --cuda-only --results-dir "$OUT"
dali_bench() {
  if ((!HAVE_DALI)); then
    echo "DALI is not importable, or the plugin did not build: DALI GPU benchmark skipped"
    return 77
  fi
  "$PY" bench/gpu/dali_gpu.py --out "$OUT" --quick
}
export -f dali_bench
step bench_dali_gpu 120 dali_bench

# ---- summary (always runs; prints the table last) ---------------------------------------------
timeout 20 "$PY" bench/gpu/summarize.py "$OUT" | tee "$OUT/summary.txt"
summary_rc=${PIPESTATUS[0]}
cp "$OUT/summary.txt" "$DEST/summary.txt"
[[ -f $OUT/gpu_results.json ]] && cp "$OUT/gpu_results.json" "$DEST/gpu_results.json"
bundle
echo "total $((SECONDS - START_S))s; gpu_results.json, summary.txt, steps.tsv and gpu_run.tar.gz in $DEST"
if ((summary_rc != 0)); then
  exit 1
fi
exit 0
