#!/usr/bin/env bash
# Every CUDA check and GPU benchmark of echopipe, as ONE command on a GPU machine.
#
#   bench/gpu/run.sh OUT_DIR      run the steps ECHOPIPE_GPU_STEPS selects (default: headline,tests)
#   bench/gpu/run.sh --plan       print each pass's steps, timeouts and budget; run nothing
#
# Passes, in run order, each with a budget that holds the sum of its steps' timeouts:
#   headline (240 s): unpack_dali environment build bench_dali_gpu bench_gather_bw test_overlap
#     the figures the visit is for first: DALI mixed-decode echo vs plain DALI, gather vs
#     cudaMemcpy, the stage-stream overlap
#   tests (150 s): test_gpu_kernels test_gpu_streams test_gpu_dali test_gpu_races
#     the GPU tests in four processes, so a CUDA fault in one group cannot fail the others
#   extras (270 s, not in the default): test_echo_pinned bench_pipeline train_mixed
#     train_mixed_amp
# ECHOPIPE_GPU_STEPS is a comma list of step names and passes (headline, tests, extras, all);
# `environment` always runs, and a step that needs the installed package brings `build` (and
# `unpack_dali` before it). `build` skips the install when the same sources were already built
# on this machine. Steps run in the order above. ECHOPIPE_GPU_BUDGET_S caps the whole run;
# ECHOPIPE_GPU_TIMEOUT_SCALE (a whole number, default 1) multiplies every timeout and budget at
# run time, for rehearsals on a machine slower than the GPU machine (--plan shows them unscaled).
#
# Every step has its own timeout, cut to what is left of its pass's budget, and its own log;
# pytest steps have a per-test timeout (ECHOPIPE_TEST_TIMEOUT_S, 20 s here) too. A failed step
# is recorded and the script goes on; it exits non-zero at the end if any step failed (exit
# status 77 from a step means "skipped"). Every benchmark rewrites its JSON after each row and
# every pytest step appends each test's result to its progress file as it ends, so a run cut
# short keeps what it measured.
#
# The build is for one architecture (ECHOPIPE_GPU_CUDA_ARCH, default 90: the H200), and the
# toolchain (compiler, cmake, pybind11, scikit-build-core, nvcc, driver) is printed by the
# environment step and again at the top of the build log.
# DALI: when `.gpu/` holds the parts that /work/shared/gpu/pack-dali made (re-cut into three by
# bench/gpu/recut-dali, so each fits one 64 MiB transfer), `unpack_dali` unpacks them into
# `.gpu/site`, and `.gpu/site` goes on PYTHONPATH for every step after it (the build is made
# against that DALI, and every pytest process imports its plugin; `environment` names any package
# of `.gpu/site` that the image has too: none on the H200 image of 2026-12-04). If the build
# with the DALI plugin fails, echopipe is built again without it (recorded as the step
# `build_dali_plugin`) and every non-DALI step runs.
# The commit comes from git when the tree has it, else from ECHOPIPE_GIT_COMMIT and
# ECHOPIPE_GIT_DIRTY (0/1) set by the caller; a hash of the sources is recorded either way.
#
# The steps write into a work folder (ECHOPIPE_GPU_WORK, default a new temporary one) and
# OUT_DIR receives four files: gpu_results.json, summary.txt (the table printed last), steps.tsv
# and gpu_run.tar.gz (every log, JUnit XML, progress file and JSON of the work folder; refreshed
# after every step).
set -uo pipefail

# name:timeout_s, in run order, per pass.
HEADLINE=(unpack_dali:30 environment:20 build:70 bench_dali_gpu:75 bench_gather_bw:20
  test_overlap:25)
TESTS=(test_gpu_kernels:35 test_gpu_streams:35 test_gpu_dali:45 test_gpu_races:35)
EXTRAS=(test_echo_pinned:60 bench_pipeline:90 train_mixed:60 train_mixed_amp:60)
declare -A PASS_BUDGET=([headline]=240 [tests]=150 [extras]=270)
PASSES=(headline tests extras)
# Steps that need no installed package.
NO_INSTALL_STEPS=" environment unpack_dali build "

