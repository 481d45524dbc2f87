"""Chunked (WY-form) KDA prefill on the GPU through the flash-linear-attention project's Triton kernels
(``fla-core``, MIT; ``fla.ops.kda.chunk_kda``), an optional dependency (``pip install tokenfab[gpu]``): imported
only when a CUDA / ROCm tensor asks for it, never on CPU paths.

Mapping of layers/kda.py's tensors onto ``chunk_kda`` (fla-core 0.6):

* q, k, v [B, L, H, D] float32: q and k already l2-normalized by the layer (FLA's form, the same as fla's in-kernel
  one) and q already scaled by D^-0.5, so ``use_qk_l2norm_in_kernel=False`` and ``scale=1.0``;
* g [B, L, H, D]: the per-channel log-decay after the gate activation (either gate form: the softplus gate or the
  lower-bound sigmoid), so ``use_gate_in_kernel=False`` and fla applies no activation; beta [B, L, H] after the
  sigmoid (``use_beta_sigmoid_in_kernel=False``);
* initial_state / final state [B, H, D_k, D_v] float32: fla's default layout [K, V] is the layer's S[k, v]
  (``state_v_first=False``), so the state slots are read and written without a transpose;
* padded groups go in as they are (no ``cu_seqlens``): padding tokens carry q = k = v = 0, beta = 0, g = 0 and leave
  the state unchanged, as in the layer's own chunked form, so no host read of the lengths is needed.

fla's chunk kernels multiply float32 tiles with ``tl.dot`` at its default precision (TF32 on NVIDIA), so they are
not exact in float32: the layer takes this path only for bfloat16 / float16 activations and keeps float32 engines on
the exact recurrent kernel (kernels/gpu/kda.py). fla's chunk kernels do not run in Triton's interpreter (their
in-kernel loop indices are Python ints there), so the mapping is checked on a GPU (``benchmarks/gpu_kernels.py``:
max error against layers/kda.py over a K3-shaped prompt) and, in CI, through fla's fused recurrent kernel, which
takes the same conventions and does run in the interpreter (tests/test_triton_kda.py, skipped without fla).
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def importable() -> bool:
    """True when ``fla.ops.kda.chunk_kda`` imports (fla-core installed, with a Triton it accepts)."""
    try:
        from fla.ops.kda import chunk_kda  # noqa: F401
    except Exception:  # ImportError, or an fla / triton version mismatch raising at import
        return False
    return True


def chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over B padded sequences of L tokens by ``fla.ops.kda.chunk_kda`` (chunks of 64).

    Args (float32, CUDA / ROCm): q, k [B, L, H, D] (normalized, q scaled); v [B, L, H, D]; g [B, L, H, D]
        log-decay; beta [B, L, H]; initial_state [B, H, D, D] (S[k, v]).

    Returns:
        (o [B, L, H, D] float32, final state [B, H, D, D] float32).

    Raises:
        ImportError: fla-core is not installed (call only where :func:`importable`).
    """
    from fla.ops.kda import chunk_kda
    with torch.no_grad():
        o, final = chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=initial_state.contiguous(),
                             output_final_state=True, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                             use_beta_sigmoid_in_kernel=False, state_v_first=False)
    return o, final
