#!/usr/bin/env bash
# One prepared GPU check (NVIDIA/AMD), under 10 minutes: fidelity against transformers on the GPU (KL and top-1,
# prefill and decode paths, float32 and bfloat16, embedded default model; decode runs the Triton kernels under CUDA
# graphs), the Triton kernels against the PyTorch paths and the copy bandwidth (benchmarks/gpu_kernels.py), and
# decode step time against the measured HBM copy bandwidth with CUDA graphs and with --enforce-eager side by side. Uses the machine's own torch/transformers (PYTHONPATH=., no install). Writes into $OUT (the
# device tool's output folder) or benchmarks/results/gpu.
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENFAB_CACHE=${TOKENFAB_CACHE:-/tmp/tokenfab-cache}
PY=${PY:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv 2>/dev/null || rocm-smi 2>/dev/null || true
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
  for dt in float32 bfloat16; do
    timeout 150 $PY -m tokenfab.cli eval kl --device cuda --reference-device cuda --dtype $dt \
      --random-rows 4 --row-len 256 --decode-steps 16 --out "$OUT/kl-$dt" || echo "eval kl $dt FAILED rc=$?"
  done
  timeout 120 $PY benchmarks/gpu_kernels.py --device cuda --out "$OUT" || echo "gpu_kernels FAILED rc=$?"
  timeout 90 $PY benchmarks/decode_floor.py --device cuda --batch 1,16,64 --steps 30 --out "$OUT" --label graphs \
    || echo "decode_floor (graphs) FAILED rc=$?"
  timeout 90 $PY benchmarks/decode_floor.py --device cuda --batch 1,16,64 --steps 30 --out "$OUT" --label eager \
    --enforce-eager || echo "decode_floor (eager) FAILED rc=$?"
} 2>&1 | tee "$OUT/gpu_check.log"
