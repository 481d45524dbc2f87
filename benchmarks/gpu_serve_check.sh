#!/usr/bin/env bash
# The second prepared GPU check (one device call, at most 9 minutes; run after benchmarks/gpu_check.sh): the full
# stack at real model shapes with random weights, packed as published. `tokenfab serve --load-format dummy` plus
# `tokenfab bench serve --power auto` cells (benchmarks/serve_check.py):
#   k3:   Kimi K3's text shape, 2 layers (KDA + dense MLP; gated NoPE MLA + latent MoE of 896 MXFP4 experts top-16),
#         plain and with its DSpark drafter (5 MLA layers at K3's width, dummy weights: gpu_shapes.py k3-dspark,
#         3 drafts at every step: the drafting policy's costs set to 0, or it would soon pause a random drafter and
#         the rows would time plain steps), 1024 in / 128 out at concurrency 1 and 16;
#   dsv3: DeepSeek-V3 FP8 block-scaled, 3 layers, 1024/128 and 8192/1024 at concurrency 16.
# Random weights: the drafter's acceptance is that of random weights (a wiring and cost check, not a quality one).
# Uses the machine's own torch/triton/transformers (PYTHONPATH=., no install, no download). Writes into $OUT (the
# device tool's output folder) or benchmarks/results/gpu, the tables last.
#   bash benchmarks/gpu_serve_check.sh
# GPU_CHECK_DRY_RUN=1 runs the same wiring on CPU at tiny shapes (times meaningless).
#
# Time budget (timeouts): shapes 30 + k3 250 + dsv3 250 = 530 s (each server's start, capture and warm-up included;
# every cell's row is written as it finishes, so a step stopped by its timeout keeps its rows).
source "$(dirname "$0")/gpu_env.sh"  # repository root, PY, OUT, SHAPES, DRY
DEV="--device cuda" TINY= K3_CELLS=1024/128x1,1024/128x16 DS_CELLS=1024/128x16,8192/1024x16 LEN=9300 PPC=1
if [ "$DRY" = 1 ]; then
  DEV="--device cpu --dtype float32" TINY=--tiny K3_CELLS=32/8x1,32/8x2 DS_CELLS=32/8x2 LEN=128 PPC=2
  export TOKENFAB_DECODE_GRAPHS=eager  # the graph buffers' padded path without capture: its steps are counted
fi
mkdir -p "$OUT"
FAILED="$OUT/failed_serve_steps"
: > "$FAILED"
timeout 30 $PY benchmarks/gpu_shapes.py --out "$SHAPES" --cases dsv3,k3 $TINY || { echo "gpu_shapes FAILED"; exit 2; }
SPEC="{\"method\": \"dspark\", \"model\": \"$SHAPES/k3-dspark\", \"num_speculative_tokens\": 3, \"verify_token_cost\": 0.0,"
SPEC="$SPEC \"verify_step_overhead\": 0.0, \"random_row_cost\": 0.0}"
timeout 250 $PY benchmarks/serve_check.py --model "$SHAPES/k3" --label k3 --out "$OUT" --cells "$K3_CELLS" \
  --prompts-per-concurrency $PPC --max-model-len 2048 --server-args "$DEV --load-format dummy" \
  --variant plain= --spec-variant "dspark=$SPEC" || echo "serve_check k3 FAILED rc=$?" | tee -a "$FAILED"
timeout 250 $PY benchmarks/serve_check.py --model "$SHAPES/dsv3" --label dsv3-fp8 --out "$OUT" \
  --cells "$DS_CELLS" --prompts-per-concurrency $PPC --max-model-len $LEN \
  --server-args "$DEV --load-format dummy" || echo "serve_check dsv3 FAILED rc=$?" | tee -a "$FAILED"
echo "## GPU serve check"
for f in "$OUT"/*-k3-serve-check.md "$OUT"/*-dsv3-fp8-serve-check.md; do [ -f "$f" ] && { echo; cat "$f"; }; done
[ -s "$FAILED" ] && { echo; echo "Failed steps:"; cat "$FAILED"; exit 1; }
exit 0
