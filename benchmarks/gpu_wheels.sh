#!/usr/bin/env bash
# Fetch the small pure-Python wheels the prepared GPU checks may use on a machine without network (into .whl/,
# ignored by git): fla-core (KDA's chunked prefill, kernels/gpu/kda_chunk.py) and its one dependency, einops, and
# gguf (gguf-py, for benchmarks/gpu_gguf_check.sh; its own dependencies come with transformers).
# Run here, then pass carry [".whl"] to the device call; benchmarks/gpu_env.sh unpacks them on the GPU machine.
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: -d .whl fla-core einops gguf
ls -la .whl
