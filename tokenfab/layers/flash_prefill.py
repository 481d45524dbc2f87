"""CPU prefill attention at flash speed: online softmax over key tiles, the causal mask never materialized.

Two kernels, by CPU path (``TOKENFAB_CPU_ISA``), each where it measured fastest:

* AVX512-BF16 without AMX, bf16: tokenfab's own (``kernels/cpu/csrc/flash_prefill.cpp`` through
  :func:`tokenfab.kernels.dispatch.flash_prefill_attention`): per tile of 64 query rows (the grouped query heads of a
  KV head stacked), blocks of 64 keys scored and applied by two brgemms, the mask only on diagonal blocks, key
  blocks past the tile's last visible key skipped. It reads each query's own position, so chunks after cached keys
  need nothing more.
* AMX (and float32 there), and float32 at the ``avx2`` level (CPUs without AVX512-BF16, where ``dtype="auto"`` is
  float32): PyTorch's CPU flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``: tiles
  of queries and keys, an online softmax in float32, tiles above the causal diagonal skipped, grouped-query heads
  read in place), which this module maps a prefill group onto. A group's sequence b has its queries at positions
``start_b .. start_b + n_b - 1`` (query index i at ``start_b + i``; padding rows at the end) over keys
``0 .. start_b + n_b - 1``:

* every ``start_b`` is 0 (whole prompts, the common case): one causal call. The kernel's causal mask is aligned at
  the top left (query i sees keys 0..i), which is position order here; a padding query sees keys past its
  sequence's end and its output is discarded.
* otherwise (a chunk after earlier chunks or a prefix-cache hit): two calls merged by their log-sum-exp, as
  FlashAttention's split-KV and vLLM's ``merge_attn_states`` do: the prefix keys ``0 .. start_b - 1``, which every
  query of the chunk sees (one key-padding row [B, 1, 1, P] where the starts differ, no mask where they agree), and
  the chunk's own keys (positions ``start_b + j``), causal from the top left again.

Values narrower than the keys (MLA): where the values are the keys' first columns (the absorbed form's latent rows)
the keys serve as values and the output is cut; otherwise the values are zero-padded to the key width (the kernel
wants one width). Taken where it is measured faster than the GEMM + fused-softmax path (:func:`applies`).
"""
from __future__ import annotations

import functools

import torch

from tokenfab.kernels import dispatch
from tokenfab.kernels.cpu import isa as cpu_isa
from tokenfab.layers.attention_metadata import AttentionGroup
from tokenfab.layers.long_context_attention import merge_partial


@functools.lru_cache(maxsize=1)
def _amx() -> bool:
    return cpu_isa.selected_level() == "amx"


@functools.lru_cache(maxsize=1)
def _avx2() -> bool:
    return cpu_isa.selected_level() == "avx2"