declare -A TIMEOUT PASS_OF
ALL_STEPS=()
for pass in "${PASSES[@]}"; do
  declare -n members=${pass^^}
  for entry in "${members[@]}"; do
    TIMEOUT[${entry%%:*}]=${entry##*:}
    PASS_OF[${entry%%:*}]=$pass
    ALL_STEPS+=("${entry%%:*}")
  done
  unset -n members
done

# select_steps SPEC: the steps SPEC names, in run order, one per line; exit 2 on a bad name.
select_steps() {
  local spec=$1 part s p want=" environment " install=0 named=0
  local -a parts
  IFS=, read -ra parts <<< "$spec"
  for part in "${parts[@]}"; do
    part=${part//[[:space:]]/}
    case $part in
      "") continue ;;
      all) want+="${ALL_STEPS[*]} " ;;
      headline | tests | extras)
        for s in "${ALL_STEPS[@]}"; do
          [[ ${PASS_OF[$s]} == "$part" ]] && want+="$s "
        done
        ;;
      *)
        if [[ -z ${TIMEOUT[$part]:-} ]]; then
          echo "unknown step '$part' in ECHOPIPE_GPU_STEPS; steps: ${ALL_STEPS[*]};" \
            "passes: ${PASSES[*]} all" >&2
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
  ((install)) && want+="unpack_dali build "
  for s in "${ALL_STEPS[@]}"; do
    [[ $want == *" $s "* ]] && echo "$s"
  done
  return 0
}

SPEC=${ECHOPIPE_GPU_STEPS:-headline,tests}
if ! PLAN=$(select_steps "$SPEC"); then
  exit 2
fi
mapfile -t SELECTED <<< "$PLAN"
selected() { [[ " ${SELECTED[*]} " == *" $1 "* ]]; }

# The run's budget: the sum of the selected passes' budgets, or ECHOPIPE_GPU_BUDGET_S if lower.
BUDGET_S=0
for pass in "${PASSES[@]}"; do
  for s in "${SELECTED[@]}"; do
    if [[ ${PASS_OF[$s]} == "$pass" ]]; then
      BUDGET_S=$((BUDGET_S + PASS_BUDGET[$pass]))
      break
    fi
  done
done
if [[ -n ${ECHOPIPE_GPU_BUDGET_S:-} ]] && ((ECHOPIPE_GPU_BUDGET_S < BUDGET_S)); then
  BUDGET_S=$ECHOPIPE_GPU_BUDGET_S
fi

# print_plan: per pass, its selected steps with their timeouts, their sum and the budget;
# exit status 3 if a pass's timeouts exceed its budget.
print_plan() {
  local pass s sum line over=0
  for pass in "${PASSES[@]}"; do
    sum=0 line=""
    for s in "${SELECTED[@]}"; do
      [[ ${PASS_OF[$s]} == "$pass" ]] || continue
      sum=$((sum + TIMEOUT[$s]))
      line+=" $s ${TIMEOUT[$s]}s,"
    done
    [[ -z $line ]] && continue
    local verdict="within"
    if ((sum > PASS_BUDGET[$pass])); then
      verdict="OVER"
      over=1
    fi
    echo "pass $pass:${line%,} = ${sum}s, $verdict its budget of ${PASS_BUDGET[$pass]}s"
  done
  echo "steps: ${SELECTED[*]}"
  echo "budget: ${BUDGET_S}s"
  return $((over ? 3 : 0))
}

SCALE=${ECHOPIPE_GPU_TIMEOUT_SCALE:-1}
if [[ ! $SCALE =~ ^[1-9][0-9]?$ ]]; then
  echo "ECHOPIPE_GPU_TIMEOUT_SCALE must be a whole number from 1 to 99, got '$SCALE'" >&2
  exit 2
fi
if [[ ${1:-} == --plan ]]; then
  print_plan
  exit $?
fi
if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUT_DIR | --plan   (ECHOPIPE_GPU_STEPS selects the steps)" >&2
  exit 2
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$1"
DEST="$(cd "$1" && pwd)"
OUT="${ECHOPIPE_GPU_WORK:-$(mktemp -d /tmp/echopipe-gpu.XXXXXX)}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
cd "$REPO" || exit 2
: > "$OUT/steps.tsv"
print_plan
((SCALE > 1)) && echo "every timeout and budget x $SCALE (ECHOPIPE_GPU_TIMEOUT_SCALE)"
echo "work folder: $OUT; results go to $DEST"
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
# One architecture: what the machine has (the H200 is sm_90), not three.
export CUDAARCHS=${ECHOPIPE_GPU_CUDA_ARCH:-90}
# Where the build stamp lives: it outlasts the work folder, not the machine.
STATE="${ECHOPIPE_GPU_STATE:-${XDG_CACHE_HOME:-$HOME/.cache}/echopipe-gpu}"
mkdir -p "$STATE"

