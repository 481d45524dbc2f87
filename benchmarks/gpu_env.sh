# Sourced by the prepared GPU checks (gpu_check.sh, gpu_serve_check.sh): run from the repository root with the
# machine's own Python (PY, default python3; PYTHONPATH=., no install), results into OUT (default
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
  "$PY" -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('$EXTRA') for w in glob.glob('.whl/*.whl')]" \
    && export PYTHONPATH=$EXTRA:$PYTHONPATH && echo "carried wheels: $(ls .whl | tr '\n' ' ')"
fi
