# Sourced by the prepared GPU checks (gpu_check.sh, gpu_serve_check.sh, gpu_gguf_check.sh): run from the repository
# root with the machine's own Python (PY, default python3; PYTHONPATH=., no install), results into OUT (default
# benchmarks/results/gpu), shape folders in SHAPES, and DRY=1 under GPU_CHECK_DRY_RUN=1 (the CPU wiring run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-benchmarks/results/gpu}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENFAB_CACHE=${TOKENFAB_CACHE:-/tmp/tokenfab-cache}
PY=${PY:-python3}
SHAPES=${SHAPES:-/tmp/tokenfab-gpu-shapes}
DRY=${GPU_CHECK_DRY_RUN:-0}
# Pure-Python wheels carried into the repository's .whl/ (benchmarks/gpu_wheels.sh; the device call's carry):
# unpacked into a folder on PYTHONPATH, no pip, no network.
if compgen -G ".whl/*.whl" > /dev/null; then
  EXTRA=/tmp/tokenfab-extra-wheels
  rm -rf "$EXTRA"  # this checkout's wheels only: nothing left from an earlier unpack shadows them
  "$PY" -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('$EXTRA') for w in glob.glob('.whl/*.whl')]" \
    && export PYTHONPATH=$EXTRA:$PYTHONPATH && echo "carried wheels: $(ls .whl | tr '\n' ' ')"
fi
# The CPU dry runs (DRY=1) run on the fused CPU kernels, which a new checkout builds once (about 2 minutes, longer
# than a step's timeout): build them here, untimed, so the first dry run of a fresh clone measures what a rerun would.
# (On a GPU nothing builds them: the device path never loads them.)
if [ "$DRY" = 1 ]; then
  "$PY" -c "from tokenfab.kernels.cpu import build; build.load()" || true
fi
