"""Paged decode attention in Triton (CUDA/ROCm), for grouped-query attention and MLA's absorbed latent cache.

One query per sequence attends over its context read in place from the paged pool through the block table:
flash-decoding in two stages (Dao et al., "Flash-Decoding for long-context inference", 2023; the split-KV scheme
FlashInfer and FlashMLA use). Stage 1 splits each sequence's context into ``num_splits`` ranges of whole
``BLOCK_N`` tiles; one program per (block of query heads x slice of value dims, split, sequence x KV head) keeps an
online softmax (base 2) over its range and writes the normalized partial output (q's dtype, as FlashInfer's
split-KV buffer) and its log-sum-exp (float32). Stage 2 merges the splits per (sequence, query head, 128 value
dims). With one split stage 1 writes the output itself and stage 2 is not launched.

Where the bytes and flops go (one bf16 MLA row = 512 latent + 64 rope dims = 1,152 bytes, used by 128 heads):

- Every program that shares a cached row re-reads it; those programs sit next to each other in the launch order
  (the fastest grid axis), so the re-reads hit L2 and HBM sees each row about once. Up to 64 query heads are the
  rows of one ``tl.dot`` (FlashMLA's 64 heads per CTA: with 128 heads each latent row is read by 2 programs, not
  by 8 as with 16-row head blocks); the [64, 512] float32 accumulator spread over 8 warps is 128 registers a
  thread, and configs that slice the 512 value dims over 2 programs (each recomputing the scores) halve that.
- Each split adds a partial output of H x Dv values written and read back (128 KB each way per split for 128
  heads in bf16) against 1,152 bytes per context token: :func:`default_num_splits` balances that cost against
  filling the GPU's multiprocessors (a cost model in its docstring): 66 splits for MLA at batch 1 x 32K on 132
  SMs, one for MLA or GQA at batch 64 x 4K (then no combine pass).
- MLA with 128 heads does 128 x (576 + 512) x 2 = 278,528 flops per 1,152-byte row, 242 per byte, about what a
  Hopper's dense bf16 tensor cores do per byte of HBM bandwidth: at batch 1 as at batch 64 the kernel is bound by
  the tensor cores as much as by memory (GQA with 4 query heads per KV head does 4 flops per byte: memory only).
- ``triton.autotune`` picks head-block height, value slicing, score orientation, tile length and pipeline depth
  per (group size, KV heads, head dims, page size, split count, tokens-per-split bucket) among a few configs
  (``_WIDE_CONFIGS`` for value dims over 256, ``_NARROW_CONFIGS`` else); a config that does not fit a GPU's shared
  memory or registers fails to compile and the tuner skips it. Under Triton's interpreter one fixed config
  (``INTERPRETER_CONFIG``) runs, and float32 caches (fidelity runs) take ``FLOAT32_CONFIG`` untuned.

The key is split as [first Dv dims | remaining D - Dv dims] so that MLA's 576-wide rows need no padding to 1024;
when values are the first Dv dims of the key rows (MLA) and one program holds all value dims, the loaded key tile
is reused as values. Every ``tl.dot`` asks for ``input_precision="ieee"``: float32 runs (the fidelity checks
against transformers) must not drop to TF32; bf16 operands are unaffected.

CUDA graphs: nothing here syncs with the host and every launch shape depends only on (batch, heads, head dims,
max_context); the split ranges come from the context lengths on the device. The tuner benchmarks on the first call
per key, which must happen outside a capture: the graph runner's warm-up calls do, on its padding rows (contexts
of one token), so under graphs the pick rests on launch cost more than on streaming. Reference and fallback:
``layers/paged_attention.py::attention`` (gathered) and the CPU kernel; tests compare them in Triton's
interpreter (tests/test_triton_decode_attention.py).
"""
from __future__ import annotations

import math

import triton
import triton.language as tl
import torch

from tokenfab.kernels.gpu import support

LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(ptrs, row_mask, col_mask, FULL_WIDTH: tl.constexpr):
    """A [rows, cols] tile, masked by rows only when every column is in range: a mask that varies along a row
    stops the 16-byte (cp.async) loads."""
    if FULL_WIDTH:
        tile = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        tile = tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    return tile


