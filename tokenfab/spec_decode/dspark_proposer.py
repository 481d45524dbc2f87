"""``method: "dspark"``: the block-parallel DSpark drafter on the target's tapped hidden states.

Per step and sequence: one drafter pass (:class:`tokenfab.models.dspark_drafter.DSparkDrafter`) over
``[anchor, mask x (N - 1)]`` attending to the sequence's context, then the drafts in order with the Markov bias
(:func:`sample_in_order`). Batched over sequences; the only loop runs over the k draft positions.

Context: the proposer asks the target for the hidden states after ``target_layer_ids`` at every token
(:meth:`hidden_request`, the target-hidden-state seam in ``spec_decode/proposer.py``) and, after every target forward
(:meth:`observe`), projects the context tokens' taps (fc + hidden_norm) and writes each MLA draft layer's key rows
``[c | rope(k_pe)]`` into its own paged cache, addressed by the target's block table (same block geometry as the
target's pool), so every context position is projected once. A sequence drafts only when every position before its
anchor has been observed since its last preemption (prefix-cache hits and failed steps rerun in parts leave gaps:
such a sequence decodes plainly).

Which tapped stream a K3 target gives (partial block sum or attention-residual mixture): ``speculative_config.
dspark_tap``, else the checkpoint's ``aux_hidden_stream``, else ``"partial_sum"`` (spec_decode/dspark_config.py).
The confidence head is not used: each proposal drafts min(k, what max_tokens leaves) tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from tokenfab.engine.sampler import inverse_cdf_sample
from tokenfab.engine.sequence import SequenceStatus
from tokenfab.errors import EngineConfigError, UnsupportedError
from tokenfab.spec_decode.dspark_config import check_against_target, load_dspark_config, resolve_tap
from tokenfab.spec_decode.proposer import HiddenRequest, Proposal, Proposer
from tokenfab.spec_decode.rejection_sampler import SamplingTensors, draw_uniforms, target_probs


def sample_in_order(base: torch.Tensor, anchor: torch.Tensor, bias_fn, st: SamplingTensors, seqs,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draw the drafts of a block left to right with the Markov bias of the token before each.

    Args:
        base: [B, m, V] float32 base draft logits (the drafter's lm_head output per draft slot).
        anchor: [B] int64, the token before draft 0.
        bias_fn: prev ids [B] -> [B, V] float32 bias, or a function returning None (no Markov head).
        st: the rows' sampling settings; greedy rows take argmax(base_j + bias(prev)), others draw from
            q_j = target_probs(base_j + bias(prev)) (temperature / top-k / top-p, as the verifier applies to p).
        seqs: the B sequences (per-request seeded generators for the draws); generator: the engine's.

    Returns:
        (drafts [B, m] int64, q [B, m, V] float32 or None when every row is greedy).
    """
    B, m, V = base.shape
    drafts = torch.zeros(B, m, dtype=torch.int64)
    q_all = None
    greedy = bool(st.greedy.all())
    prev = anchor
    for j in range(m):
        bias = bias_fn(prev)
        logits = base[:, j] if bias is None else base[:, j] + bias
        if greedy:
            tok = logits.argmax(dim=-1)
        else:
            q = target_probs(logits.unsqueeze(1), st).squeeze(1)
            tok = torch.where(st.greedy, logits.argmax(dim=-1), inverse_cdf_sample(q, draw_uniforms(seqs, 1,
                                                                                                   generator)[1]))
            if q_all is None:
                q_all = torch.zeros(B, m, V, dtype=torch.float32)
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
        UnsupportedError: tensor parallel (not supported yet).
        WeightLoadError: missing / unexpected / mis-shaped drafter tensors.
    """

    def __init__(self, path: str, k: int, engine, tap: str | None = None):
        from tokenfab.models.dspark_drafter import DSparkDrafter, load_dspark_weights

        if engine.tp_group is not None:  # the drafter would run rank 0's slice of the vocab-parallel embedding
            raise UnsupportedError("speculative_config method 'dspark' under tensor parallel is not supported yet; "
                                   "use tensor_parallel_size 1 or another method.")
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
        self.drafter = DSparkDrafter(cfg, target.model.embed_tokens, target.compute_logits)
        self.skipped_weights = load_dspark_weights(self.drafter, path, engine.dtype)
        self.drafter.to(engine.device)
        self.bm = engine.block_manager
        bs = self.bm.block_size
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.caches = [torch.zeros(self.bm.num_blocks, bs, width, dtype=engine.dtype, device=engine.device)
                       for _ in self.drafter.mla_layers]
        self.vocab_size = cfg.vocab_size
        self.generator = engine.generator
        self.device = engine.device
        self._valid: dict[int, list[int]] = {}  # seq_id -> [num_preemptions, context positions written from 0]

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
        lo = np.full(len(seqs), np.iinfo(np.int64).max, dtype=np.int64)
        hi = np.full(len(seqs), -1, dtype=np.int64)
        np.minimum.at(lo, r, p)
        np.maximum.at(hi, r, p)
        for b in np.nonzero(hi >= 0)[0].tolist():  # bookkeeping per observed sequence (a dict entry each)
            s = seqs[b]
            st = self._valid.get(s.seq_id)
            if st is None or st[0] != s.num_preemptions:
                st = self._valid[s.seq_id] = [s.num_preemptions, 0]
            if lo[b] <= st[1]:
                st[1] = max(st[1], int(hi[b]) + 1)
        if len(self._valid) > 4 * max(1, self.bm.block_tables.shape[0]):
            self._valid = {s.seq_id: self._valid[s.seq_id] for s in seqs if s.seq_id in self._valid}

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
        L = int(r_start.max())
        ctx_rows = ctx_valid = None
        if L > 0 and self.caches:
            pos = np.minimum(np.arange(L)[None, :], np.maximum(r_start[:, None] - 1, 0))  # [B, L], clipped pads
            slots = self._slots(np.repeat(r_rows, L).reshape(len(ri), L), pos)
            ctx_rows = [c.view(-1, c.shape[-1])[slots.reshape(-1)].view(len(ri), L, -1) for c in self.caches]
            ctx_valid = torch.from_numpy(np.arange(L)[None, :] < r_start[:, None]).to(self.device)
        anchor = torch.from_numpy(token_ids[r_rows, r_start]).to(self.device)
        hidden = self.drafter.block(anchor, torch.from_numpy(r_start).to(self.device), ctx_rows, ctx_valid)
        base = self.drafter.draft_logits(hidden)[:, :k].cpu()
        sub = [seqs[i] for i in ri.tolist()]
        st = SamplingTensors.from_seqs(sub, self.vocab_size)
        bias_fn = lambda prev: (None if self.drafter.markov_w1 is None
                                else self.drafter.markov_bias(prev.to(self.device)).cpu())
        d, q = sample_in_order(base, anchor.cpu(), bias_fn, st, sub, self.generator)
        drafts = np.zeros((N, k), dtype=np.int64)
        drafts[ri] = d.numpy()
        q_all = None
        if q is not None:
            q_all = torch.zeros(N, k, q.shape[-1], dtype=torch.float32)
            q_all[torch.from_numpy(ri)] = q
        return Proposal(drafts, n, q_all)
