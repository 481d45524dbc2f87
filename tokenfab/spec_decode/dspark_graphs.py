"""The DSpark drafter's pass replayed from CUDA graphs, one per padded batch size (as the target's decode steps:
engine/cuda_graph_runner.py).

A drafter pass is a few dozen small kernels per draft layer (norms, projections, RoPE, the tail copy and row write,
decode attention over the latent pool, the MLP) plus the LM head over the block's draft slots. At batch 1 its launch
overhead alone can exceed its work, so where the target's decode steps replay graphs the drafter's pass does too.
Its shapes are static per batch size since the pass reads its keys in place
(:class:`~tokenfab.models.dspark_drafter.PagedDraftContext`): the block tables have a fixed width (the block
manager's blocks per sequence plus the tail blocks), the context length is data.

Per step: B sequences' anchors, positions and tables go to the first B rows of static buffers in one copy from one
host staging buffer; rows B .. bs - 1 are padding. A padding row drafts from an empty context (anchor token 0 at
position 0) through the tail blocks of a spare scheduler row (``pad_row``, the proposer allocates its tail), so it
reads and writes no block a sequence owns: its tail copy reads pool block 0 and writes only the spare tail. Its
drafts are dropped. The graph computes the base draft logits [bs, m, V] float32 into a static output; the Markov
bias and the draws (sample_in_order) run after it, as in the eager path.

``mode="eager"`` runs the same padded static-buffer path without capture on any device: tests check it draft for
draft against the plain path on CPU, which covers the padding and buffer logic that capture would freeze.
Unmeasured so far: capture itself and its speed (benchmarks/gpu_serve_check.sh serves Kimi K3 shapes with the
drafter; the first lent GPU answers).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from tokenfab.engine.input_staging import PinnedHostBuffer
from tokenfab.models.dspark_drafter import PagedDraftContext, paged_context_tables

logger = logging.getLogger(__name__)

# int64 segments of n values each, then [n, N] slots, then [n, W] block tables
_SEGMENTS = ("anchor", "start", "context_lens", "query_pos", "tail_src", "tail_dst")


class DSparkGraphRunner:
    """Static buffers and one captured graph (``eager``: one eager pass) per capture size for the drafter's pass.

    Args:
        drafter: the :class:`~tokenfab.models.dspark_drafter.DSparkDrafter` (weights loaded, on ``device``).
        caches: one [num_blocks + (pad_row + 1) * num_tail, block_size, C + R] cache per MLA draft layer.
        num_blocks: the pool's blocks; block_size: tokens per block; max_blocks: blocks per sequence (the block
            manager's table width); num_tail: tail blocks per scheduler row.
        pad_row: the spare scheduler row whose tail blocks padding rows use (max_num_seqs: no sequence has it).
        num_drafts: m, the draft slots whose logits the pass returns (num_speculative_tokens).
        sizes: capture sizes (ascending, the target's); device; mode: "cuda" (capture) or "eager".
    """

    def __init__(self, drafter, caches: list[torch.Tensor], *, num_blocks: int, block_size: int, max_blocks: int,
                 num_tail: int, pad_row: int, num_drafts: int, sizes: list[int], device: torch.device, mode: str):
        self.drafter, self.caches, self.mode = drafter, caches, mode
        self.num_blocks, self.block_size, self.num_tail, self.pad_row = num_blocks, block_size, num_tail, pad_row
        self.N, self.m = drafter.cfg.block_size, num_drafts
        self.width = max_blocks + num_tail  # any anchor block + its tail fits
        self.sizes = sorted(sizes)
        self.device = torch.device(device)
        n, N, W = self.sizes[-1], self.N, self.width
        self.n_rows = n
        self._inputs = torch.zeros(len(_SEGMENTS) * n + n * N + n * W, dtype=torch.int64, device=self.device)
        self._host = PinnedHostBuffer(self._inputs.numel(), self.device)
        seg = {name: self._inputs[i * n:(i + 1) * n] for i, name in enumerate(_SEGMENTS)}
        self.anchor, self.start = seg["anchor"], seg["start"]
        self.context_lens, self.query_pos = seg["context_lens"], seg["query_pos"]
        self.tail_src, self.tail_dst = seg["tail_src"], seg["tail_dst"]
        off = len(_SEGMENTS) * n
        self.slots = self._inputs[off:off + n * N]
        self.block_tables = self._inputs[off + n * N:].view(n, W)
        # every row a padding row until a step writes it (capture runs over these)
        self._pad_values = self._padding(n)
        host = self._host.writable()
        self._fill(host, self._pad_values, n)
        self._host.send(self._inputs, self._inputs.numel())
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # passes served from the buffers (tests and stats)
        self.error: str | None = None  # why capture failed, if it did (the proposer then drafts eagerly)
        self._captured = False

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _padding(self, n: int) -> tuple[np.ndarray, ...]:
        """The arrays of n padding rows: anchor 0 at position 0 of the spare row (empty context, its own tail)."""
        rows = np.full(n, self.pad_row, dtype=np.int64)
        zeros = np.zeros(n, dtype=np.int64)
        tables = np.zeros((self.pad_row + 1, 1), dtype=np.int64)  # an empty table: the anchor block reads block 0
        parts = paged_context_tables(tables, rows, zeros, num_blocks=self.num_blocks, block_size=self.block_size,
                                     block_len=self.N, num_tail=self.num_tail, width=self.width)
        return (zeros, zeros) + parts

    def _fill(self, host: np.ndarray, values: tuple[np.ndarray, ...], B: int, first: int = 0) -> None:
        """Rows first .. first + B - 1 of the host buffer from values = (anchor [B], start [B]) followed by
        :func:`~tokenfab.models.dspark_drafter.paged_context_tables`' (tables [B, W], context_lens, query_pos,
        tail_src, tail_dst, slots [B, N])."""
        n, N, W = self.n_rows, self.N, self.width
        anchor, start, table, clens, qpos, src, dst, slots = values
        for i, v in enumerate((anchor, start, clens, qpos, src, dst)):
            host[i * n + first:i * n + first + B] = v[:B]
        off = len(_SEGMENTS) * n
        host[off + first * N:off + (first + B) * N] = slots[:B].reshape(-1)
        host[off + n * N + first * W:off + n * N + (first + B) * W] = table[:B].reshape(-1)

    def _context(self, bs: int) -> PagedDraftContext:
        return PagedDraftContext(block_tables=self.block_tables[:bs], context_lens=self.context_lens[:bs],
                                 query_pos=self.query_pos[:bs].view(bs, 1), max_context=self.width * self.block_size,
                                 tail_src=self.tail_src[:bs], tail_dst=self.tail_dst[:bs],
                                 slots=self.slots[:bs * self.N])

    def _pass(self, bs: int) -> torch.Tensor:
        """The body a graph records: the drafter's block over the first bs rows -> base draft logits [bs, m, V]."""
        hidden = self.drafter.block(self.anchor[:bs], self.start[:bs], self.caches, None, self._context(bs))
        return self.drafter.draft_logits(hidden)[:, : self.m]

    @torch.inference_mode()
    def capture(self, progress: bool = False) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool. The buffers hold padding rows
        only, so warm-up and capture write the spare row's tail alone. A failed capture is logged and leaves the
        proposer on eager passes (``error`` says why)."""
        self._captured = True
        if self.mode != "cuda":
            return
        from tqdm import tqdm
        pool = None
        try:
            for bs in tqdm(sorted(self.sizes, reverse=True), desc="capturing DSpark drafter CUDA graphs",
                           disable=not progress):
                for _ in range(2):  # compiles the Triton kernels, makes the absorbed weights, settles allocations
                    self._pass(bs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._pass(bs)
                pool = graph.pool()
                self.graphs[bs] = (graph, out)
        except Exception as e:  # noqa: BLE001 - an optimization: the proposer drafts eagerly without it
            torch.cuda.synchronize()
            self.error = f"{type(e).__name__}: {e}"[:500]
            logger.warning("DSpark drafter CUDA graphs not captured (%s); drafter passes run eagerly", self.error)
            self.graphs = {}
        torch.cuda.synchronize()

    def usable(self, B: int) -> bool:
        """Whether a pass of B sequences runs from the buffers."""
        return 0 < B <= self.max_batch and self.error is None

    def run(self, block_tables: np.ndarray, rows: np.ndarray, start: np.ndarray, anchor: np.ndarray
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter pass of B <= max_batch sequences at scheduler ``rows`` [B] with anchor tokens ``anchor`` [B]
        at positions ``start`` [B] (int64), ``block_tables`` the block manager's -> (base draft logits [B, m, V]
        float32, anchors [B] int64), both on the device: views of the static buffers, read before the next pass.

        Raises:
            ValueError: B = 0 or above max_batch, or a row >= pad_row (its tail would be the padding rows').
        """
        B = len(rows)
        if not 0 < B <= self.max_batch:
            raise ValueError(f"DSparkGraphRunner.run: {B} sequences; the buffers take 1 .. {self.max_batch}.")
        if int(rows.max()) >= self.pad_row:
            raise ValueError(f"DSparkGraphRunner.run: scheduler rows must lie below {self.pad_row} (the padding "
                             f"rows' spare row); got {int(rows.max())}.")
        if not self._captured:
            self.capture()
        bs = next(s for s in self.sizes if s >= B)
        parts = paged_context_tables(block_tables, rows, start, num_blocks=self.num_blocks,
                                     block_size=self.block_size, block_len=self.N, num_tail=self.num_tail,
                                     width=self.width)
        host = self._host.writable()
        self._fill(host, (anchor, start) + parts, B)
        self._fill(host, self._pad_values, bs - B, first=B)
        n, N = self.n_rows, self.N
        off = len(_SEGMENTS) * n
        # one copy: the segments and slots whole, the tables' first bs rows
        self._host.send(self._inputs, off + n * N + bs * self.width)
        self.replays += 1
        if self.mode == "cuda" and bs in self.graphs:
            graph, out = self.graphs[bs]
            graph.replay()
        else:
            out = self._pass(bs)
        return out[:B], self.anchor[:B]
