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
Each step's header also carries rank 0's verification size and whether its graphs wait to be captured again; the
workers mirror both before the step (ModelRunner.follow_graphs), so every rank serves verification rows from the
buffers alike and captures at the same step (never rank 0 alone: the captures' warm-up forwards run collectives).

Speculative verification of hybrid models (:meth:`DecodeGraphRunner.enable_verify`): a step of B sequences with up
to Q = 1 + k tokens each is laid out [bs, Q] (bs the smallest capture size >= B; the buffers hold max_num_seqs * Q
token rows once verification is enabled). Attention layers see every token as a decode row of its own (its
sequence's block table, context length = its position + 1); the KDA layers see the [bs, Q] group
(``AttentionMetadata.state_group``), walk each sequence's tokens in order and hold the states of its verification
rows for the commit after acceptance (engine/state_commit.py). Tokens past a sequence's count are padding rows for
attention and invalid (position -1) for the KDA layers; padding sequences run one token at position 0 into the spare
state slot. The layers' commit entries (references to the forward's projections) are captured with each graph and
handed back to the caches after every replay, stamped with the step's rows on the host; the commit itself (every KDA
layer's conv and recurrence again over each row's kept tokens, 0 for rows not held) is a second graph per size, fed
one copy of the kept counts (:meth:`DecodeGraphRunner.commit`).

