"""Turns a ScheduledBatch into tensors, runs the model, and returns logits-derived results.

Batch tensors are built with vectorized numpy from persistent per-row arrays (token ids by row, block tables by
row in the block manager): for T tokens of B sequences,

    req_idx   = repeat(arange(B), num_new)                         # which sequence each token belongs to
    positions = num_computed[req_idx] + arange(T) - starts[req_idx]
    input_ids = token_ids[rows[req_idx], positions]
    slot      = block_tables[rows[req_idx], positions // bs] * bs + positions % bs

No Python loop runs over sequences or tokens here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenfab.engine.async_scheduling import fill_placeholders, fill_placeholders_host
from tokenfab.engine.batch_invariance import check_model, check_stack
from tokenfab.engine.block_manager import BlockManager
from tokenfab.engine.cpu_decode_stack import CpuDecodeStack
from tokenfab.engine.cuda_graph_runner import DecodeGraphRunner, capture_sizes, decode_graph_mode
from tokenfab.engine.hugepages import module_tensors, move_to_hugepages
from tokenfab.engine.input_staging import InputStager
from tokenfab.engine.logits_state import LogitsProcessorState
from tokenfab.engine.sampler import Sampler, SamplerOutput, token_logprobs
from tokenfab.engine.scheduler import ScheduledBatch
from tokenfab.engine.state_cache import KDAStateCache
from tokenfab.engine.state_commit import clear_deferred, commit
from tokenfab.kernels.cpu.ops import batch_invariant as cpu_batch_invariant
from tokenfab.kernels.gpu import support as triton_support
from tokenfab.layers.attention_metadata import AttentionGroup, AttentionMetadata
from tokenfab.layers.linear import cpu_linear_backend
from tokenfab.spec_decode.proposer import CapturedHidden, HiddenRequest
from tokenfab.spec_decode.verification import verification_rows


@dataclass
class PromptLogprobs:
    """Prompt logprobs computed this step, flat over (sequence, position) pairs.

    ``seq_index`` [P] index into batch.seqs; ``position`` [P] prompt position p whose token is predicted
    (the logits came from position p - 1); ``logprob`` [P]; ``top_ids`` / ``top_logprobs`` [P, K] or None;
    ``ranks`` [P] the prompt tokens' vocabulary ranks (:func:`~tokenfab.engine.sampler.token_logprobs`).
    """

    seq_index: np.ndarray
    position: np.ndarray
    token_ids: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None
    ranks: np.ndarray | None = None


# longest query (tokens of one sequence in a step) that runs as separate decode rows through the decode graphs: each
# row re-reads its sequence's context, so this stays at speculative-verification sizes (1 + k)
FLAT_MAX_QUERY = 16


@dataclass
class StepOutput:
    """``sampled_index``: indices into batch.seqs of the sequences that got a new token (in the order of
    ``sampler_output`` rows)."""

    sampled_index: np.ndarray
    sampler_output: SamplerOutput | None
    prompt_logprobs: PromptLogprobs | None
    # [sum(num_new) of speculative rows, V] float32, on the device on GPU engines (spec_decode/spec_decoder.py)
    spec_logits: torch.Tensor | None = None


class ModelRunner:
    """Owns the model, the KV pool tensors and the persistent token array.

    Args:
        model: a tokenfab CausalLM with weights loaded.
        block_manager: gives block size, pool size and the block-table array.
        max_num_seqs, max_model_len: sizes of the persistent arrays (rows, tokens).
        device, dtype: where the KV pool is and the activations' dtype (the pool's unless ``kv_dtype``).
        sampler: the batched sampler.
        enforce_eager: never replay decode steps from CUDA graphs (vLLM's flag; graphs apply on CUDA/ROCm only).
        batch_invariant: every step, prefill and decode alike, runs through the fused CPU decode stack with each
            token as a one-query row over its own context, in the kernels' batch-invariant mode
            (``cpu_batch_invariant.batch_invariant``), so a token's values do not depend on its batch or chunk
            (docs/batch_invariance.md).
        kv_dtype: the KV pool's dtype when it differs from ``dtype`` (``EngineConfig.kv_cache_dtype``; None: dtype).
            Recurrent (KDA) state keeps ``dtype``.

    Raises:
        UnsupportedError: ``batch_invariant`` for a model or machine the decode stack does not cover (the message
            says which part).
    """

    def __init__(self, model, block_manager: BlockManager, max_num_seqs: int, max_model_len: int,
                 device: torch.device, dtype: torch.dtype, sampler: Sampler, enforce_eager: bool = False,
                 batch_invariant: bool = False, kv_dtype: torch.dtype | None = None):
        self.model = model
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.device = device
        triton_support.check_env()
        cpu_linear_backend()  # a typo in TOKENFAB_CPU_LINEAR is an error here, not a silent default
        graph_mode = decode_graph_mode(device, model, enforce_eager)
        self.has_state = hasattr(model, "make_state_cache")
        # decode graphs pad batches into a spare block the block manager never hands out, and (hybrid models) a
        # spare recurrent-state slot, max_num_seqs, that no scheduler row names (cuda_graph_runner.py)
        num_blocks = block_manager.num_blocks + (graph_mode is not None)
        self.kv_caches = model.make_kv_cache(num_blocks, self.block_size, kv_dtype or dtype, device)
        if self.has_state:  # hybrid models: per-request KDA state slots by row (state_cache.py)
            model.make_state_cache(self.kv_caches, max_num_seqs + (graph_mode is not None), dtype, device)
        # the target-hidden-state seam for drafters (spec_decode/proposer.py): set by set_hidden_capture
        self.capture: HiddenRequest | None = None
        self.captured: CapturedHidden | None = None  # the last execute()'s hidden states, when capture is set
        self._hidden_now: tuple | None = None  # (hidden [T, H], taps [T, n, H] or None) of the last forward
        self._tap_out: list = []
        self._tap_hooks: list = []
        # tensor parallel: every rank captures its graphs at this point, together (the captures' collectives pair
        # up), and later only inside a step: each step's header carries rank 0's verification size and whether its
        # graphs wait to be captured again (layer taps, verification graphs), which the workers mirror before the
        # step (follow_graphs), so all ranks capture at the same step; one rank captures once the engine is built
        # (DecodeGraphRunner.capture_if_stale)
        self.sharded = getattr(model, "tp", None) is not None
        self.decode_graphs: DecodeGraphRunner | None = None
        if graph_mode is not None:
            self.decode_graphs = DecodeGraphRunner(self.model_forward, self.kv_caches, block_manager.num_blocks,
                                                   self.block_size,
                                                   block_manager.max_blocks_per_seq, capture_sizes(max_num_seqs),
                                                   device, graph_mode, max_num_seqs if self.has_state else None,
                                                   sharded=self.sharded)
            if self.sharded:
                self.decode_graphs.capture_if_stale()
        self.batch_invariant = batch_invariant
        if batch_invariant:  # refused by name before anything is moved or built (batch_invariance.py)
            check_model(model, device, graph_mode)
        self.hugepage_bytes = 0  # CPU: weights and the KV pool moved into 2 MiB pages (hugepages.py)
        if device.type == "cpu":
            kv = [t for c in self.kv_caches for t in (c if isinstance(c, (list, tuple)) else (c,))]
            self.hugepage_bytes = move_to_hugepages(module_tensors(model) + kv)
        self.state_caches = [c for c in self.kv_caches if isinstance(c, KDAStateCache)]
        # decode-only CPU bf16 steps: the whole decoder stack in one C++ call where the model allows (None: modules)
        self.cpu_decode_stack: CpuDecodeStack | None = None
        if device.type == "cpu" and graph_mode is None and not self.has_state:
            self.cpu_decode_stack = CpuDecodeStack.build(model, self.kv_caches, self.block_size)
        if batch_invariant:
            check_stack(self.cpu_decode_stack)
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), dtype=np.int64)
        self.sampler = sampler
        self.stager = InputStager(device)  # the module path's integer inputs: one host-to-device copy per step
        if sampler is not None:
            sampler.batch_invariant = batch_invariant  # each row drawn by its own kind of draw, whatever its mates
            sampler.use_cpu_kernels = device.type == "cpu"  # a GPU engine's logits draw in PyTorch: no kernel build
        # GPU engines draw every row on the device and copy back only the sampled ids (Sampler.draw_on_device; rows
        # with logits processors or min_tokens: Sampler.on_device), and verify drafts there (spec_decode/); every
        # CPU engine samples host logits
        self.device_draw = sampler is not None and device.type != "cpu"
        if sampler is not None:  # penalties, min_p, logit_bias, allowed_token_ids, bad_words by row (logits_state.py)
            sampler.processors = LogitsProcessorState(max_num_seqs, model.cfg.vocab_size, self.token_ids)
        self.eos_ids: list[int] = []
        # async scheduling (async_scheduling.py): the previous step's drawn ids [N] int64, which this step's
        # placeholder token ids -(j + 1) stand for; set by the engine around execute(), else None
        self.placeholder_source: torch.Tensor | None = None
        self.tp_channel = None  # tensor parallel: rank 0 broadcasts each step (tokenfab.parallel.worker.StepChannel)
        self._threads: tuple[int, int] | None = None  # (prefill, decode) intra-op threads; None: leave torch's
        self._threads_now = torch.get_num_threads()

    def set_hidden_capture(self, request: HiddenRequest | None) -> None:
        """Keep the hidden states ``request`` asks for from every forward (``self.captured`` after each
        :meth:`execute`, a :class:`~tokenfab.spec_decode.proposer.CapturedHidden`); None stops it. Layer taps
        are forward hooks on ``model.model.layers[i]``: steps the decode-graph buffers serve return them from
        :meth:`model_forward` (CUDA: the graphs are captured again with the hooks' ops; under tensor parallel the
        workers capture again at the same step, without hooks: :meth:`follow_graphs`); other steps run the modules
        (never the fused CPU stack).

        Raises:
            ValueError: a layer id outside the model's decoder layers (named)."""
        for h in self._tap_hooks:
            h.remove()
        had_taps = bool(self._tap_hooks)
        self._tap_hooks, self._tap_out = [], []
        self.capture = request
        if request is None or not request.layer_ids:
            if had_taps and self.decode_graphs is not None:
                self.decode_graphs.mark_stale()  # graphs without the taps' ops
            return
        layers = self.model.model.layers
        for i in request.layer_ids:
            if not 0 <= i < len(layers):
                raise ValueError(f"hidden-state tap at layer {i}: the model has decoder layers 0..{len(layers) - 1}.")
        tap = getattr(self.model, "tap_hidden", None)  # a layer output that is not one tensor (K3: kimi_linear.py)
        for slot, i in enumerate(request.layer_ids):
            def hook(_mod, _inp, out, slot=slot, i=i):
                if tap is None and isinstance(out, tuple):  # GPU path: (mlp_out, residual), DecoderLayer.forward
                    out = out[0] + out[1]
                self._tap_out[slot] = out if tap is None else tap(i, out, request.tap_stream)
            self._tap_hooks.append(layers[i].register_forward_hook(hook))
        if self.decode_graphs is not None:
            self.decode_graphs.mark_stale()  # CUDA: captured again, the hooks' ops recorded with every graph

    def write_tokens(self, rows: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> None:
        """Record tokens (e.g. just sampled) at [row, position] of the persistent token array."""
        self.token_ids[rows, positions] = tokens
        if self.sampler is not None and self.sampler.processors is not None:
            self.sampler.processors.record(rows, tokens)  # output-token counts of rows with penalties

    def step_source(self, input_ids: np.ndarray) -> torch.Tensor | None:
        """Async scheduling: the previous step's drawn ids (:attr:`placeholder_source`) on this runner's device
        when ``input_ids`` [T] hold a placeholder ``-(j + 1)``, else None."""
        src = self.placeholder_source
        if src is None or not (input_ids < 0).any():
            return None
        return src if src.device == self.device else src.to(self.device, non_blocking=True)

    def penalty_counts_at_draw(self, on: bool) -> None:
        """Async scheduling on / off: the penalties' counts kept where the logits are and advanced at each draw
        (engine/draw_time_counts.py), or on the host alone (LogitsProcessorState.use_draw_time_counts)."""
        proc = self.sampler.processors if self.sampler is not None else None
        if proc is not None:
            proc.use_draw_time_counts((self.device if self.device_draw else torch.device("cpu")) if on else None)

    def admit(self, seqs) -> None:
        """Copy the full token lists of newly admitted sequences into their rows."""
        for s in seqs:
            self.token_ids[s.row, : s.num_tokens] = s.token_ids
        if self.sampler is not None and self.sampler.processors is not None:
            self.sampler.processors.admit(seqs)

    def _group_arrays(self, rows_bt: np.ndarray, starts: np.ndarray, num_new: np.ndarray, num_computed: np.ndarray,
                      T: int) -> tuple[list[np.ndarray], dict]:
        """An AttentionGroup's int64 arrays (token_index, query_pos, block_tables, context_lens) and its other
        fields (q_len, max_context, flat_range), for one staged copy (:meth:`_group`, :meth:`forward`)."""
        q_len = int(num_new.max())
        ar = np.arange(q_len)
        valid = ar[None, :] < num_new[:, None]
        token_index = np.where(valid, starts[:, None] + ar[None, :], T)
        query_pos = np.where(valid, num_computed[:, None] + ar[None, :], -1)
        ctx = num_computed + num_new
        nblk = int((ctx.max() + self.block_size - 1) // self.block_size)
        fields = dict(q_len=q_len, max_context=nblk * self.block_size,
                      flat_range=(int(starts[0]), int(starts[0]) + len(num_new) * q_len) if bool(valid.all()) else None)
        return [token_index, query_pos, rows_bt[:, :nblk], ctx], fields

    def _group(self, rows_bt: np.ndarray, starts: np.ndarray, num_new: np.ndarray, num_computed: np.ndarray,
               T: int) -> AttentionGroup:
        arrays, fields = self._group_arrays(rows_bt, starts, num_new, num_computed, T)
        return AttentionGroup(*self.stager.stage(arrays), **fields)

    @torch.inference_mode()
    def forward(self, d: int, num_new: np.ndarray, num_computed: np.ndarray, bt: np.ndarray, input_ids: np.ndarray,
                logit_idx: np.ndarray, derived: tuple | None = None,
                rows: np.ndarray | None = None, hold: np.ndarray | None = None,
                modules: bool = False, on_device: bool = False) -> torch.Tensor | None:
        """Run the model on one step's flat batch; logits [len(logit_idx), vocab] float32 on CPU (``on_device``:
        left on the model's device), or None.

        Args (int64 numpy): ``d`` decode sequences (first in the batch); ``num_new`` / ``num_computed`` [B] tokens
        this step / already in the cache per sequence; ``bt`` [B, >= blocks needed] block tables; ``input_ids`` [T];
        ``logit_idx`` [L] flat-batch rows whose logits are wanted. ``derived`` = (T, starts, req_idx, positions)
        when the caller has them. Tensor-parallel workers call this with the arrays rank 0 broadcast. ``rows`` [B]:
        scheduler rows, the recurrent-state slots of hybrid (KDA) models; required by those models only.
        ``hold`` [B] bool: speculative verification rows whose KDA states the step holds until
        :meth:`commit_state` (hybrid models; None: no row). ``modules``: run through the model's modules even where
        the decode graphs or the fused CPU stack would apply (tensor-parallel workers, when rank 0 taps layer
        outputs without decode graphs: every rank runs the same path, :meth:`uses_modules`).
        """
        B = len(num_new)
        if derived is None:
            T = int(num_new.sum())
            starts = np.cumsum(num_new) - num_new
            req_idx = np.repeat(np.arange(B), num_new)
            positions = num_computed[req_idx] + np.arange(T) - starts[req_idx]
        else:
            T, starts, req_idx, positions = derived
        slots = self._slots(bt, req_idx, positions)
        if self.state_caches:
            clear_deferred(self.state_caches)
            if self.decode_graphs is not None:
                self.decode_graphs.forget_step()
        src = self.step_source(input_ids)
        taps = self.capture is not None and bool(self.capture.layer_ids)
        # the padded buffers, layer taps included
        graphs = None if modules else self.decode_graphs
        fused = not (taps or modules)  # the fused CPU stack has no layer outputs to tap
        logit_sel = None  # the module path's staged logit rows
        graph_taps = None  # the layer taps the graph or module path returned
        if self.batch_invariant and fused:  # every token one query row over its own context: no group or chunk
            hidden = self.cpu_decode_stack.run(fill_placeholders_host(input_ids, src), positions, slots, bt[req_idx],
                                               positions + 1)
        elif graphs is not None and d == B and B <= graphs.max_batch:  # decode-only: cuda_graph_runner.py
            hidden, graph_taps = graphs.run(input_ids, positions, slots, bt, num_computed + 1, rows,
                                            placeholder_source=src)
        elif graphs is not None and self._flat_rows(num_new, T):  # each token a decode row of its own
            hidden, graph_taps = graphs.run(input_ids, positions, slots, bt[req_idx], positions + 1,
                                            placeholder_source=src)
        elif (graphs is not None and self.has_state
              and graphs.fits_verify(num_new)):  # hybrid verification rows: attention flat, KDA [B, 1 + k]
            hidden, graph_taps = graphs.run_verify(input_ids, positions, slots, bt[req_idx], num_new, rows, hold,
                                                   placeholder_source=src)
        elif fused and self.cpu_decode_stack is not None and d == B:  # decode-only on CPU: cpu_decode_stack.py
            hidden = self.cpu_decode_stack.run(fill_placeholders_host(input_ids, src), positions, slots, bt,
                                               num_computed + 1)
        else:  # the module path: every integer input in one staged copy (input_staging.py)
            groups = [self._group_arrays(bt[:d], starts[:d], num_new[:d], num_computed[:d], T) if d else None,
                      self._group_arrays(bt[d:], starts[d:], num_new[d:], num_computed[d:], T) if d < B else None]
            pick = not (d == B and len(logit_idx) == B)  # decode-only steps want every row, in order
            arrays = [slots, positions, input_ids, logit_idx if pick else logit_idx[:0]]
            arrays += ([] if rows is None else [rows]) + [a for g in groups if g is not None for a in g[0]]
            staged = self.stager.stage(arrays)
            slot_t, pos_t, ids_t, logit_t = staged[:4]
            if src is not None:  # async scheduling: the previous step's ids, gathered on the device
                ids_t = fill_placeholders(ids_t, src)
            rest = staged[4:] if rows is None else staged[5:]
            made = []
            for g in groups:
                made.append(None if g is None else AttentionGroup(*rest[:4], **g[1]))
                rest = rest[4:] if g is not None else rest
            meta = AttentionMetadata(
                slot_mapping=slot_t, decode=made[0], prefill=made[1], num_tokens=T, block_size=self.block_size,
                state_rows=None if rows is None else staged[4],
                state_hold=None if hold is None else torch.from_numpy(hold).to(self.device, non_blocking=True),
                state_hold_host=hold, num_new_host=None if hold is None else num_new,
                state_rows_host=None if hold is None else rows)
            hidden, graph_taps = self.model_forward(ids_t, pos_t, meta)  # layer taps from forward hooks
            logit_sel = logit_t if pick else None
        if self.capture is not None:
            self._hidden_now = (hidden if self.capture.final else None, graph_taps if taps else None)
        if len(logit_idx) == 0:
            return None
        if not (d == B and len(logit_idx) == B):  # decode-only steps want every row, in order
            hidden = hidden[logit_sel if logit_sel is not None else torch.from_numpy(logit_idx).to(self.device)]
        logits = self.model.compute_logits(hidden)
        return logits if on_device else logits.cpu()

    def model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward over the pool: hidden [N, hidden] and, when a drafter taps layer outputs
        (:meth:`set_hidden_capture`), the taps [N, n, hidden] its forward hooks produced, stacked. The module path's
        forward and the decode-graph buffers' (engine/cuda_graph_runner.py: recorded into the graph at capture)."""
        taps = self.capture is not None and bool(self.capture.layer_ids)
        if taps:
            self._tap_out = [None] * len(self.capture.layer_ids)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return hidden, (torch.stack(self._tap_out, dim=1) if taps else None)

    def enable_verify_graphs(self, num_speculative_tokens: int) -> None:
        """Hybrid (KDA) models with decode graphs: serve speculative verification steps of up to
        1 + ``num_speculative_tokens`` tokens a sequence from the graph buffers (DecodeGraphRunner.enable_verify;
        under tensor parallel the workers follow at the next step, :meth:`follow_graphs`); a no-op otherwise
        (models without state keep their flat-row graphs)."""
        if self.decode_graphs is not None and self.has_state:
            self.decode_graphs.enable_verify(1 + int(num_speculative_tokens))

    def graph_state(self) -> tuple[int, bool]:
        """(V, S) of the decode graphs, sent with every tensor-parallel step (parallel/worker.py): V the
        verification graphs' tokens per sequence (0: none), S whether they wait to be captured again."""
        g = self.decode_graphs
        return (0, False) if g is None else (g.verify_q, g.stale)

    def follow_graphs(self, verify_q: int, stale: bool) -> None:
        """Workers, before each step: mirror rank 0's decode graphs (:meth:`graph_state`): its verification graphs
        of ``verify_q`` tokens a sequence, and a capture pending there (``stale``), so every rank takes the same
        path through the padded buffers and captures at the same step."""
        g = self.decode_graphs
        if g is None:
            return
        if verify_q != g.verify_q:
            g.enable_verify(verify_q)
        if stale:
            g.mark_stale()

    def _flat_rows(self, num_new: np.ndarray, T: int) -> bool:
        """Whether a step that is not decode-only runs through the decode graphs with every token as a decode row
        of its own (its sequence's block table, context length = its position + 1; the K/V of the step's earlier
        tokens is written before attention reads it, so each token sees exactly its causal prefix): speculative
        verification rows (1 + k tokens) and short prefill chunks beside decodes, up to FLAT_MAX_QUERY tokens a
        sequence and the largest captured batch in all. Not for hybrid (KDA) models, whose recurrent state must
        advance token by token within a sequence."""
        return (not self.has_state and T <= self.decode_graphs.max_batch
                and int(num_new.max()) <= FLAT_MAX_QUERY)

    def uses_modules(self) -> bool:
        """True when this runner's steps must run through the model's modules: a drafter taps layer outputs
        (forward hooks, which the fused CPU stack does not run) and there are no decode-graph buffers (whose forward
        returns the taps: :meth:`model_forward`)."""
        return self.capture is not None and bool(self.capture.layer_ids) and self.decode_graphs is None

    def keep_captured(self, seqs, rows: np.ndarray, req_idx: np.ndarray, positions: np.ndarray) -> None:
        """``self.captured`` from the last forward's hidden states and its batch (``seqs`` [B], ``rows`` [B],
        ``req_idx`` / ``positions`` [T])."""
        hidden, taps = self._hidden_now
        self._hidden_now = None
        self.captured = CapturedHidden(list(seqs), rows, req_idx, positions, hidden, taps)

    def commit_state(self, rows: np.ndarray, kept: np.ndarray) -> int:
        """After a verification step of a hybrid model: write the KDA state of each row in ``rows`` [N] int64 as
        the state after its first ``kept`` [N] int64 tokens of that step (engine/state_commit.py; the step held
        them), on every tensor-parallel rank. Must follow every forward with held rows (kept = 0 after a failed
        one). Returns the (layer, row) states written here (0 for models without state).

        Raises:
            ValueError: ``kept`` larger than the tokens a row ran, or mismatched lengths (nothing written).
        """
        if not self.state_caches:
            return 0
        rows = np.asarray(rows, dtype=np.int64)
        kept = np.asarray(kept, dtype=np.int64)
        n = None if self.decode_graphs is None else self.decode_graphs.commit(rows, kept)  # a graph's commit
        if n is None:  # the layers kept host copies of their rows: the commit reads these, the tensors only where not
            n = commit(self.state_caches, torch.from_numpy(rows), torch.from_numpy(kept), rows, kept)
        if self.tp_channel is not None:  # the workers hold their heads' states: the same commit there
            self.tp_channel.send_commit(rows, kept)
        return n

    def set_thread_policy(self, prefill_threads: int, decode_threads: int) -> None:
        """CPU intra-op threads per step kind: steps with prefill tokens use ``prefill_threads`` (large GEMMs that
        scale with cores), decode-only steps ``decode_threads`` (many small ops, where a core left to the HTTP
        front end avoids stalled parallel regions). Measured in benchmarks/NOTES.md."""
        self._threads = (int(prefill_threads), int(decode_threads))

    def _apply_thread_policy(self, has_prefill: bool) -> None:
        n = self._threads[0] if has_prefill else self._threads[1]
        if n != self._threads_now:
            torch.set_num_threads(n)
            self._threads_now = n

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one forward pass for ``batch`` and sample where sequences reached their last known token (in the
        kernels' batch-invariant mode when the runner was built with ``batch_invariant``)."""
        self.captured = None
        with cpu_batch_invariant.batch_invariant(self.batch_invariant):
            return self._execute_step(batch)

    def _execute_step(self, batch: ScheduledBatch) -> StepOutput:
        stack = self.cpu_decode_stack
        if (batch.num_decodes == len(batch) and stack is not None and stack.vocab_size is not None
                and self.capture is None):  # the fused draw returns no hidden states
            if self._threads is not None:
                self._apply_thread_policy(False)
            out = self._stack_sample_step(batch.seqs, batch.num_computed, batch.rows)  # one C++ call, no autograd
            if out is not None:
                return out
        return self._execute(batch)

    @torch.inference_mode()
    def _execute(self, batch: ScheduledBatch) -> StepOutput:
        seqs, B, d = batch.seqs, len(batch), batch.num_decodes
        num_new, num_computed, rows = batch.num_new, batch.num_computed, batch.rows
        T = int(num_new.sum())
        if self._threads is not None:
            self._apply_thread_policy(T > B)
        if d == B:  # decode-only: token i of sequence i at position num_computed[i]; every sequence samples
            starts = req_idx = sampled_index = sample_tok = np.arange(B)
            positions = num_computed
            input_ids = self.token_ids[rows, positions]
            plp_tok = np.zeros(0, dtype=np.int64)  # decode positions are past the prompt: no prompt logprobs
        else:
            cu = np.cumsum(num_new)
            starts = cu - num_new
            req_idx = np.repeat(np.arange(B), num_new)
            positions = num_computed[req_idx] + np.arange(T) - starts[req_idx]
            input_ids = self.token_ids[rows[req_idx], positions]
            seq_lens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=B)
            sampled_index = np.nonzero(num_computed + num_new == seq_lens)[0]
            sample_tok = cu[sampled_index] - 1
            plp_tok = self._prompt_logprob_tokens(seqs, req_idx, positions)
        spec_tok = None
        if batch.spec_lens is not None:  # speculative rows: logits at all their tokens, verified by spec_decode
            sampled_index, sample_tok, spec_tok = verification_rows(batch.spec_lens, num_new, sampled_index)
        bt = self.bm.block_tables[rows]
        hold = batch.spec_lens > 0 if spec_tok is not None and self.has_state else None  # KDA states: commit_state
        logit_idx = np.concatenate([sample_tok, plp_tok]) if len(plp_tok) else sample_tok
        if spec_tok is not None:
            logit_idx = np.concatenate([logit_idx, spec_tok])
        if self.tp_channel is not None:  # tensor parallel: the workers run the same forward (tokenfab/parallel)
            self.tp_channel.send_step(d, num_new, num_computed, bt, input_ids, logit_idx,
                                      rows if self.has_state else None, hold,  # hybrid models: the KDA state slots
                                      modules=self.uses_modules(),  # every rank pads (or not) alike
                                      graphs=self.graph_state(),  # and captures at the same step
                                      source=self.step_source(input_ids))  # the ids their placeholders take
        logits = self.forward(d, num_new, num_computed, bt, input_ids, logit_idx, (T, starts, req_idx, positions),
                              rows=rows, hold=hold, on_device=True)
        if self.capture is not None:
            self.keep_captured(seqs, rows, req_idx, positions)
        if logits is None:
            return StepOutput(sampled_index, None, None)
        if not self.device_draw:
            logits = logits.cpu()  # the host sampler (and verification) read host logits
        s_logits, p_logits = logits[: len(sample_tok)], logits[len(sample_tok):len(sample_tok) + len(plp_tok)]
        spec_logits = logits[len(sample_tok) + len(plp_tok):] if spec_tok is not None else None

        sampler_out = None
        if len(sampled_index):
            sample_seqs = seqs if d == B else [seqs[i] for i in sampled_index]
            srows, lengths = rows[sampled_index], (num_computed + num_new)[sampled_index]
            if self.device_draw:
                # drawn where the logits are, only the ids (and logprobs asked for) come back: plain rows by
                # draw_on_device, rows with processors or below min_tokens by the full sampler there
                if not self._min_tokens_rows(sample_seqs):
                    sampler_out = self.sampler.draw_on_device(s_logits, sample_seqs, srows)
                if sampler_out is None:
                    sampler_out = self.sampler.on_device(self._mask_min_tokens(s_logits, sample_seqs), sample_seqs,
                                                         s_logits, srows, lengths)
            else:
                sampler_out = self.sampler(self._mask_min_tokens(s_logits, sample_seqs), sample_seqs,
                                           raw_logits=s_logits, rows=srows, lengths=lengths)
        plp = None
        if len(plp_tok):  # on the logits' device; only the scored entries come back
            seq_i = req_idx[plp_tok]
            pred_pos = positions[plp_tok] + 1
            targets = self.token_ids[rows[seq_i], pred_pos]
            logp = torch.log_softmax(p_logits, dim=-1)
            k = max(seqs[i].params.prompt_logprobs for i in np.unique(seq_i))
            lp, ranks, ti, tv = token_logprobs(logp, torch.from_numpy(targets).to(logp.device), k,
                                               self.batch_invariant)
            host = lambda t: None if t is None else t.cpu().numpy()
            plp = PromptLogprobs(seq_i, pred_pos, targets, host(lp), host(ti), host(tv), host(ranks))
        return StepOutput(sampled_index, sampler_out, plp, spec_logits)

    @staticmethod
    def _prompt_logprob_tokens(seqs, req_idx: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Flat-batch rows whose logits score a prompt token for a sequence that asked for prompt logprobs (each
        prompt position once, resuming after those already stored)."""
        B = len(seqs)
        wants = np.fromiter((s.wants_prompt_logprobs for s in seqs), dtype=bool, count=B)
        if not wants.any():
            return np.zeros(0, dtype=np.int64)
        n_prompt = np.fromiter((s.num_prompt_tokens for s in seqs), dtype=np.int64, count=B)
        done = np.fromiter((len(s.prompt_logprobs) - 1 if s.prompt_logprobs is not None else 0 for s in seqs),
                           dtype=np.int64, count=B)
        mask = wants[req_idx] & (positions < n_prompt[req_idx] - 1) & (positions >= done[req_idx])
        return np.nonzero(mask)[0]

    def _stack_sample_step(self, seqs, num_computed: np.ndarray, rows: np.ndarray) -> StepOutput | None:
        """A decode-only step whose rows the sampler draws plainly (no logprobs, top-k / top-p or min_tokens
        mask): forward, LM head and draw in one C++ call (``CpuDecodeStack.run_sample``), the same tokens as
        :meth:`forward` then the sampler. None, running nothing, when some row is not plain."""
        stack = self.cpu_decode_stack
        if self._min_tokens_rows(seqs):
            return None
        plain = self.sampler.plain_inputs(seqs, stack.vocab_size, rows)
        if plain is None:
            return None
        ctx = num_computed + 1
        nblk = (int(ctx.max()) + self.block_size - 1) // self.block_size
        bt = self.bm.block_tables[rows, :nblk]  # the columns attention reads; the slots are computed in C++
        ids = fill_placeholders_host(self.token_ids[rows, num_computed], self.placeholder_source)
        tokens = stack.run_sample(ids, num_computed, None, bt, ctx, *plain)
        return StepOutput(np.arange(len(seqs)), SamplerOutput(tokens, None, None, None), None)

    def _slots(self, bt: np.ndarray, req_idx: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """KV-pool slot of each token: block_tables[sequence, position // block_size] * block_size + offset."""
        bs = self.block_size
        return bt[req_idx, positions // bs] * bs + positions % bs

    @staticmethod
    def _min_tokens_rows(seqs) -> list[int]:
        """Rows still below their ``min_tokens`` (EOS and stop tokens forbidden for them)."""
        return [i for i, s in enumerate(seqs) if s.params.min_tokens and s.num_output_tokens < s.params.min_tokens]

    def _mask_min_tokens(self, logits: torch.Tensor, seqs) -> torch.Tensor:
        """Logits with EOS and stop tokens forbidden for sequences below ``min_tokens`` (vLLM semantics); the
        input is returned untouched (a masked copy is made only when some row needs it)."""
        rows = self._min_tokens_rows(seqs)
        if not rows:
            return logits
        masked = logits.clone()
        for i in rows:
            p = seqs[i].params
            ids = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids)
            if ids:
                masked[i, ids] = float("-inf")
        return masked
