"""``method: "dspark"``: the block-parallel DSpark drafter on the target's tapped hidden states.

Per step and sequence: one drafter pass (:class:`tokenfab.models.dspark_drafter.DSparkDrafter`) over
``[anchor, mask x (N - 1)]`` attending to the sequence's context, then the drafts in order with the Markov bias
(:func:`sample_in_order`). Batched over sequences; the only loop runs over the k draft positions.

Context: the proposer asks the target for the hidden states after ``target_layer_ids`` at every token
(:meth:`hidden_request`, the target-hidden-state seam in ``spec_decode/proposer.py``) and, after every target forward
(:meth:`observe`), projects the context tokens' taps (fc + hidden_norm) and writes each MLA draft layer's key rows
``[c | rope(k_pe)]`` into its own paged cache, addressed by the target's block table (same block geometry as the
target's pool), so every context position is projected once. A pass reads those rows in place: each MLA draft
layer's cache has spare tail blocks (one set per scheduler row) that take the block's own rows after a copy of the
anchor's block, and the paged decode kernels attend over the block table (models/dspark_drafter.PagedDraftContext;
before, the rows were gathered into a padded float32 copy per pass). A sequence drafts only when every position
before its anchor has context rows: observed since its last preemption, or found in the caches after a prefix-cache
hit (see below; failed steps rerun in parts leave gaps: such a sequence decodes plainly). Where the target's decode
steps replay CUDA graphs (or their eager static-buffer form), the pass does too: spec_decode/dspark_graphs.py, its
padding rows in one more row's tail blocks than the scheduler has.

Which tapped stream a K3 target gives (partial block sum or attention-residual mixture): ``speculative_config.
dspark_tap``, else the checkpoint's ``aux_hidden_stream``, else ``"partial_sum"`` (spec_decode/dspark_config.py).
The confidence head is not used: each proposal drafts min(k, what max_tokens leaves) tokens.

Tensor parallel: the drafter runs unsharded on rank 0, the engine's process, between target steps (the workers take
no part). The taps it reads there are complete: forward hooks on rank 0's decoder layers see the replicated residual
stream (each layer all-reduces its attention and MLP outputs; K3's partial block sum is that stream and its
attention-residual mixture is computed from it with replicated weights), and under tensor parallel every target
step with taps is a module step. The KDA state commit after verification runs on every rank (the runner broadcasts
it). The target's embedding and LM head are vocab-parallel shards (their forward is a collective), so the drafter
uses full copies read from the checkpoint on rank 0 (:class:`~tokenfab.spec_decode.target_vocab.TargetVocab`).
Extra memory on rank 0: the drafter (as at one device) plus V x H per table, embedding and head (Kimi K3 bf16:
2 x 2.35 GB), plus the drafter's context-row caches and their tail blocks (as at one device).

Prefix-cache hits: the target computes no taps for a hit's cached positions, but the drafter's context rows live in
its own caches at the target's slots, so the rows the earlier request wrote into a cached block are still there.
They are the right rows exactly when they were written for the block's current content (rows at a position are a
function of the tokens up to it), so per block the proposer records the prefix-cache hash (engine/prefix_cache.py:
fixed by the block's tokens and every token before them) of the content whose rows it wrote in full: any write
into a block clears its record, and it is recorded again once all its rows are written for one sequence's tokens.
A sequence whose first observed position follows a hit starts with the longest run of leading hit blocks whose
record is the block's hash; it drafts when that run is the whole hit. Not covered (such a sequence decodes
plainly): a hit block whose rows the drafter never wrote in full, e.g. the block of a request's last computed
position when the request finished in that step (finished requests are not written), or one a failed step
computed.
"""
from __future__ import annotations

import numpy as np
import torch

from tokenfab.engine.sequence import SequenceStatus
from tokenfab.errors import EngineConfigError
from tokenfab.spec_decode.dspark_config import check_against_target, load_dspark_config, resolve_tap
from tokenfab.spec_decode.proposer import HiddenRequest, Proposal, Proposer
from tokenfab.spec_decode.rejection_sampler import DraftUniforms, SamplingTensors, draw_draft


