"""Decode steps replayed from CUDA graphs captured once per padded batch size (as vLLM's CUDA-graph runner).

A decode step launches a few hundred small kernels; on a GPU the launch overhead alone can exceed the work. At
start-up the model's forward for a decode-only batch of each capture size (1, 2, 4, 8, 16, 24, ... up to
max_num_seqs) is captured into a CUDA graph over static input buffers. A step of B sequences copies its inputs into
the first B rows of the buffers, pads the rest and replays the graph of the smallest size >= B.

Padding rows write their K/V to a spare block of the pool that the block manager never hands out
(``pad_block``), attend over that one row (context length 1), and their outputs are dropped.

The forward must not sync with the host or change shapes with data while captured: it runs with the Triton decode
attention and fused MoE (kernels/gpu/*.py), so graphs are used only where those apply. ``mode="eager"`` runs
the same padded static-buffer path without capture, on any device: tests check it token for token against
transformers on CPU, which covers the padding and buffer logic that capture would freeze.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from tokenfab.errors import EngineConfigError
from tokenfab.layers.attention_metadata import AttentionGroup, AttentionMetadata


def capture_sizes(max_num_seqs: int, limit: int = 256) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8 up to min(max_num_seqs, limit) (vLLM's default
    pattern), always including that maximum."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def decode_graph_mode(device: torch.device, model, enforce_eager: bool) -> str | None:
    """"cuda", "eager" or None (plain eager steps).

    ``enforce_eager`` or ``TOKENFAB_DECODE_GRAPHS=0``: never. ``TOKENFAB_DECODE_GRAPHS=eager``: the padded
    static-buffer path without capture, on any device (tests, dry runs);
    unset: "cuda" on a CUDA/ROCm device when not ``enforce_eager``, the Triton kernels apply and the model runs on
    one rank. Never for models with recurrent-state (KDA) layers.

    Raises:
        EngineConfigError: another value of ``TOKENFAB_DECODE_GRAPHS``.
    """
    env = os.environ.get("TOKENFAB_DECODE_GRAPHS", "")
    if env not in ("", "1", "0", "eager"):
        raise EngineConfigError(f"TOKENFAB_DECODE_GRAPHS='{env}' is not understood; use 0 (off), eager (padded "
                                "buffers without capture) or leave it unset (CUDA graphs where they apply).")
    if enforce_eager or env == "0" or hasattr(model, "make_state_cache"):  # KDA state slots: by scheduler row
        return None
    if getattr(model, "host_expert_stats", None) is not None:  # host experts: per-step host work, no capture
        return None
    if env == "eager":
        return "eager"
    if device.type != "cuda" or getattr(model, "tp", None) is not None:
        return None
    from tokenfab.kernels.gpu import support as triton_support
    return "cuda" if triton_support.applies(torch.empty(0, device=device)) else None


class DecodeGraphRunner:
    """Static buffers and one captured graph (or, in ``eager`` mode, one eager forward) per capture size.

    Args:
        model: the CausalLM (``model(input_ids, positions, kv_caches, meta) -> hidden [T, hidden]``).
        kv_caches: the pool, allocated with one more block than the block manager owns.
        pad_block: that spare block's id.
        block_size: tokens per block; max_blocks: width of the block-table buffer (blocks per sequence).
        sizes: capture sizes (ascending); mode: "cuda" (capture) or "eager".
    """

    def __init__(self, model, kv_caches: list, pad_block: int, block_size: int, max_blocks: int,
                 sizes: list[int], device: torch.device, mode: str):
        self.model, self.kv_caches, self.mode = model, kv_caches, mode
        self.pad_block, self.block_size, self.max_blocks = pad_block, block_size, max_blocks
        self.sizes = sorted(sizes)
        n = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), pad_block * block_size, **i64)
        self.block_tables = torch.full((n, max_blocks), pad_block, **i64)
        self.context_lens = torch.ones(n, **i64)
        self.token_index = torch.arange(n, **i64).view(n, 1)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # steps served from the buffers (tests and stats)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _meta(self, bs: int) -> AttentionMetadata:
        group = AttentionGroup(token_index=self.token_index[:bs], query_pos=self.positions[:bs].view(bs, 1),
                               block_tables=self.block_tables[:bs], context_lens=self.context_lens[:bs], q_len=1,
                               max_context=self.max_blocks * self.block_size, flat_range=(0, bs))
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], decode=group, prefill=None, num_tokens=bs,
                                 block_size=self.block_size)

    @torch.inference_mode()
    def capture(self, progress: bool = False) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool. Buffers hold padding rows
        only, so warm-up and capture write K/V to the pad block alone."""
        if self.mode != "cuda":
            return
        from tqdm import tqdm
        pool = None
        for bs in tqdm(sorted(self.sizes, reverse=True), desc="capturing decode CUDA graphs", disable=not progress):
            ids, pos, meta = self.input_ids[:bs], self.positions[:bs], self._meta(bs)
            for _ in range(2):  # compiles the Triton kernels and settles allocations outside the capture
                self.model(ids, pos, self.kv_caches, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(ids, pos, self.kv_caches, meta)
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, block_tables: np.ndarray,
            context_lens: np.ndarray) -> torch.Tensor:
        """One decode-only step of B <= max_batch sequences (int64 numpy inputs: [B] ids, positions, slots,
        context lengths after this step's write; [B, >= blocks in use] block tables) -> hidden [B, hidden].

        Only the block-table columns in use are copied: attention reads no column past a row's context length,
        so older columns may keep stale ids. Padding rows get the pad block in column 0 and context length 1."""
        B = len(input_ids)
        bs = next(s for s in self.sizes if s >= B)
        width = min(block_tables.shape[1], self.max_blocks)
        nb = self.input_ids.device.type == "cuda"
        for buf, rows, pad_value in ((self.input_ids, input_ids, 0), (self.positions, positions, 0),
                                     (self.slot_mapping, slot_mapping, self.pad_block * self.block_size),
                                     (self.context_lens, context_lens, 1)):
            buf[:B].copy_(torch.from_numpy(rows), non_blocking=nb)
            buf[B:bs].fill_(pad_value)
        self.block_tables[:B, :width].copy_(torch.from_numpy(block_tables[:, :width]), non_blocking=nb)
        self.block_tables[B:bs, 0].fill_(self.pad_block)
        self.replays += 1
        if self.mode == "cuda":
            graph, out = self.graphs[bs]
            graph.replay()
            return out[:B]
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs))[:B]