# bundle: the work folder's logs, XML and JSON as DEST/gpu_run.tar.gz, with steps.tsv beside it
# (the benchmark's JPEGs and training checkpoints stay out: the results must stay small).
bundle() {
  cp "$OUT/steps.tsv" "$DEST/steps.tsv"
  tar -C "$(dirname "$OUT")" --exclude="$(basename "$OUT")/data" --exclude="*/checkpoints" \
    -czf "$DEST/gpu_run.tar.gz" "$(basename "$OUT")"
}

record() {  # record NAME RC SECONDS: one line of steps.tsv
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "logs/$1.log" >> "$OUT/steps.tsv"
}

declare -A PASS_START
# step NAME COMMAND...: runs COMMAND (if NAME is selected) with its output in logs/NAME.log,
# bounded by its timeout, by what is left of its pass's budget and by the run's budget.
step() {
  local name=$1
  shift
  selected "$name" || return 0
  local pass=${PASS_OF[$name]} limit=$((TIMEOUT[$name] * SCALE))
  [[ -z ${PASS_START[$pass]:-} ]] && PASS_START[$pass]=$SECONDS
  local left=$((PASS_BUDGET[$pass] * SCALE - (SECONDS - PASS_START[$pass])))
  local run_left=$((BUDGET_S * SCALE - (SECONDS - START_S)))
  ((run_left < left)) && left=$run_left
  if ((left < 5)); then
    echo "== $name: no time left in the $pass pass's budget" | tee "$OUT/logs/$name.log"
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
  [[ -d $DALI_SITE ]] && path="$DALI_SITE${path:+:$path}"
  PYTHONPATH=$path timeout --kill-after=5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
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

# ---- DALI (optional): .gpu/site, unpacked by the step unpack_dali from the carried parts ------
BASE_PYTHONPATH=${PYTHONPATH:-}
DALI_SITE="$REPO/.gpu/site"
# dali_importable: whether nvidia.dali imports with .gpu/site first on the path.
dali_importable() {
  PYTHONPATH="$DALI_SITE${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}" "$PY" -c "import nvidia.dali" \
    > /dev/null 2>&1
}
export -f dali_importable
export PY OUT REPO STATE DALI_SITE BASE_PYTHONPATH

# ---- environment: the machine and the toolchain the build will use ------------------------------
toolchain() {
  echo "compiler: $(c++ --version 2> /dev/null | head -n 1 || echo 'no c++')"
  echo "cmake: $(cmake --version 2> /dev/null | head -n 1 || echo 'no cmake')"
  echo "nvcc: $(nvcc --version 2> /dev/null | tail -n 2 | tr '\n' ' ' || echo 'no nvcc')"
  local gpu
  gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2> /dev/null | head -n 1)
  echo "GPU, driver: ${gpu:-nvidia-smi failed or missing}"
  "$PY" - << 'PYEOF'
import importlib.metadata as md
for name in ("pybind11", "scikit-build-core", "ninja", "pip", "torch", "numpy"):
    try:
        print(f"{name}: {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
PYEOF
  echo "python: $("$PY" --version 2>&1) ($PY); CUDA architectures built: $CUDAARCHS"
}
env_info() {
  date -u +%FT%TZ
  uname -a
  toolchain
  nvidia-smi
  echo "PYTHONPATH=${PYTHONPATH:-}"
  "$PY" "$REPO/bench/gpu/env_info.py"
}
export -f toolchain env_info

# ---- DALI parts -> .gpu/site (skipped when already there or not carried) ------------------------
unpack_dali() {
  if [[ -f .gpu/site/nvidia/dali/__init__.py ]]; then
    echo "DALI already unpacked in .gpu/site"
  elif [[ ! -e .gpu/unpack-dali || ! -e .gpu/dali.tar.xz.part-0 ]]; then
    echo "no DALI parts in .gpu/: the DALI steps are skipped"
    return 77
  else
    # unpack-dali checks the import with `python3`: make that the interpreter the steps use.
    local shim rc
    shim=$(mktemp -d)
    # A wrapper, not a symlink: a venv's python found through a symlink elsewhere loses its venv.
    printf '#!/bin/sh\nexec "%s" "$@"\n' "$PY" > "$shim/python3"
    chmod +x "$shim/python3"
    PATH="$shim:$PATH" bash .gpu/unpack-dali
    rc=$?
    rm -rf "$shim"
    if ((rc == 3)); then
      echo "DALI parts incomplete: the DALI steps are skipped"
      return 77
    fi
    ((rc == 0)) || return "$rc"
  fi
  # The DALI wheels ship an empty nvidia/__init__.py: first on the path, that regular package
  # would hide the image's own nvidia.* packages (CUDA libraries of torch). Make it a
  # pkgutil-style namespace so both folders' subpackages import.
  local init=.gpu/site/nvidia/__init__.py
  if [[ -f $init && ! -s $init ]]; then
    echo "__path__ = __import__('pkgutil').extend_path(__path__, __name__)" > "$init"
  fi
}
export -f unpack_dali
step unpack_dali unpack_dali
# After the unpack, so that DALI's versions, its mixed decode and the packages .gpu/site shadows
# are read from what the steps will use.
step environment env_info
HAVE_DALI=0
dali_importable && HAVE_DALI=1
export HAVE_DALI

# ---- build: CUDA required, the DALI plugin when DALI imports, without it if that fails ---------
# The stamp names what was installed: the build inputs, the interpreter and whether the plugin
# was asked for. A second pass with the same stamp skips the install.
BUILD_STAMP="$(source_hash "${BUILD_INPUTS[@]}") $PY dali=$HAVE_DALI sm=$CUDAARCHS"
export BUILD_STAMP
build() {
  toolchain
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
step build build
if [[ -f $OUT/dali_plugin.failed ]]; then
  record build_dali_plugin 1 0  # a failure, but the non-DALI steps go on
  cp "$OUT/logs/build.log" "$OUT/logs/build_dali_plugin.log"
  HAVE_DALI=0
fi

# ---- the headline figures -------------------------------------------------------------------------
export ECHOPIPE_GPU_EVIDENCE="$OUT"
# Per-test timeouts: a test hung past its timeout costs itself, not the rest of the step.
export ECHOPIPE_TEST_TIMEOUT_S=${ECHOPIPE_TEST_TIMEOUT_S:-20} ECHOPIPE_TEST_HARD_GRACE_S=5
dali_bench() {
  if ((!HAVE_DALI)); then
    echo "DALI is not importable, or the plugin did not build: DALI GPU benchmark skipped"
    return 77
  fi
  "$PY" bench/gpu/dali_gpu.py --out "$OUT" --quick
}
export -f dali_bench
step bench_dali_gpu dali_bench
step bench_gather_bw "$PY" bench/gpu/gather_bw.py --out "$OUT" --quick
step test_overlap bash bench/gpu/pytest_steps.sh test_overlap "$OUT" \
  "tests/test_gpu.py::test_stage_streams_overlap_on_one_gpu"

# ---- the GPU tests, in groups: a CUDA fault poisons only its own process -------------------------
# The groups of tests/test_gpu.py (tests/test_gpu_plan.py checks that they cover it exactly).
export GPU_STREAM_TESTS="stale or stage_waits or batches_made or missing_wait or busy_timer"
step test_gpu_kernels bash bench/gpu/pytest_steps.sh test_gpu_kernels "$OUT" tests/test_gpu.py \
  -k "not dali and not ($GPU_STREAM_TESTS) and not stage_streams_overlap"
step test_gpu_streams bash bench/gpu/pytest_steps.sh test_gpu_streams "$OUT" tests/test_gpu.py \
  -k "$GPU_STREAM_TESTS"
step test_gpu_dali bash bench/gpu/pytest_steps.sh test_gpu_dali "$OUT" tests/test_gpu.py -k dali
step test_gpu_races bash bench/gpu/pytest_steps.sh test_gpu_races "$OUT" tests/test_gpu_races.py

# ---- extras (not in the default run) ------------------------------------------------------------
# With a GPU present, caches default to pinned, mapped memory: run the cache's own tests there,
# and EchoLoader's pinned take with asynchronous copies to the device.
step test_echo_pinned bash bench/gpu/pytest_steps.sh test_echo_pinned "$OUT" tests/test_echo.py \
  tests/test_echo_loader_pinning.py
step bench_pipeline "$PY" bench/pipeline.py --cuda-only --results-dir "$OUT"
# One short epoch with DALI's mixed decoder, then the same with bfloat16 autocast.
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
step train_mixed "train_gpu train_mixed"
step train_mixed_amp "train_gpu train_mixed_amp --amp"

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
