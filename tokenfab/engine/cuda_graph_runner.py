"""Decode steps replayed from CUDA graphs captured once per padded batch size (as vLLM's CUDA-graph runner).

A decode step launches a few hundred small kernels; on a GPU the launch overhead alone can exceed the work. At
start-up the model's forward for a decode-only batch of each capture size (1, 2, 4, 8, 16, 24, ... up to
max_num_seqs) is captured into a CUDA graph over static input buffers. A step of B sequences copies its inputs into
the first B rows of the buffers, pads the rest and replays the graph of the smallest size >= B.

Padding rows write their K/V to a spare block of the pool that the block manager never hands out
(``pad_block``), attend over that one row (context length 1), and their outputs are dropped. In hybrid models
with recurrent-state (KDA) layers every row also names its state slot (``state_rows``, the scheduler row): padding
rows name a spare slot that no sequence ever owns (``state_slot`` = max_num_seqs, the state caches hold one slot
more), and run at position 0, so they start from a zero state and write only that spare slot. Real rows' slots are
copied into the same fixed buffer, so a captured graph gathers and scatters the states through it and freezes no
index.

Tensor parallel: every rank runs the same step arrays (rank 0 broadcasts them, parallel/worker.py) through this
same code, so every rank pads to the same size with the same rows and the collectives inside the forward pair up.

The forward must not sync with the host or change shapes with data while captured: it runs with the Triton decode
attention and fused MoE (kernels/gpu/*.py), so graphs are used only where those apply. ``mode="eager"`` runs
the same padded static-buffer path without capture, on any device: tests check it token for token against
transformers on CPU, which covers the padding and buffer logic that capture would freeze.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from tokenfab.engine.async_scheduling import fill_placeholders
from tokenfab.engine.input_staging import PinnedHostBuffer
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


def collectives_graph_safe(model) -> bool:
    """True when the model's collectives may be captured in a CUDA graph: one rank (none), or tensor parallel over
    an initialized NCCL/RCCL default group (NCCL kernels are capturable; gloo's host-side collectives are not)."""
    if getattr(model, "tp", None) is None:
        return True
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"


def decode_graph_mode(device: torch.device, model, enforce_eager: bool) -> str | None:
    """"cuda", "eager" or None (plain eager steps).

    ``enforce_eager`` or ``TOKENFAB_DECODE_GRAPHS=0``: never. ``TOKENFAB_DECODE_GRAPHS=eager``: the padded
    static-buffer path without capture, on any device (tests, dry runs), for every model but host experts;
    unset: "cuda" on a CUDA/ROCm device when not ``enforce_eager`` and the Triton kernels apply, for dense, MoE and
    hybrid (KDA) models, on one rank or under tensor parallel over NCCL (:func:`collectives_graph_safe`). Never with
    host experts (per-step host work).

    Unmeasured on a GPU so far: capture of the KDA layers' state gather/scatter and of the NCCL all-reduces inside
    the graph (the padded path they replay is checked on CPU: tests/test_decode_graphs.py); the first lent GPU must
    run benchmarks/gpu_check.sh on a Kimi K3 shape and under TP before these are trusted for speed.

    Raises:
        EngineConfigError: another value of ``TOKENFAB_DECODE_GRAPHS``.
    """
    env = os.environ.get("TOKENFAB_DECODE_GRAPHS", "")
    if env not in ("", "1", "0", "eager"):
        raise EngineConfigError(f"TOKENFAB_DECODE_GRAPHS='{env}' is not understood; use 0 (off), eager (padded "
                                "buffers without capture) or leave it unset (CUDA graphs where they apply).")
    if enforce_eager or env == "0":
        return None
    if getattr(model, "host_expert_stats", None) is not None:  # host experts: per-step host work, no capture
        return None
    if env == "eager":
        return "eager"
    if device.type != "cuda" or not collectives_graph_safe(model):
        return None
    from tokenfab.kernels.gpu import support as triton_support
    return "cuda" if triton_support.applies(torch.empty(0, device=device)) else None


class DecodeGraphRunner:
    """Static buffers and one captured graph (or, in ``eager`` mode, one eager forward) per capture size.

    Args:
        model: the CausalLM (``model(input_ids, positions, kv_caches, meta) -> hidden [T, hidden]``).
        kv_caches: the pool, allocated with one more block than the block manager owns (hybrid models: the KDA
            layers' entries are their state caches, allocated with one more slot than max_num_seqs; the list may
            receive them after this runner is built, it is read at each step).
        pad_block: that spare block's id.
        block_size: tokens per block; max_blocks: width of the block-table buffer (blocks per sequence).
        sizes: capture sizes (ascending); mode: "cuda" (capture) or "eager".
        state_slot: hybrid (KDA) models: the spare recurrent-state slot padding rows read and write (max_num_seqs,
            never a scheduler row); None for models without recurrent state.
    """

    def __init__(self, model, kv_caches: list, pad_block: int, block_size: int, max_blocks: int,
                 sizes: list[int], device: torch.device, mode: str, state_slot: int | None = None):
        self.model, self.kv_caches, self.mode = model, kv_caches, mode
        self.pad_block, self.block_size, self.max_blocks = pad_block, block_size, max_blocks
        self.state_slot = state_slot
        self.sizes = sorted(sizes)
        n = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        # Every per-step input lives in one int64 buffer, staged whole in one host buffer (pinned on CUDA) and sent
        # with one copy per step: [input ids | positions | slots | context lengths | state rows] (n each), then the
        # block tables [n, max_blocks] row-major. The graphs read the views below, fixed at capture.
        self._inputs = torch.zeros(5 * n + n * max_blocks, **i64)
        self._host = PinnedHostBuffer(self._inputs.numel(), device)  # rewritten only once its last send landed
        seg = [self._inputs[i * n:(i + 1) * n] for i in range(5)]
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, rows = seg
        self.block_tables = self._inputs[5 * n:].view(n, max_blocks)
        self.token_index = torch.arange(n, **i64).view(n, 1)
        # [n] int64 recurrent-state slot per row (hybrid models only): real rows' scheduler rows, padding rows the
        # spare slot; the KDA layers gather and scatter their states through this buffer alone
        self.state_rows = None if state_slot is None else rows
        self._pads = (0, 0, pad_block * block_size, 1, state_slot if state_slot is not None else 0)
        host = self._host.writable()
        for i, pad in enumerate(self._pads):
            host[i * n:(i + 1) * n] = pad
        host[5 * n:] = pad_block
        self._host.send(self._inputs, self._inputs.numel())
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
                                 block_size=self.block_size,
                                 state_rows=None if self.state_rows is None else self.state_rows[:bs])

    @torch.inference_mode()
    def capture(self, progress: bool = False) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool. Buffers hold padding rows
        only, so warm-up and capture write K/V to the pad block alone and KDA states to the spare slot alone (the
        state caches must exist before this is called: ModelRunner builds them first)."""
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
            context_lens: np.ndarray, state_rows: np.ndarray | None = None,
            placeholder_source: torch.Tensor | None = None) -> torch.Tensor:
        """One decode-only step of B <= max_batch sequences (int64 numpy inputs: [B] ids, positions, slots,
        context lengths after this step's write; [B, >= blocks in use] block tables; ``state_rows`` [B] the
        sequences' scheduler rows = recurrent-state slots, hybrid models only) -> hidden [B, hidden].

        All inputs go to the device in one copy from one host staging buffer (pinned on CUDA). Only the block-table
        columns in use are written there: attention reads no column past a row's context length, so older columns
        may keep stale ids. Padding rows get token 0 at position 0, the pad block in column 0,
        context length 1 and (hybrid models) the spare state slot: position 0 makes the KDA layers start them
        from a zero state, so they read nothing a sequence wrote, and they write only the spare slot.
        ``placeholder_source`` (async scheduling): the previous step's drawn ids [N] int64 on this device; input
        ids ``-(j + 1)`` become its entry j in the static buffer, on the device, before the replay
        (engine/async_scheduling.py).

        Raises:
            ValueError: a hybrid model's step without ``state_rows``, or rows that name the spare slot or lie
                outside the state caches (a padding row would then share a slot with a real one).
        """
        B = len(input_ids)
        bs = next(s for s in self.sizes if s >= B)
        width = min(block_tables.shape[1], self.max_blocks)
        n = self.max_batch
        arrays = [input_ids, positions, slot_mapping, context_lens]
        if self.state_rows is not None:
            if state_rows is None:
                raise ValueError("decode graphs of a hybrid (KDA) model need the step's state rows (scheduler rows).")
            if B and not (0 <= int(state_rows.min()) and int(state_rows.max()) < self.state_slot):
                raise ValueError(f"state rows must lie in [0, {self.state_slot}) (slot {self.state_slot} is the "
                                 f"padding rows' spare slot); got {state_rows.min()}..{state_rows.max()}.")
            arrays.append(state_rows)
        host = self._host.writable()
        for i, a in enumerate(arrays):
            host[i * n:i * n + B] = a
            host[i * n + B:i * n + bs] = self._pads[i]
        bt = host[5 * n:].reshape(n, self.max_blocks)
        bt[:B, :width] = block_tables[:, :width]  # columns past a row's context are never read: stale ones may stay
        bt[B:bs, 0] = self.pad_block
        self._host.send(self._inputs, 5 * n + bs * self.max_blocks)  # the step's one host-to-device copy
        if placeholder_source is not None:
            ids = self.input_ids[:B]
            ids.copy_(fill_placeholders(ids, placeholder_source))
        self.replays += 1
        if self.mode == "cuda":
            graph, out = self.graphs[bs]
            graph.replay()
            return out[:B]
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs))[:B]
