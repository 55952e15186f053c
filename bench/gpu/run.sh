#!/usr/bin/env bash
# Every CUDA check and GPU benchmark of echopipe in one short run (about 8 minutes at most).
#
#   bench/gpu/run.sh OUT_DIR
#
# Run from anywhere on a CUDA machine with torch, nvcc, cmake, pybind11 and scikit-build-core.
# DALI is optional: when `.gpu/site` exists (see /work/shared/gpu/README.md; `.gpu/unpack-dali`
# is run first if only the parts are there) it is put on PYTHONPATH, and the DALI plugin is then
# built and tested too. Steps: environment, build with CUDA required, tests/test_gpu.py (gather
# kernels vs CPU, pinned + mapped memory, stale pipeline on GPU streams, proof of stream
# overlap, DALI mixed decode), the echo cache's own tests with a GPU present, the H2D gather
# bandwidth against cudaMemcpy, bench/pipeline.py on CUDA, DALI GPU throughput, `echopipe train`
# for one short epoch with mixed decoding and with --amp, and a summary
# (OUT_DIR/gpu_results.json, with date, GPU and driver) printed last.
#
# Every step has a timeout and its own log. A failed step is recorded and the script goes on;
# it exits non-zero at the end if any step failed. Exit status 77 from a step means "skipped"
# (e.g. no DALI) and is not a failure.
#
# The device tool brings back at most 8 files from its $OUT, so the steps write into a work
# folder (ECHOPIPE_GPU_WORK, default a new temporary one) and OUT_DIR receives four files:
# gpu_results.json, summary.txt (the table printed last), steps.tsv and gpu_run.tar.gz (every
# log, JUnit XML and JSON of the work folder; refreshed after every step, so a run cut short
# still brings back what it did).
set -uo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUT_DIR" >&2
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
echo "work folder: $OUT; results go to $DEST"

# Steps stop at 440 s; each may overrun its timeout by 10 s (--kill-after), and the summary
# (20 s at most) and the tarball follow, all inside 8 minutes.
BUDGET_S=${ECHOPIPE_GPU_BUDGET_S:-440}
START_S=$SECONDS
# The CUDA image's torch lives in its python3; a bare `python` may be absent or another one.
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONUNBUFFERED=1
# The GPU image's torch and numpy differ from CI's: their deprecation notices are logged, not
# turned into failures by the strict pytest config (CI keeps them errors on its own versions).
# A string, not an array: exported functions run through `bash -c` see only exported strings.
export PYTEST_LENIENT="-W default::DeprecationWarning -W default::FutureWarning -W default::UserWarning"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

# bundle: the work folder's logs, XML and JSON as DEST/gpu_run.tar.gz, with steps.tsv beside it
# (the benchmark's JPEGs and training checkpoints stay out: the device tool returns at most
# 16 MB per file).
bundle() {
  cp "$OUT/steps.tsv" "$DEST/steps.tsv"
  tar -C "$(dirname "$OUT")" --exclude="$(basename "$OUT")/data" --exclude="*/checkpoints" \
    -czf "$DEST/gpu_run.tar.gz" "$(basename "$OUT")"
}

# step NAME TIMEOUT_S COMMAND...: runs COMMAND with its output in logs/NAME.log, bounded by its
# own timeout and by what is left of the total budget; records "name rc seconds log".
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - (SECONDS - START_S)))
  if ((left < 10)); then
    echo "== $name: no time left in the ${BUDGET_S}s budget" | tee "$OUT/logs/$name.log"
    printf '%s\t%s\t%s\t%s\n' "$name" 124 0 "logs/$name.log" >> "$OUT/steps.tsv"
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $name (timeout ${limit}s)"
  # timeout(1) runs programs, not shell functions: run an exported function through bash -c.
  if declare -F "$1" > /dev/null; then
    set -- bash -c "$1"
  fi
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "logs/$name.log" >> "$OUT/steps.tsv"
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

# ---- DALI (optional) --------------------------------------------------------------------------
if [[ ! -d .gpu/site && -e .gpu/unpack-dali && -e .gpu/dali.tar.xz.part-0 ]]; then
  # unpack-dali exits 3 when a part is missing: then DALI is skipped, not a failure.
  unpack_dali() {
    bash .gpu/unpack-dali
    local rc=$?
    if ((rc == 3)); then
      echo "DALI parts incomplete: the DALI steps are skipped"
      return 77
    fi
    return "$rc"
  }
  export -f unpack_dali
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
  export PYTHONPATH="$REPO/.gpu/site${PYTHONPATH:+:$PYTHONPATH}"