def sample_in_order(base: torch.Tensor, anchor: torch.Tensor, bias_fn, st: SamplingTensors, seqs,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draw the drafts of a block left to right with the Markov bias of the token before each.

    Args:
        base: [B, m, V] float32 base draft logits (the drafter's lm_head output per draft slot).
        anchor: [B] int64, the token before draft 0.
        bias_fn: prev ids [B] -> [B, V] float32 bias, or a function returning None (no Markov head).
        st: the rows' sampling settings; greedy rows take argmax(base_j + bias(prev)), others draw from
            q_j = target_probs(base_j + bias(prev)) (temperature / top-k / top-p, as the verifier applies to p).
        seqs: the B sequences (a seeded row's draft j takes the uniform its own stream holds for that position,
            read without consuming it: rejection_sampler.DraftUniforms); generator: the engine's.

    Returns:
        (drafts [B, m] int64, q [B, m, V] float32 or None when every row is greedy), on ``base``'s device: the
        draws run where the drafter's logits are (a GPU engine's: the host only draws the uniforms, as its sampler
        does, and reads the drafts once; ``rejection_sampler.draw_draft``).

    Raises:
        ValueError: ``anchor`` on another device than ``base``.
    """
    B, m, V = base.shape
    dev = base.device
    if anchor.device != dev:
        raise ValueError(f"sample_in_order: anchor on {anchor.device}, base logits on {dev}; pass both on one device")
    drafts = torch.zeros(B, m, dtype=torch.int64, device=dev)
    q_all = None
    prev = anchor
    uniforms = None if bool(st.greedy.all()) else DraftUniforms(seqs, generator, m)
    for j in range(m):
        bias = bias_fn(prev)
        tok, q = draw_draft(base[:, j] if bias is None else base[:, j] + bias, st, uniforms, j)
        if q is not None:
            if q_all is None:
                q_all = torch.zeros(B, m, V, dtype=torch.float32, device=dev)
            q_all[:, j] = q
        drafts[:, j] = tok
        prev = tok
    return drafts, q_all


class DSparkProposer(Proposer):
    """DSpark drafter over the target's taps.

    Args:
        path: the drafter folder (speculators or SpecForge layout).
        k: num_speculative_tokens (<= the drafts one pass yields: block_size, or block_size - 1 without
            sample_from_anchor).
        engine: the target LLMEngine (model, block manager, device, dtype, generator).
        tap: ``speculative_config.dspark_tap`` or None (the checkpoint's).

    Raises:
        EngineConfigError: k above the block's drafts, or a drafter that does not fit the target (named field).
        UnsupportedError / WeightLoadError: tensor parallel with a quantized or missing target embedding / LM head
            (target_vocab.py).
        WeightLoadError: missing / unexpected / mis-shaped drafter tensors.

    With the engine's ``load_format="dummy"`` the drafter's folder needs config.json only: its weights are seeded
    random tensors on the device (loader/dummy_weights.py), as the target's are.
    """

    def __init__(self, path: str, k: int, engine, tap: str | None = None):
        from tokenfab.models.dspark_drafter import DSparkDrafter, load_dspark_weights

        cfg = load_dspark_config(path)
        check_against_target(cfg, engine.model_config)
        if k > cfg.num_drafts:
            raise EngineConfigError(f"speculative_config.num_speculative_tokens ({k}) exceeds the {cfg.num_drafts} "
                                    f"drafts one DSpark pass yields (block_size {cfg.block_size}"
                                    f"{'' if cfg.sample_from_anchor else ' - 1, slot 0 is the anchor'}).")
        self.cfg, self.num_speculative_tokens = cfg, k
        self.tap = resolve_tap(cfg, tap)
        target = engine.runner.model
        if getattr(target.cfg, "attn_res_block_size", None) is None:
            self.tap = "partial_sum"  # no attention residuals: both streams are the layer output
        embed, head = target.model.embed_tokens, target.compute_logits
        self.vocab = None
        if engine.tp_group is not None:  # the target's tables are shards whose forward is a collective
            from tokenfab.spec_decode.target_vocab import TargetVocab
            self.vocab = TargetVocab(engine)
            embed, head = self.vocab.embed, self.vocab.logits
        self.drafter = DSparkDrafter(cfg, embed, head)
        if getattr(engine.config, "load_format", "auto") == "dummy":  # the target's mode: no drafter file read either
            from tokenfab.loader.dummy_weights import fill_dummy_weights
            from tokenfab.models.dspark_drafter import set_param_dtypes
            fill_dummy_weights(self.drafter, engine.device, seed=getattr(engine.config, "seed", 0))
            set_param_dtypes(self.drafter, engine.dtype)
            self.skipped_weights = []
        else:
            self.skipped_weights = load_dspark_weights(self.drafter, path, engine.dtype)
        self.drafter.to(engine.device)
        self.bm = engine.block_manager
        bs = self.bm.block_size
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        # per sequence row, spare "tail" blocks past the pool's: where a pass writes its block's own rows
        # (models/dspark_drafter.PagedDraftContext); enough for p % bs + block_size positions
        self.num_tail = -(-(bs - 1 + cfg.block_size) // bs)
        # one more row's tail than scheduler rows: the drafter graphs' padding rows use it (spec_decode/dspark_graphs)
        tail_blocks = (self.bm.block_tables.shape[0] + 1) * self.num_tail
        self.caches = [torch.zeros(self.bm.num_blocks + tail_blocks, bs, width, dtype=engine.dtype,
                                   device=engine.device) for _ in self.drafter.mla_layers]
        self.vocab_size = cfg.vocab_size
        self.generator = engine.generator
        self.device = engine.device
        self._valid: dict[int, list[int]] = {}  # seq_id -> [num_preemptions, context positions written from 0]
        # prefix caching: per block, the prefix-cache hash of the content whose context rows are all written there
        # (valid where _rows_ok; see the module docstring)
        self.pc = self.bm.prefix_cache
        self._rows_hash: list[bytes | None] = [None] * self.bm.num_blocks
        self._rows_ok = np.zeros(self.bm.num_blocks, dtype=bool)
        # where the target's decode steps replay CUDA graphs (or their eager static-buffer form), so do the
        # drafter's passes (spec_decode/dspark_graphs.py)
        self.graphs = None
        target_graphs = getattr(engine.runner, "decode_graphs", None)
        if target_graphs is not None:
            from tokenfab.spec_decode.dspark_graphs import DSparkGraphRunner
            self.graphs = DSparkGraphRunner(
                self.drafter, self.caches, num_blocks=self.bm.num_blocks, block_size=bs,
                max_blocks=self.bm.block_tables.shape[1], num_tail=self.num_tail,
                pad_row=self.bm.block_tables.shape[0], num_drafts=k, sizes=target_graphs.sizes,
                device=engine.device, mode=target_graphs.mode)
            self.graphs.capture()

    # ---- the target-hidden-state seam ---------------------------------------------------------------------
    def hidden_request(self) -> HiddenRequest:
        return HiddenRequest(final=False, layer_ids=tuple(self.cfg.target_layer_ids), tap_stream=self.tap)

    def _slots(self, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        bs = self.bm.block_size
        bt = self.bm.block_tables
        return torch.from_numpy(bt[rows, positions // bs] * bs + positions % bs).to(self.device)

    @torch.inference_mode()
    def observe(self, captured) -> None:
        """Write the context rows of every observed context token (positions <= num_tokens - 2 of its sequence)
        and advance each sequence's written prefix when the observed positions continue it."""
        if captured.taps is None or not len(captured.positions):
            return
        seqs = captured.seqs
        ntok = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        # sequences that finished or were preempted in this step have given their blocks back: nothing to write
        alive = np.fromiter((s.status == SequenceStatus.RUNNING for s in seqs), dtype=bool, count=len(seqs))
        pos, ridx = captured.positions, captured.req_idx
        ctx = (pos <= ntok[ridx] - 2) & alive[ridx]
        if not ctx.any():
            return
        sel = np.nonzero(ctx)[0]
        p, r = pos[sel], ridx[sel]
        taps = captured.taps[torch.from_numpy(sel).to(captured.taps.device)]
        h = self.drafter.context(taps.reshape(len(sel), -1).to(self.drafter.fc.weight.dtype))
        slots = self._slots(captured.rows[r], p)
        pos_t = torch.from_numpy(p).to(self.device)
        for cache, rows in zip(self.caches, self.drafter.context_rows(h, pos_t)):
            cache.view(-1, cache.shape[-1]).index_copy_(0, slots, rows.to(cache.dtype))
        bs = self.bm.block_size
        if self.pc is not None:  # blocks written here hold rows of this content now: recorded again below if whole
            self._rows_ok[self.bm.block_tables[captured.rows[r], p // bs]] = False
        lo = np.full(len(seqs), np.iinfo(np.int64).max, dtype=np.int64)
        hi = np.full(len(seqs), -1, dtype=np.int64)
        np.minimum.at(lo, r, p)
        np.maximum.at(hi, r, p)
        for b in np.nonzero(hi >= 0)[0].tolist():  # bookkeeping per observed sequence (a dict entry each)
            s = seqs[b]
            st = self._valid.get(s.seq_id)
            if st is None or st[0] != s.num_preemptions:
                st = self._valid[s.seq_id] = [s.num_preemptions, self._cached_rows(s, int(lo[b]))]
            if lo[b] <= st[1]:
                st[1] = max(st[1], int(hi[b]) + 1)
                if self.pc is not None:
                    self._record_blocks(s, int(lo[b]) // bs, st[1] // bs)
        if len(self._valid) > 4 * max(1, self.bm.block_tables.shape[0]):
            self._valid = {s.seq_id: self._valid[s.seq_id] for s in seqs if s.seq_id in self._valid}

    def _cached_rows(self, seq, first: int) -> int:
        """Context positions of ``seq`` whose rows are already in the caches when its first observed position is
        ``first``: after a prefix-cache hit, the leading hit blocks whose rows were written in full for the content
        they hold (recorded hash == the block's hash); else 0."""
        bs = self.bm.block_size
        if self.pc is None or first <= 0 or first % bs:
            return 0
        hs, bt = seq.block_hashes, seq.block_table
        n = 0
        while n < min(first // bs, len(hs), len(bt)) and self._rows_ok[bt[n]] and self._rows_hash[bt[n]] == hs[n]:
            n += 1
        return n * bs

    def _record_blocks(self, seq, start: int, end: int) -> None:
        """Blocks ``start .. end - 1`` of ``seq`` have every context row written for ``seq``'s tokens: record the
        prefix-cache hash of their content."""
        if end <= start:
            return
        hs = self.pc.hashes(seq, end)
        for i in range(start, end):
            b = seq.block_table[i]
            self._rows_hash[b], self._rows_ok[b] = hs[i], True

    def _paged_context(self, rows: np.ndarray, start: np.ndarray, anchor: np.ndarray):
        """The paged form's tables for sequences at scheduler ``rows`` [B] with anchors at positions ``start`` [B]
        (:class:`~tokenfab.models.dspark_drafter.PagedDraftContext`), staged to the device in one copy with the
        anchors [B] and positions [B]. Returns (context, anchor ids [B], start [B]) on the device."""
        from tokenfab.models.dspark_drafter import paged_context_tables
        B = len(rows)
        table, clens, qpos, src, dst, slots = paged_context_tables(
            self.bm.block_tables, rows, start, num_blocks=self.bm.num_blocks, block_size=self.bm.block_size,
            block_len=self.cfg.block_size, num_tail=self.num_tail)
        W, N = table.shape[1], slots.shape[1]
        packed = np.concatenate([table.reshape(-1), clens, qpos, src, dst, slots.reshape(-1), anchor,
                                 start]).astype(np.int64)
        dev = torch.from_numpy(packed).to(self.device)  # one host-to-device copy
        parts = dev.split([B * W, B, B, B, B, B * N, B, B])
        from tokenfab.models.dspark_drafter import PagedDraftContext
        ctx = PagedDraftContext(block_tables=parts[0].view(B, W), context_lens=parts[1], query_pos=parts[2].view(B, 1),
                                max_context=W * self.bm.block_size, tail_src=parts[3], tail_dst=parts[4], slots=parts[5])
        return ctx, parts[6], parts[7]

    # ---- proposing ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs, rows, token_ids, lengths, max_lens) -> Proposal:
        N, k = len(seqs), self.num_speculative_tokens
        start = lengths - 1  # the anchor's position = context length
        valid = np.fromiter(((st[1] if (st := self._valid.get(s.seq_id)) is not None
                              and st[0] == s.num_preemptions else -1) for s in seqs), dtype=np.int64, count=N)
        ready = valid >= start
        n = np.where(ready, np.minimum(k, np.maximum(max_lens, 0)), 0).astype(np.int64)
        if not n.any():
            return Proposal.empty(N, k)
        ri = np.nonzero(n > 0)[0]
        r_rows, r_start = rows[ri], start[ri]
        anchors = token_ids[r_rows, r_start]
        if self.graphs is not None and self.graphs.usable(len(ri)):  # a captured pass (spec_decode/dspark_graphs)
            base, anchor = self.graphs.run(self.bm.block_tables, r_rows, r_start, anchors)
        else:
            paged, anchor, start_t = self._paged_context(r_rows, r_start, anchors)
            hidden = self.drafter.block(anchor, start_t, self.caches, None, paged)
            base = self.drafter.draft_logits(hidden)[:, :k]  # drawn where they are: only the drafts come back
        sub = [seqs[i] for i in ri.tolist()]
        st = SamplingTensors.from_seqs(sub, self.vocab_size)
        d, q = sample_in_order(base, anchor, self.drafter.markov_bias, st, sub, self.generator)
        drafts = np.zeros((N, k), dtype=np.int64)
        drafts[ri] = d.cpu().numpy()  # the step's one read of the drafter's results
        q_all = None
        if q is not None:  # the draft probabilities stay on the device, where the verifier reads them
            q_all = torch.zeros(N, k, q.shape[-1], dtype=torch.float32, device=q.device)
            q_all[torch.from_numpy(ri).to(q.device)] = q
        return Proposal(drafts, n, q_all)
