"""Rows of a GGUF-packed weight, dequantized (csrc/gguf_embedding.cpp): token embeddings served from the packed file.
"""
from __future__ import annotations

import torch

from tokenfab.kernels.cpu import build


def gguf_embedding(tiles: torch.Tensor, ggml_type: int, n: int, ids: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of a GGUF weight W [n, K] packed as tiles (as for :func:`gguf_linear`), dequantized.

    Args:
        tiles, ggml_type, n: the packed weight, as for :func:`gguf_linear`.
        ids: int64 row indices, any shape, each in [0, n).
        dtype: torch.bfloat16 or torch.float32.

    Returns:
        ids.shape + [K] in ``dtype``: gguf's float32 values (d q for Q8_0, d (q - 8) for Q4_0, q d + m for Q4_1;
        gguf-py ``quants.dequantize``), rounded to nearest even for bfloat16. Plain C++: needs the kernels built, not
        AVX512-BF16.

    Raises:
        RuntimeError: an id outside [0, n) or tiles that do not hold n rows of that type.
    """
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"gguf_embedding: dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    return build.load().gguf_embedding(tiles, int(ggml_type), int(n), ids, dtype == torch.bfloat16)