fi
HAVE_DALI=0
if "$PY" -c "import nvidia.dali" > /dev/null 2>&1; then
  HAVE_DALI=1
fi
export PY OUT REPO HAVE_DALI

# ---- environment ------------------------------------------------------------------------------
env_info() {
  date -u +%FT%TZ
  uname -a
  nvidia-smi
  nvcc --version
  "$PY" - << 'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} cc {p.major}.{p.minor} {p.total_memory / 2**30:.0f} GiB")
try:
    import nvidia.dali as d
    print("dali", d.__version__)
except ImportError:
    print("dali: not importable")
assert torch.cuda.is_available(), "torch sees no CUDA device"
EOF
}
export -f env_info
step environment 60 env_info

# ---- build: CUDA required (and the DALI plugin when DALI is importable) ------------------------
build() {
  local require_dali=OFF
  ((HAVE_DALI)) && require_dali=ON
  ECHOPIPE_REQUIRE_CUDA=ON ECHOPIPE_REQUIRE_DALI=$require_dali \
    "$PY" -m pip install --no-build-isolation --no-deps --no-index -v . || return 1
  # Import from outside the source tree so the installed package (with _C) is the one checked.
  (cd "$OUT" && "$PY" -c "
import json, echopipe
info = echopipe.build_info()
print(json.dumps(info, indent=1))
open('build_info.json', 'w').write(json.dumps(info, indent=1))
assert info['cuda_compiled'], 'built without CUDA kernels'
assert info['cuda_devices'] > 0, 'the native core sees no CUDA device'
assert info['dali_plugin_built'] or not $HAVE_DALI, 'DALI is importable but the plugin was not built'
")
}
export -f build
step build 240 build

# ---- tests that need CUDA ---------------------------------------------------------------------
export ECHOPIPE_GPU_EVIDENCE="$OUT"
# The installed echopipe is used (not python/ of the checkout): pytest runs from the repo root,
# which does not put python/ on sys.path.
step test_gpu 150 "$PY" -m pytest tests/test_gpu.py -v -rs -p no:cacheprovider \
  $PYTEST_LENIENT --junitxml="$OUT/test_gpu.xml"

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
  "$PY" -m pytest "${files[@]}" -q -rs -p no:cacheprovider $PYTEST_LENIENT \
    --junitxml="$OUT/test_echo_pinned.xml"
}
export -f echo_tests
step test_echo_pinned 90 echo_tests

# The main job on the GPU: one short epoch each with DALI's mixed decoder (GPU tensors reach
# stage 0 from DALI's stream) and with bfloat16 autocast, on the cached synthetic set.
train_gpu() {
  if ((!HAVE_DALI)); then
    echo "DALI is not importable (no .gpu/site): echopipe train needs it; skipped"
    return 77
  fi
  local common=(train --epochs 1 --synthetic-per-class 30 --no-progress) mixed amp
  # Both run even when the first fails: they test different paths (GPU decode, autocast).
  "$PY" -m echopipe.cli "${common[@]}" --decode mixed --output "$OUT/train_mixed/metrics.json"
  mixed=$?
  "$PY" -m echopipe.cli "${common[@]}" --amp --output "$OUT/train_amp/metrics.json"
  amp=$?
  return $((mixed ? mixed : amp))
}
export -f train_gpu
step train_gpu 90 train_gpu

# ---- benchmarks -------------------------------------------------------------------------------
step bench_gather_bw 90 "$PY" bench/gpu/gather_bw.py --out "$OUT" --quick
step bench_pipeline 150 "$PY" bench/pipeline.py --quick --results-dir "$OUT"
dali_bench() {
  if ((!HAVE_DALI)); then
    echo "DALI is not importable (no .gpu/site): DALI GPU benchmark skipped"
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
echo "total ${SECONDS}s; gpu_results.json, summary.txt, steps.tsv and gpu_run.tar.gz in $DEST"
if ((summary_rc != 0)); then
  exit 1
fi
exit 0
