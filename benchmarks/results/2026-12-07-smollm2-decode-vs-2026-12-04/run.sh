#!/bin/bash
# Decode steps of SmolLM2-135M (its Q4_1 GGUF served packed, and its dequantized bf16 folder) at a585923 (2026-12-04,
# before the CPU work) and at the commit under test, alternated twice. Run from the repository root:
#   git worktree add ../base a585923   # its own kernels are built on first use
#   OUT=<results folder> BASE=../base bash <this file>
set -u
MAIN=$(pwd)
GG=$(.venv/bin/python -c "from tokenfab.default_model import real_model_gguf; print(real_model_gguf())")
BF=$(.venv/bin/python -c "from tokenfab.default_model import default_model_path; print(default_model_path())")
for round in 1 2; do
  if [ $round = 1 ]; then order="base main"; else order="main base"; fi
  for side in $order; do
    if [ $side = base ]; then DIR=$BASE; else DIR=$MAIN; fi
    for m in q4_1 bf16; do
      if [ $m = q4_1 ]; then M=$GG; else M=$BF; fi
      (cd "$DIR" && PYTHONPATH="$DIR" "$MAIN"/.venv/bin/python benchmarks/decode_floor.py --model "$M" --context 512 \
        --batch 1,4,16 --steps 30 --threads 2 --out "$OUT" --label $side-$m-run$round > "$OUT"/$side-$m-run$round.log 2>&1)
      echo "$(date +%T) $side $m run$round rc=$?"
    done
  done
done
