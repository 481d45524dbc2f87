#!/usr/bin/env bash
# One prepared GPU check (NVIDIA/AMD), at most 9 minutes: fidelity against transformers on the GPU (KL and top-1,
# prefill and decode paths, float32 and bfloat16, embedded default model; decode runs the Triton kernels under CUDA
# graphs), the Triton kernels against the PyTorch paths and the copy bandwidth (benchmarks/gpu_kernels.py), decode
# step time against the measured HBM copy bandwidth with CUDA graphs and eager on the embedded model, then the
# decode floor at real model shapes with random weights (benchmarks/gpu_shapes.py folders, --load-format dummy:
# Llama-3.2-3B, Qwen3-30B-A3B with 6 layers, DeepSeek-V3 FP8 with 3 layers, Kimi K3 with 2 layers and its 896
# MXFP4 experts, packed as published) at batch 1 / 16 / 64
# with graphs and eager plus an eager torch.profiler breakdown at batch 1, and last ONE summary table
# (benchmarks/gpu_summary.py). Uses the machine's own torch/triton/transformers (PYTHONPATH=., no install, no
# download). Writes into $OUT (the device tool's output folder) or benchmarks/results/gpu.
#   bash benchmarks/gpu_check.sh
# GPU_CHECK_DRY_RUN=1 runs the new steps' wiring on CPU (tiny shapes, 3 steps, batch 1 and 2, graph buffers without
# capture; kl and gpu_kernels skipped: they have their own CPU dry runs), its times meaningless. The full stack
# (tokenfab serve + bench serve: TTFT, TPOT, ITL at real shapes) is the second call, gpu_serve_check.sh.
#
# Time budget (every step has a timeout; the timeouts, not the expected times, add up to at most 540 s = 9 min):
#   preflight, versions, embedded model (one py)  45  (the embedded model is written once here: the two kl
#                                                      runs below would otherwise race to write it)
#   nvidia-smi / rocm-smi                         10
#   eval kl float32 | eval kl bfloat16 | shapes   75  (run side by side: accuracy checks, nothing timed; the
#   | sampling on the device vs the host (70)          shape folders are written on the CPU meanwhile)
#   gpu_kernels.py                               160  (the kernels tune their tiles here: TOKENFAB_TRITON_AUTOTUNE=1;
#                                                      everywhere else each kernel runs its first config)
#   decode_floor embedded (graphs + eager)        45  (eager measured in the same engine, graphs switched off;
#                                                      --also-sync: graph steps again with async scheduling off)
#   decode_floor llama3b / qwen3moe / dsv3 / k3   50 + 45 + 50 + 45 = 190
#   gpu_summary.py                                 5
#   total                                        530 s (+ bash and file writes: well under 540 s)
# The shape runs measure 20 steps per mode and batch at 1,024 context tokens (the embedded model: 512) and profile
# 5 eager steps; each writes its JSON after every row, so a step stopped by its timeout still leaves its rows for
# the summary (marked incomplete).
source "$(dirname "$0")/gpu_env.sh"  # repository root, PY, OUT, SHAPES, DRY
CASES="llama3b qwen3moe dsv3 k3"
DEV=cuda CTX=1024 CTX_EMB=512 STEPS=20 BATCH=1,16,64 TINY=
if [ "$DRY" = 1 ]; then
  DEV=cpu CTX=32 CTX_EMB=32 STEPS=3 BATCH=1,2 TINY=--tiny
  export TOKENFAB_DECODE_GRAPHS=eager  # the padded graph buffers without capture
  export TOKENFAB_ASYNC_SCHEDULING=1  # on CPU it is off by default: the dry run must reach the -sync rows too
fi
timeout 45 $PY -c "
import sys
try:
    import torch, transformers
except ImportError as e:
    print(f'gpu_check.sh: cannot import torch/transformers ({e}); set PY to a Python with them.', file=sys.stderr)
    sys.exit(2)
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)
if not torch.cuda.is_available() and '$DRY' != '1':
    print('gpu_check.sh: torch sees no CUDA/ROCm device here; nothing to check.', file=sys.stderr)
    sys.exit(2)
from tokenfab.default_model import ensure_default_model
ensure_default_model()
" || exit 2
mkdir -p "$OUT"
FAILED="$OUT/failed_steps"
: > "$FAILED"
fail() { echo "$1 FAILED rc=$2" | tee -a "$FAILED"; }
# bg NAME SECONDS CMD...: run CMD under a timeout in the background, its output in $OUT/NAME.log (shown after wait)
bg() { local name=$1 t=$2; shift 2; { timeout "$t" "$@" > "$OUT/$name.log" 2>&1 || fail "$name" $?; } & }
{
  timeout 10 bash -c "nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv 2>/dev/null \
    || rocm-smi 2>/dev/null" || true
  BGS="gpu_shapes"
  if [ "$DRY" != 1 ]; then
    for dt in float32 bfloat16; do
      bg "eval-kl-$dt" 75 $PY -m tokenfab.cli eval kl --device cuda --reference-device cuda --dtype $dt \
        --random-rows 4 --row-len 256 --decode-steps 16 --out "$OUT/kl-$dt"
      BGS="$BGS eval-kl-$dt"
    done
  fi
  bg gpu_shapes 75 $PY benchmarks/gpu_shapes.py --out "$SHAPES" --k3-experts auto $TINY
  bg sampling-check 70 $PY benchmarks/gpu_sampling_check.py --device $DEV --out "$OUT"
  BGS="$BGS sampling-check"
  wait
  for name in $BGS; do echo "== $name"; tail -n 15 "$OUT/$name.log"; done
  if [ "$DRY" != 1 ]; then
    timeout 160 $PY benchmarks/gpu_kernels.py --device cuda --out "$OUT" || fail gpu_kernels $?
  fi
  timeout 45 $PY benchmarks/decode_floor.py --device $DEV --context $CTX_EMB --batch $BATCH --steps $STEPS \
    --also-eager --also-sync --out "$OUT" --label embedded || fail "decode_floor embedded" $?
  declare -A T=([llama3b]=50 [qwen3moe]=45 [dsv3]=50 [k3]=45)
  for case in $CASES; do
    if [ ! -f "$SHAPES/$case/config.json" ]; then fail "decode_floor $case (no shape folder)" 1; continue; fi
    timeout "${T[$case]}" $PY benchmarks/decode_floor.py --model "$SHAPES/$case" --load-format dummy --device $DEV \
      --context $CTX --batch $BATCH --steps $STEPS --also-eager --also-sync --profile-steps 5 --out "$OUT" --label "$case" \
      || fail "decode_floor $case" $?
  done
} 2>&1 | tee "$OUT/gpu_check.log"
# the summary table is the last thing printed: decode floors of every case, graphs vs eager, profiles, failed steps
timeout 5 $PY benchmarks/gpu_summary.py "$OUT" --expect "embedded,${CASES// /,}" --failed "$FAILED" \
  --out "$OUT/gpu-summary.md" 2>&1 | tee -a "$OUT/gpu_check.log"
# exit status 1 when any step failed (listed in $OUT/failed_steps and under the table)
[ -s "$FAILED" ] && exit 1
exit 0
