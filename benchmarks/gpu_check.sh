#!/usr/bin/env bash
# One prepared GPU check (NVIDIA/AMD), at most 9 minutes: fidelity against transformers on the GPU (KL and top-1,
# prefill and decode paths, float32 and bfloat16, embedded default model; decode runs the Triton kernels under CUDA
# graphs), the Triton kernels against the PyTorch paths and the copy bandwidth (benchmarks/gpu_kernels.py), and
# decode step time against the measured HBM copy bandwidth with CUDA graphs and with --enforce-eager side by side, and
# streaming smoothness (median ITL vs median TPOT of tokenfab serve at concurrency 16, benchmarks/streaming_itl.py). Uses the machine's own torch/transformers (PYTHONPATH=., no install). Writes into $OUT (the
# device tool's output folder) or benchmarks/results/gpu.
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENFAB_CACHE=${TOKENFAB_CACHE:-/tmp/tokenfab-cache}
PY=${PY:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  echo "gpu_check.sh: '$PY' cannot import torch; set PY to a Python with torch (e.g. PY=.venv/bin/python)." >&2
  exit 2
fi
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check.sh: torch sees no CUDA/ROCm device here; nothing to check." >&2
  exit 2
fi
mkdir -p "$OUT"
FAILED="$OUT/failed_steps"
: > "$FAILED"
fail() { echo "$1 FAILED rc=$2" | tee -a "$FAILED"; }
{
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv 2>/dev/null || rocm-smi 2>/dev/null || true
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
  for dt in float32 bfloat16; do
    timeout 75 $PY -m tokenfab.cli eval kl --device cuda --reference-device cuda --dtype $dt \
      --random-rows 4 --row-len 256 --decode-steps 16 --out "$OUT/kl-$dt" || fail "eval kl $dt" $?
  done
  timeout 150 $PY benchmarks/gpu_kernels.py --device cuda --out "$OUT" || fail gpu_kernels $?
  timeout 75 $PY benchmarks/decode_floor.py --device cuda --batch 1,16,64 --steps 30 --out "$OUT" --label graphs \
    || fail "decode_floor (graphs)" $?
  timeout 75 $PY benchmarks/decode_floor.py --device cuda --batch 1,16,64 --steps 30 --out "$OUT" --label eager \
    --enforce-eager || fail "decode_floor (eager)" $?
  timeout 90 $PY benchmarks/streaming_itl.py --server-timeout 70 --out "$OUT" --label gpu \
    || fail streaming_itl $?
} 2>&1 | tee "$OUT/gpu_check.log"
# step timeouts sum to 540 s (9 minutes); exit status 1 when any step failed (listed in $OUT/failed_steps)
if [ -s "$FAILED" ]; then echo "gpu_check.sh: $(wc -l < "$FAILED") step(s) failed:"; cat "$FAILED"; exit 1; fi
echo "gpu_check.sh: all steps passed"