@triton.jit(do_not_specialize=["NUM_SPLITS", "CTX_BUCKET", "s_bt"])
def _split_attention(Q, K, V, BT, CL, MO, MLSE,
                     s_qb, s_qh, s_kn, s_ks, s_kh, s_vn, s_vs, s_vh, s_bt, s_mb, s_mh, s_ms,
                     scale_log2, Hk, G, H, NUM_SPLITS, CTX_BUCKET,
                     DV: tl.constexpr, DR: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DR: tl.constexpr,
                     PAGE: tl.constexpr, VALUE_IS_KEY: tl.constexpr, DOT_F32: tl.constexpr,
                     BLOCK_H: tl.constexpr, DV_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, KEYS_AS_ROWS: tl.constexpr):
    # CTX_BUCKET only keys the tuner (tokens per split, a power of two)
    BLOCK_DV: tl.constexpr = BLOCK_DK // DV_SPLIT
    hb = tl.program_id(0) // DV_SPLIT
    dvb = tl.program_id(0) % DV_SPLIT
    split = tl.program_id(1)
    b = tl.program_id(2) // Hk
    hk = tl.program_id(2) % Hk

    hg = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # query head within the KV head's group
    hmask = hg < G
    heads = hk * G + hg
    dk = tl.arange(0, BLOCK_DK)  # score dims [0, DV): all of them, whatever value slice this program writes
    dkmask = dk < DV
    dvo = dvb * BLOCK_DV + tl.arange(0, BLOCK_DV)  # value dims this program accumulates
    dvmask = dvo < DV
    q = _load_rows(Q + b * s_qb + heads[:, None] * s_qh + dk[None, :], hmask, dkmask, BLOCK_DK == DV)
    if DOT_F32:  # the interpreter's dot has no bfloat16: same products, accumulated in float32 as on a GPU
        q = q.to(tl.float32)
    if DR > 0:
        dr = tl.arange(0, BLOCK_DR)
        drmask = dr < DR
        q_r = _load_rows(Q + b * s_qb + heads[:, None] * s_qh + DV + dr[None, :], hmask, drmask, BLOCK_DR == DR)
        if DOT_F32:
            q_r = q_r.to(tl.float32)

    ctx = tl.load(CL + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N  # whole tiles; trailing splits may be empty
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the base-2 logits
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        blk = tl.load(BT + b * s_bt + t // PAGE, mask=tmask, other=0).to(tl.int64)
        slot = (t % PAGE).to(tl.int64)
        row_k = blk * s_kn + slot * s_ks + hk * s_kh
        k = _load_rows(K + row_k[:, None] + dk[None, :], tmask, dkmask, BLOCK_DK == DV)
        if DOT_F32:
            k = k.to(tl.float32)
        if KEYS_AS_ROWS:  # scores as [BLOCK_N, BLOCK_H]: see _WIDE_CONFIGS
            s = tl.dot(k, tl.trans(q), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_N] float32
        if DR > 0:
            k_r = _load_rows(K + row_k[:, None] + DV + dr[None, :], tmask, drmask, BLOCK_DR == DR)
            if DOT_F32:
                k_r = k_r.to(tl.float32)
            if KEYS_AS_ROWS:
                s += tl.dot(k_r, tl.trans(q_r), input_precision="ieee")
            else:
                s += tl.dot(q_r, tl.trans(k_r), input_precision="ieee")
        if KEYS_AS_ROWS:
            s = tl.trans(s)
        s = tl.where(tmask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if VALUE_IS_KEY and DV_SPLIT == 1:
            v = k
        else:
            row_v = blk * s_vn + slot * s_vs + hk * s_vh
            v = _load_rows(V + row_v[:, None] + dvo[None, :], tmask, dvmask, BLOCK_DK == DV)
            if DOT_F32:
                v = v.to(tl.float32)
        if DOT_F32:
            pv = p.to(V.dtype.element_ty).to(tl.float32)  # rounded as the GPU's p.to(v.dtype)
        else:
            pv = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
        m = m_new

    nonempty = l > 0
    out = acc / tl.where(nonempty, l, 1.0)[:, None]  # an empty split writes zeros with weight 0
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))
    tl.store(MO + b * s_mb + heads[:, None] * s_mh + split * s_ms + dvo[None, :], out.to(MO.dtype.element_ty),
             mask=hmask[:, None] & dvmask[None, :])
    if dvb == 0:
        tl.store(MLSE + (b * H + heads) * NUM_SPLITS + split, lse, mask=hmask)


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def _combine(MO, MLSE, O, s_ob, s_oh, H, NUM_SPLITS,
             DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)  # this program's slice of the value dims
    dvmask = dv < DV
    base = (b * H + h) * NUM_SPLITS  # MO [B, H, NUM_SPLITS, DV], MLSE [B, H, NUM_SPLITS]
    mv = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        mv = tl.maximum(mv, tl.load(MLSE + base + sp, mask=sp < NUM_SPLITS, other=float("-inf")))
    m = tl.max(mv, 0)  # split 0 always holds >= 1 token, so m is finite
    acc = tl.zeros([BLOCK_DV], tl.float32)
    den = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        smask = sp < NUM_SPLITS
        w = tl.exp2(tl.load(MLSE + base + sp, mask=smask, other=float("-inf")) - m)
        o = tl.load(MO + (base + sp)[:, None] * DV + dv[None, :], mask=smask[:, None] & dvmask[None, :], other=0.0)
        acc += tl.sum(o.to(tl.float32) * w[:, None], 0)
        den += w
    tl.store(O + b * s_ob + h * s_oh + dv, (acc / tl.sum(den, 0)).to(O.dtype.element_ty), mask=dvmask)


def _cfg(block_h: int, dv_split: int, block_n: int, warps: int, stages: int, keys_as_rows: bool = False):
    return triton.Config({"BLOCK_H": block_h, "DV_SPLIT": dv_split, "BLOCK_N": block_n, "KEYS_AS_ROWS": keys_as_rows},
                         num_warps=warps, num_stages=stages)


# Value dims over 256 (MLA's 512-wide latent): 64 heads per program over 8 warps, the [64, 512] float32
# accumulator split between two Hopper warpgroups (as FlashMLA). Computed as [64 heads, N tokens] the scores are a
# warpgroup MMA that Triton lays out over both warpgroups along the heads, each computing all 64 rows (the 576-deep
# product twice); computed as [N tokens, 64 heads] (KEYS_AS_ROWS) the 8 warps split the heads with no repeat
# (register MMAs). Then 16-token tiles, the value dims sliced over 2 programs (the scores computed by both), and
# 16 heads as the fallback. Compiled ahead of time (Triton's ptxas, sm_90): 214 registers a thread without spills
# for KEYS_AS_ROWS, 255 with under 100 bytes spilled for the other 64-head whole-value tiles, 233 for the value
# slices, 95-180 KB of shared memory. For gfx942 all fit the 64 KB of LDS; KEYS_AS_ROWS spills 1.6 KB there, the
# 16-token and sliced tiles little or nothing, so the tuner has a good candidate on both.
_WIDE_CONFIGS = [_cfg(64, 1, 32, 8, 2, True), _cfg(64, 1, 32, 8, 2), _cfg(64, 1, 16, 8, 2), _cfg(64, 2, 32, 8, 2),
                 _cfg(16, 1, 16, 4, 2)]
# Value dims up to 256 (GQA): all query heads of a KV head in one program (at least the 16 rows a dot needs),
# tiles of 32-128 tokens (72-158 registers on sm_90, several programs per multiprocessor).
_NARROW_CONFIGS = [_cfg(64, 1, 32, 4, 2), _cfg(64, 1, 64, 4, 2), _cfg(64, 1, 64, 4, 3), _cfg(64, 1, 128, 8, 3)]
# The one config Triton's interpreter runs (tests may swap it to cover other head blocks and value slices).
INTERPRETER_CONFIG = {"BLOCK_H": 16, "DV_SPLIT": 1, "BLOCK_N": 16, "KEYS_AS_ROWS": False}
# float32 caches (fidelity checks, not speed): one small config, untuned (IEEE float32 dots run on FMAs, where the
# 64-head tiles would only spill), so those runs compile once and pick the same tiles every time.
FLOAT32_CONFIG = {"BLOCK_H": 16, "DV_SPLIT": 1, "BLOCK_N": 16, "KEYS_AS_ROWS": False}


def _fixed_config(dtype: torch.dtype) -> dict | str | None:
    """The untuned config for this run: ``INTERPRETER_CONFIG`` under Triton's interpreter, ``FLOAT32_CONFIG`` for
    float32 caches on a GPU, "first" (the tuner's first config) when not tuning (support.autotune_enabled), else
    None (``triton.autotune`` picks)."""
    if support.interpreting():
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return FLOAT32_CONFIG
    return None if support.autotune_enabled() else "first"


def _head_rows(block_h: int, group: int) -> int:
    """Query-head rows per program: the config's height, cut to the group rounded up to a power of two but never
    below the 16 rows a ``tl.dot`` takes."""
    return max(16, min(block_h, triton.next_power_of_2(int(group))))


def _fit_configs(configs, named_args, **kwargs):
    """The tuner's early prune: head blocks cut to the group (:func:`_head_rows`), value slices cut to what the
    value width holds (>= 16 dims each), duplicates dropped."""
    G, block_dk = named_args["G"], kwargs.get("BLOCK_DK", named_args.get("BLOCK_DK"))
    seen, out = set(), []
    for c in configs:
        kw = dict(c.kwargs, BLOCK_H=_head_rows(c.kwargs["BLOCK_H"], G),
                  DV_SPLIT=max(1, min(c.kwargs["DV_SPLIT"], block_dk // 16)))
        ident = (tuple(sorted(kw.items())), c.num_warps, c.num_stages)
        if ident not in seen:
            seen.add(ident)
            out.append(triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages))
    return out


def _bench(kernel_call, quantiles):
    """Tuner timing: 5 ms of warm-up and 25 ms of reps per config (L2 flushed between reps, as serving reads each
    layer's cache cold), so a key tunes in well under a second once its configs are compiled."""
    import triton.testing
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


_TUNE_KEY = ["G", "Hk", "DV", "DR", "PAGE", "NUM_SPLITS", "CTX_BUCKET"]
_wide = triton.autotune(_WIDE_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _fit_configs},
                        do_bench=_bench)(_split_attention)
_narrow = triton.autotune(_NARROW_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _fit_configs},
                          do_bench=_bench)(_split_attention)


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors (CUDA) or compute units (ROCm) of ``device``; 8 for a CPU (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def default_num_splits(batch: int, kv_heads: int, group: int, dv: int, row_bytes: int, elem_bytes: int,
                       max_context: int, sms: int) -> int:
    """Context splits per sequence, from shapes only (CUDA-graph safe).

    Cost model, in bytes moved at the memory's rate. ``units = batch * kv_heads * ceil(group / 64)`` programs
    read distinct rows per split; the GPU streams at full rate once ``resident * sms`` programs run (``resident``:
    how many programs a multiprocessor holds, from the float32 accumulator of ``min(group, 64)`` heads x ``dv``:
    1 for MLA's 128 KB, up to 4 for small GQA tiles), so with S splits the KV bytes take
    ``KV * resident * sms / (units * S)`` when the GPU is under-filled. Each split adds its partial output written
    and read back, ``P = 2 * batch * kv_heads * group * dv * elem_bytes``. ``KV * c / S + S * P`` is least at
    ``S = sqrt(KV * c / P)`` (``c = resident * sms / units``), and more splits than fill the GPU (``S > c``) only
    add partials (where the tensor cores bind, as for MLA with 128 heads, the same count fills them). Hence
    ``S = clamp(min(round(c), round(sqrt(KV * c / P))), 1, max_context // 64, 256)``.

    Args:
        batch, kv_heads, group: sequences, KV heads, query heads per KV head.
        dv: value dims; row_bytes: cached bytes per token and KV head (keys and values); elem_bytes: bytes of one
            partial-output element (q's dtype).
        max_context: tokens any sequence may hold; sms: multiprocessors (:func:`multiprocessors`).

    Returns:
        The split count, >= 1.
    """
    heads = min(group, 64)
    resident = max(1, min(4, (128 << 10) // max(1, _head_rows(64, heads) * triton.next_power_of_2(dv) * 4)))
    units = batch * kv_heads * math.ceil(group / 64)
    c = resident * sms / units
    kv = batch * kv_heads * max_context * row_bytes
    partial = 2 * batch * kv_heads * group * dv * elem_bytes
    best = math.sqrt(kv * c / partial)
    return int(max(1, min(round(c), round(best), max_context // 64, 256)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_context: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Decode attention of one query per sequence over a paged cache.

    Args:
        q: [B, H, D] queries (the cache's dtype).
        k_cache: [num_blocks, block_size, Hk, D]; v_cache: [num_blocks, block_size, Hk, Dv] with Dv <= D and H a
            multiple of Hk. Strided views are fine as long as the last dim is contiguous; when ``v_cache`` is a
            view of the first Dv dims of ``k_cache`` (MLA's latent pool) the key tile is reused as values.
        block_tables: [B, max_blocks] int32/int64 pool block ids; context_lens: [B] tokens in each context (>= 1).
        scale: softmax scale applied to q.k.
        max_context: tokens any sequence may hold (sizes the splits; default max_blocks * block_size).
        num_splits: context splits per sequence (default :func:`default_num_splits`).

    Returns:
        [B, H, Dv] in q's dtype; softmax and accumulation in float32, partial outputs of a split context rounded
        to q's dtype before the merge.

    Raises:
        ValueError: mismatched dtypes or head counts, or a last dim that is not contiguous.
    """
    B, H, D = q.shape
    _, page, Hk, Dk = k_cache.shape
    Dv = v_cache.shape[-1]
    if Dk != D or Dv > D or H % Hk or v_cache.shape[2] != Hk:
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} and "
                         f"v_cache {tuple(v_cache.shape)} do not fit (need D == Dk >= Dv, H a multiple of Hk)")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_decode_attention: dtypes differ (q {q.dtype}, k {k_cache.dtype}, "
                         f"v {v_cache.dtype}); cast q to the cache dtype")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode_attention: the last dim of q, k_cache and v_cache must be contiguous")
    G = H // Hk
    DR = D - Dv
    value_is_key = v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride()[:3] == k_cache.stride()[:3]
    if max_context is None:
        max_context = block_tables.shape[1] * page
    if num_splits is None:
        row_bytes = (D if value_is_key else D + Dv) * k_cache.element_size()
        num_splits = default_num_splits(B, Hk, G, Dv, row_bytes, q.element_size(), max_context,
                                        multiprocessors(q.device))
    out = torch.empty(B, H, Dv, dtype=q.dtype, device=q.device)
    mid_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    if num_splits == 1:  # stage 1 writes the output
        mid_o, mid_strides = out, (out.stride(0), out.stride(1), 0)
    else:
        mid_o = torch.empty(B, H, num_splits, Dv, dtype=q.dtype, device=q.device)
        mid_strides = mid_o.stride()[:3]
    block_dk = triton.next_power_of_2(Dv)
    args = (q, k_cache, v_cache, block_tables, context_lens, mid_o, mid_lse,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), *mid_strides,
            float(scale) * LOG2E, Hk, G, H, num_splits,
            triton.next_power_of_2(triton.cdiv(max_context, num_splits)))
    meta = dict(DV=Dv, DR=DR, BLOCK_DK=block_dk, BLOCK_DR=triton.next_power_of_2(max(DR, 16)), PAGE=page,
                VALUE_IS_KEY=value_is_key, DOT_F32=support.interpreting() and q.dtype != torch.float32)

    def grid(cfg):
        return (triton.cdiv(G, cfg["BLOCK_H"]) * cfg["DV_SPLIT"], num_splits, B * Hk)

    fixed = _fixed_config(q.dtype)
    if fixed == "first":  # not tuning (support.autotune_enabled): the first config the tuner would try
        first = _fit_configs([(_WIDE_CONFIGS if Dv > 256 else _NARROW_CONFIGS)[0]], {"G": G}, BLOCK_DK=block_dk)[0]
        _split_attention[grid(first.kwargs)](*args, **meta, **first.kwargs, num_warps=first.num_warps,
                                             num_stages=first.num_stages)
    elif fixed is not None:
        fitted = _fit_configs([triton.Config(dict(fixed))], {"G": G}, BLOCK_DK=block_dk)[0]
        _split_attention[grid(fitted.kwargs)](*args, **meta, **fitted.kwargs, num_warps=4, num_stages=2)
    else:
        (_wide if Dv > 256 else _narrow)[grid](*args, **meta)
    if num_splits > 1:
        block_dv = min(block_dk, 128)  # value slices of 128: 4 programs per MLA head, each 32 splits at a time
        _combine[(B, H, triton.cdiv(Dv, block_dv))](mid_o, mid_lse, out, out.stride(0), out.stride(1), H, num_splits,
                                                     DV=Dv, BLOCK_DV=block_dv, BLOCK_S=32)
    return out