# float32 on AVX512 without AMX: PyTorch's flash kernel from this many keys (shorter: the fused path, measured faster)
FLOAT32_FLASH_MIN_KEYS = 1024


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True where a flash kernel is the fastest prefill attention: CPU tensors of one dtype, float32 or bfloat16
    (q [B, H, Q, D], k [B, Hk, L, D], v [B, Hk, L, Dv]), values no wider than the keys, and on the AMX path
    (PyTorch's kernel), float32 at the ``avx2`` level or with at least FLOAT32_FLASH_MIN_KEYS keys at the
    ``avx512_bf16`` level (PyTorch's kernel), or, without AMX, bf16 that tokenfab's kernel runs. Measured one
    thread, SmolLM2's shapes: on a Xeon with AMX PyTorch's flash call took 0.21-0.31x the GEMM + fused-softmax
    path's time for a 1,024-token prompt (benchmarks/results/2026-12-02-prefill-vs-peers-profile.md); on an AMD EPYC
    without AMX it took 1.16-1.98x in bf16, and tokenfab's kernel 0.47-0.82x
    (benchmarks/results/2026-12-05-prefill-attention.md); in float32 it took 0.51-0.85x on an AMD EPYC without
    AVX512 (benchmarks/results/2026-12-06-prefill-attention-avx2-f32.md) and, on one with AVX512-BF16, 0.64-0.69x
    from 1,024 keys but 1.11x on a lone 512-token prompt
    (benchmarks/results/2026-12-07-prefill-attention-avx512-f32.md). bf16 at the avx2 level keeps the fused path."""
    if not (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k.dtype == q.dtype
            and v.dtype == q.dtype and v.shape[-1] <= q.shape[-1]):
        return False
    if _amx():
        return True
    if q.dtype == torch.float32:
        return _avx2() or k.shape[-2] >= FLOAT32_FLASH_MIN_KEYS
    return dispatch.flash_prefill_applies(q, k, v)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                         scale=scale)
    return o, lse


def _starts(group: AttentionGroup) -> list[int]:
    """Each sequence's first query position (one host read per step, cached on the group)."""
    s = group.__dict__.get("_flash_starts")
    if s is None:
        s = group.query_pos[:, 0].clamp(min=0).tolist()
        group.__dict__["_flash_starts"] = s
    return s


def flash_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AttentionGroup,
                            scale: float) -> torch.Tensor:
    """Causal prefill attention of a group (call where :func:`applies`).

    Args:
        q: [B, H, Q, D] queries (Q = the group's q_len).
        k: [B, Hk, L, D] the group's gathered context (L >= every sequence's context; H a multiple of Hk).
        v: [B, Hk, L, Dv], Dv <= D.
        group: the prefill group (``query_pos`` [B, Q], -1 for padding).
        scale: softmax scale.

    Returns:
        [B, H, Q, Dv] in q's dtype (padding rows hold values to discard).
    """
    if not _amx() and dispatch.flash_prefill_applies(q, k, v):
        return dispatch.flash_prefill_attention(q, k, v, group.query_pos, scale)
    B, H, Q, D = q.shape
    Dv = v.shape[-1]
    if Dv < D:
        same = v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and v.shape[:-1] == k.shape[:-1]
        v = k if same else torch.nn.functional.pad(v, (0, D - Dv))
    starts = _starts(group)
    P = max(starts)
    if P == 0:
        o, _ = _flash(q, k[:, :, :Q], v[:, :, :Q], True, None, scale)
        return o[..., :Dv] if Dv < D else o
    # the chunk's own keys: positions start_b + j, gathered in query order (padding rows read position 0)
    pos = group.query_pos.clamp(min=0)  # [B, Q]
    rows = torch.arange(B, device=q.device).unsqueeze(1)
    kc = k.transpose(1, 2)[rows, pos].transpose(1, 2)  # [B, Hk, Q, D]
    vc = v.transpose(1, 2)[rows, pos].transpose(1, 2)
    o_chunk, lse_chunk = _flash(q, kc, vc, True, None, scale)
    if min(starts) == P:  # every sequence has the same prefix length: no mask
        o_pre, lse_pre = _flash(q, k[:, :, :P], v[:, :, :P], False, None, scale)
    else:  # key j < start_b visible to every query of sequence b: a [B, 1, 1, P] key-padding row
        st = torch.tensor(starts, device=q.device)
        visible = torch.arange(P, device=q.device).view(1, -1) < st.view(-1, 1)
        mask = torch.zeros(B, 1, 1, P, dtype=q.dtype, device=q.device).masked_fill_(~visible.view(B, 1, 1, P),
                                                                                     float("-inf"))
        o_pre, lse_pre = _flash(q, k[:, :, :P], v[:, :, :P], False, mask, scale)
        none = (st == 0).view(B, 1, 1)  # sequences without a prefix: their prefix call saw no key
        lse_pre = lse_pre.masked_fill(none, float("-inf"))
        o_pre = o_pre.masked_fill(none.unsqueeze(-1), 0.0)
    out = o_pre.float()
    lse = lse_pre.float()
    merge_partial(out, lse, 0, Q, o_chunk, lse_chunk.float())
    out = out[..., :Dv] if Dv < D else out
    return out.to(q.dtype)