Layer taps (a drafter's hidden states, ``ModelRunner.set_hidden_capture``): the forward function the runner calls
returns them beside the hidden states; captured with the graph (the hooks' ops are recorded at capture), so
drafters that tap layers no longer force every step through the modules (under tensor parallel the workers capture
again at the same step, without hooks: their graphs run the same collectives).

The forward must not sync with the host or change shapes with data while captured: it runs with the Triton decode
attention and fused MoE (kernels/gpu/*.py), so graphs are used only where those apply. ``mode="eager"`` runs
the same padded static-buffer path without capture, on any device: tests check it token for token against
transformers on CPU, which covers the padding and buffer logic that capture would freeze.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from tokenfab.engine.async_scheduling import fill_placeholders
from tokenfab.engine.input_staging import PinnedHostBuffer
from tokenfab.engine.state_cache import KDAStateCache
from tokenfab.engine.state_commit import kept_by_row
from tokenfab.errors import EngineConfigError
from tokenfab.layers.attention_metadata import AttentionGroup, AttentionMetadata

logger = logging.getLogger(__name__)


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


def experts_graph_safe(model) -> bool:
    """False when a routed-expert stack reads its routing on the host each step (PackedExperts.graph_safe: a GGUF
    file's experts, one kernel call per active expert), which a CUDA graph cannot capture."""
    from tokenfab.layers.moe import RoutedExperts
    return all(m.q13 is None or m.q13.graph_safe for m in model.modules() if isinstance(m, RoutedExperts))


def decode_graph_mode(device: torch.device, model, enforce_eager: bool) -> str | None:
    """"cuda", "eager" or None (plain eager steps).

    ``enforce_eager`` or ``TOKENFAB_DECODE_GRAPHS=0``: never. ``TOKENFAB_DECODE_GRAPHS=eager``: the padded
    static-buffer path without capture, on any device (tests, dry runs), for every model but host experts;
    unset: "cuda" on a CUDA/ROCm device when not ``enforce_eager`` and the Triton kernels apply, for dense, MoE and
    hybrid (KDA) models, on one rank or under tensor parallel over NCCL (:func:`collectives_graph_safe`). Never with
    host experts (per-step host work), nor on CUDA with expert stacks that route on the host
    (:func:`experts_graph_safe`).

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
    if device.type != "cuda" or not collectives_graph_safe(model) or not experts_graph_safe(model):
        return None
    from tokenfab.kernels.gpu import support as triton_support
    return "cuda" if triton_support.applies(torch.empty(0, device=device)) else None


SEGMENTS = 7  # int64 segments of n values each: ids, positions, slots, context lengths, state rows, KDA positions, hold


class DecodeGraphRunner:
    """Static buffers and one captured graph (or, in ``eager`` mode, one eager forward) per capture size.

    Args:
        forward: ``forward(input_ids [N], positions [N], meta) -> (hidden [N, hidden], taps [N, n, hidden] or
            None)``: the model's forward over the pool and, where a drafter taps layer outputs, the taps stacked
            (ModelRunner.model_forward); called at capture (CUDA) or every step (eager).
        kv_caches: the pool, allocated with one more block than the block manager owns (hybrid models: the KDA
            layers' entries are their state caches, allocated with one more slot than max_num_seqs; the list may
            receive them after this runner is built, it is read at each step).
        pad_block: that spare block's id.
        block_size: tokens per block; max_blocks: width of the block-table buffer (blocks per sequence).
        sizes: capture sizes (ascending); mode: "cuda" (capture) or "eager".
        state_slot: hybrid (KDA) models: the spare recurrent-state slot padding rows read and write (max_num_seqs,
            never a scheduler row); None for models without recurrent state.
        sharded: one rank of a tensor-parallel model: a failed verification capture raises (on one rank alone it
            leaves those steps eager; here the ranks' paths would part).
    """

    def __init__(self, forward, kv_caches: list, pad_block: int, block_size: int, max_blocks: int,
                 sizes: list[int], device: torch.device, mode: str, state_slot: int | None = None,
                 sharded: bool = False):
        self.forward, self.kv_caches, self.mode, self.sharded = forward, kv_caches, mode, sharded
        self.pad_block, self.block_size, self.max_blocks = pad_block, block_size, max_blocks
        self.state_slot = state_slot
        self.sizes = sorted(sizes)
        self.device = device
        self._allocate(self.sizes[-1])
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.verify_q = 0  # tokens per sequence of the verification graphs (1 + k); 0: none (enable_verify)
        self.verify_sizes: list[int] = []
        # bs -> (graph, hidden, taps, [the KDA caches' commit entries, one list per cache], commit graph)
        self.verify_graphs: dict[int, tuple] = {}
        self._kept = torch.zeros(0, dtype=torch.int64, device=device)  # [n] kept tokens per verification row
        self._kept_host: PinnedHostBuffer | None = None
        self._last_verify: tuple | None = None  # (bs, rows [bs], tokens [bs]) of the last verification step
        self.verify_error: str | None = None  # why verification graphs were dropped at capture, if they were
        self.replays = 0  # steps served from the buffers (tests and stats)
        self.verify_replays = 0  # of which verification steps of a hybrid model
        self._stale = True  # CUDA: (re)capture before the next replay (capture_if_stale)

    def _allocate(self, n: int) -> None:
        """The static buffers for ``n`` token rows (decode rows, or verification tokens: :meth:`enable_verify`)."""
        i64 = dict(dtype=torch.int64, device=self.device)
        max_blocks = self.max_blocks
        self.n_rows = n
        # Every per-step input lives in one int64 buffer, staged whole in one host buffer (pinned on CUDA) and sent
        # with one copy per step: [input ids | positions | slots | context lengths | state rows | KDA positions |
        # hold] (n each), then the block tables [n, max_blocks] row-major. The graphs read the views below, fixed
        # at capture.
        self._inputs = torch.zeros(SEGMENTS * n + n * max_blocks, **i64)
        self._host = PinnedHostBuffer(self._inputs.numel(), self.device)  # rewritten only once its last send landed
        seg = [self._inputs[i * n:(i + 1) * n] for i in range(SEGMENTS)]
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, rows, self.kda_positions, \
            self.hold = seg
        self.block_tables = self._inputs[SEGMENTS * n:].view(n, max_blocks)
        self.token_index = torch.arange(n, **i64).view(n, 1)
        # async scheduling: the previous step's drawn ids, which placeholder input ids -(j + 1) stand for; the
        # graphs fill the placeholders from here themselves (_filled_forward), so a step adds one device copy
        self.draw_ids = torch.zeros(n, **i64)
        # [n] int64 recurrent-state slot per row (hybrid models only): real rows' scheduler rows, padding rows the
        # spare slot; the KDA layers gather and scatter their states through this buffer alone
        self.state_rows = None if self.state_slot is None else rows
        self._pads = (0, 0, self.pad_block * self.block_size, 1, self.state_slot if self.state_slot is not None else 0,
                      -1, 0)
        host = self._host.writable()
        for i, pad in enumerate(self._pads):
            host[i * n:(i + 1) * n] = pad
        host[SEGMENTS * n:] = self.pad_block
        self._host.send(self._inputs, self._inputs.numel())

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _state_caches(self) -> list[KDAStateCache]:
        return [c for c in self.kv_caches if isinstance(c, KDAStateCache)]

    def _meta(self, bs: int) -> AttentionMetadata:
        group = AttentionGroup(token_index=self.token_index[:bs], query_pos=self.positions[:bs].view(bs, 1),
                               block_tables=self.block_tables[:bs], context_lens=self.context_lens[:bs], q_len=1,
                               max_context=self.max_blocks * self.block_size, flat_range=(0, bs))
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], decode=group, prefill=None, num_tokens=bs,
                                 block_size=self.block_size,
                                 state_rows=None if self.state_rows is None else self.state_rows[:bs])

    def _verify_meta(self, bs: int) -> AttentionMetadata:
        """bs sequences x verify_q tokens: the flat decode rows for attention, the [bs, Q] group for KDA layers."""
        Q = self.verify_q
        meta = self._meta(bs * Q)
        meta.state_group = AttentionGroup(token_index=self.token_index[:bs * Q].view(bs, Q),
                                          query_pos=self.kda_positions[:bs * Q].view(bs, Q),
                                          block_tables=self.block_tables[:bs], context_lens=self.context_lens[:bs],
                                          q_len=Q, max_context=self.max_blocks * self.block_size)
        meta.state_rows = self.state_rows[:bs]
        meta.state_hold = self.hold[:bs] != 0  # one launch; a bool view the PyTorch forms can mask with
        return meta

    @property
    def stale(self) -> bool:
        """True while the graphs wait to be captured again (:meth:`mark_stale`)."""
        return self._stale

    def mark_stale(self) -> None:
        """The forward changed (a drafter taps layers, verification graphs were asked for): capture again before
        the next replay, once, however many changes come first."""
        self._stale = True

    def capture_if_stale(self, progress: bool = False) -> None:
        """Capture now if the graphs are missing or out of date (the engine calls this once it is built, so
        start-up pays for capture, not the first request; replays call it too)."""
        if self._stale:
            self.capture(progress)

    def _filled_forward(self, N: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward over the first N rows, after the placeholder ids among them took the previous step's drawn
        ids from ``draw_ids`` (engine/async_scheduling.py; a no-op on rows without one): captured with the graph,
        so async scheduling costs a step one copy into ``draw_ids`` rather than the fill's launches."""
        ids = self.input_ids[:N]
        ids.copy_(fill_placeholders(ids, self.draw_ids))
        return self.forward(ids, self.positions[:N], meta)

    @torch.inference_mode()
    def capture(self, progress: bool = False) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool (again, replacing earlier
        graphs). Buffers hold padding rows only, so warm-up and capture write K/V to the pad block alone and KDA
        states to the spare slot alone (the state caches must exist before this is called: ModelRunner builds them
        first)."""
        self._stale = False
        if self.mode != "cuda":
            return
        from tqdm import tqdm
        self.graphs, self.verify_graphs = {}, {}
        pool = None
        caches = self._state_caches()
        jobs = [(bs, False) for bs in sorted(self.sizes, reverse=True)]
        jobs += [(bs, True) for bs in sorted(self.verify_sizes, reverse=True)]
        for bs, verify in tqdm(jobs, desc="capturing decode CUDA graphs", disable=not progress):
            if verify and not self.verify_sizes:  # an earlier verification capture failed
                continue
            N = bs * self.verify_q if verify else bs
            try:
                for _ in range(2):  # compiles the Triton kernels and settles allocations outside the capture
                    self._filled_forward(N, self._verify_meta(bs) if verify else self._meta(bs))
                torch.cuda.synchronize()
                for c in caches:
                    c.deferred.clear()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out, taps = self._filled_forward(N, self._verify_meta(bs) if verify else self._meta(bs))
            except Exception as e:  # noqa: BLE001 - verification graphs are an optimization: run those steps eagerly
                if not verify:
                    raise
                if self.sharded:  # the other ranks may have captured theirs: their paths would part from this one's
                    raise EngineConfigError(
                        f"verification CUDA graphs failed to capture under tensor parallel ({type(e).__name__}: "
                        f"{e}); serve with enforce_eager=True (--enforce-eager) or TOKENFAB_DECODE_GRAPHS=0.") from e
                torch.cuda.synchronize()
                self.verify_error = f"{type(e).__name__}: {e}"[:500]
                logger.warning("verification CUDA graphs not captured (%s); verification steps run eagerly",
                               self.verify_error)
                self.verify_sizes, self.verify_graphs = [], {}
                for c in caches:
                    c.deferred.clear()
                continue
            pool = graph.pool()
            if verify:  # the commit entries the layers appended while captured: their tensors live in the pool
                entries = [list(c.deferred) for c in caches]
                commit_graph = torch.cuda.CUDAGraph()  # and the commit over them, kept tokens from _kept
                self._commit(bs, entries)  # warm-up: padding rows, kept 0 (states written back unchanged)
                torch.cuda.synchronize()
                with torch.cuda.graph(commit_graph, pool=pool):
                    self._commit(bs, entries)
                self.verify_graphs[bs] = (graph, out, taps, entries, commit_graph)
            else:
                self.graphs[bs] = (graph, out, taps)
            for c in caches:
                c.deferred.clear()
        torch.cuda.synchronize()

    def enable_verify(self, tokens_per_seq: int) -> None:
        """Serve steps of a hybrid (KDA) model with up to ``tokens_per_seq`` (1 + k) tokens a sequence from the
        buffers: speculative verification rows, and short prefill chunks beside them. Every capture size bs gets a
        [bs, tokens_per_seq] graph (the buffers grow to max_num_seqs * tokens_per_seq token rows now), captured
        with the decode sizes (one memory pool) at the next :meth:`capture_if_stale`. No-op for models without
        state or for tokens_per_seq < 2."""
        if self.state_slot is None or tokens_per_seq < 2:
            return
        self.verify_q = int(tokens_per_seq)
        self.verify_sizes = list(self.sizes)
        self._allocate(self.max_batch * self.verify_q)  # before any capture reads the buffers
        self._kept = torch.zeros(self.max_batch, dtype=torch.int64, device=self.device)
        self._kept_host = PinnedHostBuffer(self.max_batch, self.device)
        self.mark_stale()

    def fits_verify(self, num_new: np.ndarray) -> bool:
        """Whether a step of ``num_new`` [B] tokens per sequence runs from the [bs, 1 + k] buffers (:meth:`run_verify`):
        verification rows, and short prefill chunks (a fresh sequence starts from a zero state at position 0)."""
        return (self.verify_q > 0 and bool(self.verify_sizes) and len(num_new) <= self.verify_sizes[-1]
                and int(num_new.max()) <= self.verify_q)

    def _stage(self, arrays: list[tuple[int, np.ndarray | None, np.ndarray | None]], bt_rows: np.ndarray | None,
               bt: np.ndarray, used: int, pad_rows: int) -> None:
        """Write one step into the host buffer and send it: per segment (index, destination rows or None for the
        first len(values), values); ``used`` rows of every segment are reset to padding first; block-table rows
        ``bt_rows`` (None: the first len(bt)) get ``bt``'s columns in use, padding rows column 0 = the pad block."""
        n = self.n_rows
        host = self._host.writable()
        for i in range(SEGMENTS):
            host[i * n:i * n + used] = self._pads[i]
        for i, dest, values in arrays:
            if values is None:
                continue
            if dest is None:
                host[i * n:i * n + len(values)] = values
            else:
                host[i * n + dest] = values
        width = min(bt.shape[1], self.max_blocks)
        tables = host[SEGMENTS * n:].reshape(n, self.max_blocks)
        tables[:pad_rows, 0] = self.pad_block  # columns past a row's context are never read: stale ones may stay
        if bt_rows is None:
            tables[:len(bt), :width] = bt[:, :width]
        else:
            tables[bt_rows, :width] = bt[:, :width]
        self._host.send(self._inputs, SEGMENTS * n + pad_rows * self.max_blocks)  # the step's one copy

    def _check_rows(self, state_rows: np.ndarray | None, B: int) -> None:
        if self.state_rows is None:
            return
        if state_rows is None:
            raise ValueError("decode graphs of a hybrid (KDA) model need the step's state rows (scheduler rows).")
        if B and not (0 <= int(state_rows.min()) and int(state_rows.max()) < self.state_slot):
            raise ValueError(f"state rows must lie in [0, {self.state_slot}) (slot {self.state_slot} is the "
                             f"padding rows' spare slot); got {state_rows.min()}..{state_rows.max()}.")

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, block_tables: np.ndarray,
            context_lens: np.ndarray, state_rows: np.ndarray | None = None,
            placeholder_source: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode-only step of B <= max_batch sequences (int64 numpy inputs: [B] ids, positions, slots,
        context lengths after this step's write; [B, >= blocks in use] block tables; ``state_rows`` [B] the
        sequences' scheduler rows = recurrent-state slots, hybrid models only) -> (hidden [B, hidden], taps
        [B, n, hidden] or None).

        All inputs go to the device in one copy from one host staging buffer (pinned on CUDA). Only the block-table
        columns in use are written there: attention reads no column past a row's context length, so older columns
        may keep stale ids. Padding rows get token 0 at position 0, the pad block in column 0,
        context length 1 and (hybrid models) the spare state slot: position 0 makes the KDA layers start them
        from a zero state, so they read nothing a sequence wrote, and they write only the spare slot.
        ``placeholder_source`` (async scheduling): the previous step's drawn ids [N] int64 on this device, copied
        into ``draw_ids``; input ids ``-(j + 1)`` become its entry j inside the graph (engine/async_scheduling.py).

        Raises:
            ValueError: a hybrid model's step without ``state_rows``, or rows that name the spare slot or lie
                outside the state caches (a padding row would then share a slot with a real one).
        """
        B = len(input_ids)
        bs = next(s for s in self.sizes if s >= B)
        self._check_rows(state_rows, B)
        self.capture_if_stale()
        self._last_verify = None
        self._stage([(0, None, input_ids), (1, None, positions), (2, None, slot_mapping), (3, None, context_lens),
                     (4, None, state_rows)], None, block_tables, bs, bs)
        if placeholder_source is not None:
            self.draw_ids[:len(placeholder_source)].copy_(placeholder_source)
        self.replays += 1
        if self.mode == "cuda":
            graph, out, taps = self.graphs[bs]
            graph.replay()
        else:
            out, taps = self._filled_forward(bs, self._meta(bs))
        return out[:B], None if taps is None else taps[:B]

    def run_verify(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                   block_tables: np.ndarray, num_new: np.ndarray, state_rows: np.ndarray, hold: np.ndarray | None,
                   placeholder_source: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step of B sequences with ``num_new`` [B] (<= verify_q) tokens each, T in all, of a hybrid model
        (:meth:`fits_verify`): flat int64 numpy inputs in the step's order, ``input_ids`` / ``positions`` /
        ``slot_mapping`` [T], ``block_tables`` [T, >= blocks in use] (each token's sequence's), ``state_rows`` [B],
        ``hold`` [B] bool (verification rows: states held for the commit) or None -> (hidden [T, hidden], taps
        [T, n, hidden] or None) in the step's order. After it the KDA caches hold this step's commit entries
        (engine/state_commit.py), stamped with the rows on the host.

        Raises:
            ValueError: as :meth:`run` for ``state_rows``.
        """
        B, T, Q = len(num_new), len(input_ids), self.verify_q
        bs = next(s for s in self.verify_sizes if s >= B)
        self._check_rows(state_rows, B)
        self.capture_if_stale()
        starts = np.cumsum(num_new) - num_new
        req = np.repeat(np.arange(B), num_new)
        dest = req * Q + (np.arange(T) - starts[req])  # token (b, j) at row b * Q + j
        pad_seq = np.arange(B, bs) * Q  # padding sequences: one token at position 0 (spare slot, zero state)
        self._stage([(0, dest, input_ids), (1, dest, positions), (2, dest, slot_mapping), (3, dest, positions + 1),
                     (4, None, state_rows), (5, dest, positions), (5, pad_seq, np.zeros(len(pad_seq), np.int64)),
                     (6, None, None if hold is None else hold.astype(np.int64))], dest, block_tables, bs * Q, bs * Q)
        if placeholder_source is not None:
            self.draw_ids[:len(placeholder_source)].copy_(placeholder_source)
        self.replays += 1
        self.verify_replays += 1
        caches = self._state_caches()
        if self.mode == "cuda":
            graph, out, taps, entries, _ = self.verify_graphs[bs]
            graph.replay()
            for c, e in zip(caches, entries):
                c.deferred[:] = e
        else:
            out, taps = self._filled_forward(bs * Q, self._verify_meta(bs))
        rows_h = np.full(bs, self.state_slot, dtype=np.int64)
        rows_h[:B] = state_rows
        hold_h = np.zeros(bs, dtype=bool)
        if hold is not None:
            hold_h[:B] = hold
        tokens_h = np.ones(bs, dtype=np.int64)
        tokens_h[:B] = num_new
        for c in caches:
            for e in c.deferred:
                e.rows_host, e.hold_host, e.tokens_host = rows_h, hold_h, tokens_h
        self._last_verify = (bs, rows_h, hold_h, tokens_h)
        sel = torch.from_numpy(dest)
        if sel.device != out.device:
            sel = sel.to(out.device, non_blocking=True)
        return out[sel], None if taps is None else taps[sel]

    def forget_step(self) -> None:
        """A step not served by :meth:`run_verify` begins: no commit of the buffers' is pending."""
        self._last_verify = None

    def _commit(self, bs: int, entries: list[list]) -> None:
        """Every KDA layer's commit over all bs rows of a verification step, kept tokens from ``_kept`` (the
        commit graph's body; also run eagerly in ``eager`` mode)."""
        kept = self._kept[:bs]
        for c, es in zip(self._state_caches(), entries):
            for e in es:
                e.layer.commit_all(e, c, kept)

    def commit(self, rows: np.ndarray, kept: np.ndarray) -> int | None:
        """After a verification step these buffers served (:meth:`run_verify`), the KDA state commit
        (engine/state_commit.py) of ``rows`` [N] int64 scheduler rows after their first ``kept`` [N] int64 tokens:
        one copy of the kept counts and one replay of the step's commit graph (``eager`` mode: the same work run
        directly). Rows the step did not hold keep their state. Returns the (layer, row) states committed, or None
        when the last step was not such a step (the caller then commits through the layers' entries).

        Raises:
            ValueError: a kept count above the tokens its row ran (nothing written).
        """
        last, self._last_verify = self._last_verify, None
        if last is None:
            return None
        bs, rows_h, hold_h, tokens_h = last
        try:
            kk = kept_by_row(rows_h, hold_h, tokens_h, np.asarray(rows, dtype=np.int64),
                             np.asarray(kept, dtype=np.int64))
        except ValueError:
            self._last_verify = last  # a corrected call may follow
            raise
        caches = self._state_caches()
        host = self._kept_host.writable()
        host[:bs] = np.maximum(kk, 0)  # rows not held or not named: no token, their state written back as it is
        self._kept_host.send(self._kept, bs)
        if self.mode == "cuda":
            self.verify_graphs[bs][4].replay()
        else:
            self._commit(bs, [list(c.deferred) for c in caches])
        for c in caches:
            c.deferred.clear()
        return int((kk >= 0).sum()) * len(caches)
