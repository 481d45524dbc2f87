"""Split-K for the Triton linears at small M (kernels/gpu/fp8_linear.py, kernels/gpu/gguf_linear.py): how many slices
of the input dimension a call is cut into, and the deterministic sum of the slices' partial products.

At decode sizes (1-16 activation rows) a linear has only N / BLOCK_N output tiles: 4096 outputs in tiles of 32 are
128 programs, fewer than an H100/H200 has SMs (132) and far fewer than keep every SM streaming weight bytes (several
programs per SM, each with loads in flight; MI300X has 304 CUs). Cutting K into ``split`` contiguous slices
multiplies the programs by ``split``; each program writes its float32 partial [M, N] product to its own slice of a
buffer [split, M, N] and :func:`reduce_partials` adds the slices in a fixed order (slice 0 first), adds the bias and
rounds once to the output dtype. No float atomics: the result does not depend on scheduling (the same bits on every
run). The buffer is a plain ``torch.empty`` per call whose size depends only on shapes, so a call is CUDA-graph safe
(captured allocations come from the graph's pool). The cost is one extra small launch and 4 * split * M * N bytes
written and read once, negligible against the weight bytes at M <= 64.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

PROGRAMS_PER_SM = 8  # programs to aim for per SM / CU at small M: enough loads in flight to stream HBM


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (NVIDIA) / compute units (ROCm) of ``device``; 4 for CPU tensors in Triton's
    interpreter (tests: small enough that tiny shapes are split). A host query, cached: no device sync."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_split(tiles: int, k_steps: int, device: torch.device, min_steps: int = 4,
                 max_split: int | None = None) -> int:
    """Slices of K for a call with ``tiles`` output tiles and ``k_steps`` iterations of its K loop.

    One slice when the tiles alone give every SM two programs; else enough slices for about PROGRAMS_PER_SM
    programs per SM, each slice keeping at least ``min_steps`` iterations (so its loads can be pipelined), at most
    ``max_split`` (the callers bound the partial buffer's traffic by it), and the count lowered until no slice is
    empty. Depends only on sizes and the device's SM count (CUDA-graph safe).

    Returns:
        split in [1, k_steps], with (split - 1) * ceil(k_steps / split) < k_steps.
    """
    sms = sm_count(device)
    if tiles >= 2 * sms or k_steps < 2 * min_steps:
        return 1
    split = min(triton.cdiv(PROGRAMS_PER_SM * sms, max(tiles, 1)), k_steps // min_steps)
    if max_split is not None:
        split = min(split, max_split)
    split = max(split, 1)
    per = triton.cdiv(k_steps, split)
    return triton.cdiv(k_steps, per)


def max_split_for(weight_bytes: int, M: int, N: int) -> int:
    """The most slices whose float32 partials (written once and read once, 8 * split * M * N bytes, mostly in L2)
    stay within half the weight's bytes."""
    return max(1, weight_bytes // (16 * max(M, 1) * N))


def plan(split: int | None, programs: int, k_steps: int, device: torch.device, weight_bytes: int, M: int, N: int,
         min_steps: int = 8) -> tuple[int, int]:
    """(slices, K-loop iterations per slice) of a call: ``split`` as given (tests, benchmarks) or
    :func:`choose_split` for ``programs`` output tiles with the partials' traffic bounded by :func:`max_split_for`,
    then lowered so that no slice is empty."""
    if split is None:
        split = choose_split(programs, k_steps, device, min_steps=min_steps,
                             max_split=max_split_for(weight_bytes, M, N))
    steps = steps_per_split(k_steps, split)
    return triton.cdiv(k_steps, steps), steps


def steps_per_split(k_steps: int, split: int) -> int:
    """Iterations of the K loop per slice: ceil(k_steps / split) (the last slice may have fewer)."""
    return triton.cdiv(k_steps, split)


@triton.jit
def store_tile(OUT, BIAS, acc, ps, m, n, M, N, mmask, nmask, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The tile kernels' epilogue: ``acc`` [BLOCK_M, BLOCK_N] float32 for rows ``m`` / columns ``n`` into slice
    ``ps`` of the float32 partials [SPLIT, M, N] (``PARTIAL``: the reduction adds the bias), or, plus the bias,
    into the output [M, N] in its dtype."""
    out = OUT + ps.to(tl.int64) * M * N + m[:, None].to(tl.int64) * N + n[None, :]
    mask = mmask[:, None] & nmask[None, :]
    if PARTIAL:
        tl.store(out, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def store_row(OUT, BIAS, y, ps, n, N, nmask, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The one-row kernels' epilogue: ``y`` [BLOCK_N] float32 for columns ``n`` into slice ``ps`` of the float32
    partials [SPLIT, N] (``PARTIAL``), or, plus the bias, into the output row in its dtype."""
    out = OUT + ps.to(tl.int64) * N + n
    if PARTIAL:
        tl.store(out, y, mask=nmask)
    else:
        if HAS_BIAS:
            y += tl.load(BIAS + n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out, y.to(OUT.dtype.element_ty), mask=nmask)


@triton.jit
def _reduce(P, Y, BIAS, MN, N, SPLIT, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.load(P + i, mask=mask, other=0.0)
    for s in range(1, SPLIT):
        acc += tl.load(P + s * MN + i, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + i % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + i, acc.to(Y.dtype.element_ty), mask=mask)


def partial_buffer(split: int, M: int, N: int, device: torch.device) -> torch.Tensor:
    """The float32 [split, M, N] buffer of one split call (uninitialised: every element is written)."""
    return torch.empty(split, M, N, dtype=torch.float32, device=device)


def reduce_partials(partial: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> None:
    """y [M, N] (contiguous, any float dtype) = round(sum over s of partial[s] (+ bias)), summed in float32 in the
    order s = 0, 1, ...

    Args:
        partial: float32 [split, M, N], contiguous.
        bias: [N] or None.
    """
    split, M, N = partial.shape
    block = 1024
    _reduce[(triton.cdiv(M * N, block),)](partial, y, bias if bias is not None else y, M * N, N, split,
                                          HAS_BIAS=bias is not None, BLOCK=block)

