"""MTP drafting (``method: "mtp"``): the checkpoint's next-token-prediction layers (tokenfab/models/deepseek_mtp.py)
drafting from the target's hidden states.

KV: each MTP layer has its own paged latent pool with the target's geometry (same number of blocks, same block
size), so the target's block tables address it: the MTP K/V of position t lives at t's slot (as the draft-model
proposer's pool does). MTP position t holds (token t + 1, target hidden state at t) and predicts token t + 2.

Keeping up (:meth:`MTPProposer.observe`, the target-hidden-state seam of proposer.py): after every target forward,
the MTP layers run over the positions it computed that are final context (``position <= num_tokens - 2``: the next
token is known), with the target's final post-norm hidden states and the next tokens as inputs, writing their K/V.
Positions of rejected drafts are skipped (rewritten when they become context); positions the target did not compute
(prefix-cache hits) keep whatever the pool holds there, which can only lower acceptance. Per scheduler row the
proposer keeps layer 0's output at the row's last observed position and that position.

Drafting (:meth:`MTPProposer.propose`), for a row with L tokens whose last observed position is L - 2: draft 1 comes
from the stored output at L - 2 (``head(shared_head.norm(y))``); draft j + 1 from MTP layer ``j % n`` (n =
``num_nextn_predict_layers``, vLLM's choice) run at position L - 2 + j on (draft j, the previous step's output y):
k - 1 one-token forwards over all rows, writing K/V at positions L - 1 .. L + k - 3 of the blocks the caller reserved
(those of rejected drafts are overwritten later). With n > 1 every layer sees the same inputs at every position:
the context from the target's hidden states in :meth:`observe`, each chained position from the drafting layer's
previous output (n forwards per chained draft), so each layer's K/V is complete (vLLM writes layer i's K/V only
at the chained positions it drafts). Tokens: argmax for greedy rows, else a draw from q (the row's temperature /
top-k / top-p; ``rejection_sampler.draw_draft``, on the device); a seeded row's draft j takes the uniform its own stream holds
for that position without consuming it (rejection_sampler.DraftUniforms). Nothing to roll back after verification:
the next :meth:`observe` writes the accepted positions.

Tensor parallel: the MTP layers run unsharded on rank 0, the engine's process, between target steps; the workers
take no part (no step message of its own). Their inputs there are complete: the captured final hidden states are
the full [T, H] tensors (every decoder layer all-reduces, so the stream after the final norm is replicated on every
rank; verification under tensor parallel always takes the module path, never the fused CPU decode stack). The
target's embedding and LM head are vocab-parallel shards whose forward is a collective, so layers without their own
copy use full copies read from the checkpoint on rank 0 (:class:`~tokenfab.spec_decode.target_vocab.TargetVocab`).
Extra memory on rank 0: the MTP layers' full weights (as at one device; DeepSeek-V3's one layer is ~14 B parameters,
its own embedding and head copies included, so no TargetVocab is loaded for it), plus, for a checkpoint whose MTP
layers share the target's tables, V x H per shared table (DeepSeek-V3 bf16: 1.85 GB each), plus the MTP KV pool
(as at one device: num_kv_blocks x block_size x (kv_lora_rank + qk_rope_head_dim) per MTP layer).
"""
from __future__ import annotations

import numpy as np
import torch

from tokenfab.engine.sequence import SequenceStatus
from tokenfab.layers.attention_metadata import AttentionMetadata
from tokenfab.spec_decode.proposer import CapturedHidden, HiddenRequest, Proposal, Proposer
from tokenfab.spec_decode.rejection_sampler import DraftUniforms, SamplingTensors, draw_draft


class MTPProposer(Proposer):
    """MTP drafter for a DeepSeek-V3 / Kimi-K2 target.

    Args:
        k: num_speculative_tokens.
        engine: the target LLMEngine (its checkpoint folder, model, block manager, runner and generator).

    Raises:
        EngineConfigError: not a DeepSeek-V3 / Kimi-K2 checkpoint, or one without MTP layers (models/deepseek_mtp.py).
        UnsupportedError / WeightLoadError: tensor parallel with a quantized or missing target embedding / LM head
            where an MTP layer needs it (target_vocab.py).
    """


    def __init__(self, k: int, engine):
        from tokenfab.engine.input_staging import InputStager
        from tokenfab.engine.model_runner import ModelRunner
        from tokenfab.models.deepseek_mtp import load_mtp

        from tokenfab.spec_decode.target_vocab import TargetVocab

        self.num_speculative_tokens = k
        runner = engine.runner
        self.mtp = load_mtp(engine.config.model, runner.model, runner.device, engine.dtype,
                            vocab=lambda embed, head: TargetVocab(engine, embed, head))
        self.bm = engine.block_manager
        self.block_size = self.bm.block_size
        self.device = runner.device
        self.kv = self.mtp.make_kv_cache(self.bm.num_blocks, self.block_size, engine.dtype, self.device)
        self._group = ModelRunner._group.__get__(self)  # the runner's attention-group builder (block_size, device)
        self._group_arrays = ModelRunner._group_arrays.__get__(self)
        self.stager = InputStager(self.device)
        self.token_ids = runner.token_ids
        rows = runner.token_ids.shape[0]
        self.last_h = torch.zeros(rows, self.mtp.cfg.hidden_size, dtype=engine.dtype, device=self.device)
        self.last_pos = np.full(rows, -1, dtype=np.int64)  # last observed position per row (-1: none)
        self.owner = np.full(rows, -1, dtype=np.int64)  # seq_id the row's state belongs to
        self.vocab_size = engine.model_config.vocab_size
        self.generator = engine.generator

    def hidden_request(self) -> HiddenRequest:
        return HiddenRequest(final=True)

    def preallocates_kv(self) -> bool:
        return True  # the chained draft forwards write K/V at positions past the sequence

    # ------------------------------------------------------------------------------------------- the MTP forward
    def _run(self, i: int, input_ids: np.ndarray, positions: np.ndarray, prev: torch.Tensor, rows: np.ndarray,
             num_new: np.ndarray, num_computed: np.ndarray) -> torch.Tensor:
        """MTP layer ``i`` over a flat batch: B sequences at scheduler ``rows`` [B] with ``num_new`` [B] tokens
        after ``num_computed`` [B] positions, token-major ``input_ids`` / ``positions`` [T] int64, ``prev``
        [T, hidden]. Returns the layer outputs [T, hidden]."""
        T, B = len(positions), len(num_new)
        starts = np.cumsum(num_new) - num_new
        req_idx = np.repeat(np.arange(B), num_new)
        bt = self.bm.block_tables[rows]
        bs = self.block_size
        slots = bt[req_idx, positions // bs] * bs + positions % bs
        one = bool((num_new == 1).all())  # all one-token rows: the decode group (fused MLA decode on CPU bf16)
        group = self._group(bt, starts, num_new, num_computed, T)
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(slots).to(self.device),
                                 decode=group if one else None, prefill=None if one else group, num_tokens=T,
                                 block_size=bs)
        return self.mtp(i, torch.from_numpy(input_ids).to(self.device), torch.from_numpy(positions).to(self.device),
                        prev, self.kv[i], meta)

    # ------------------------------------------------------------------------------------------------- the seam
    @torch.inference_mode()
    def observe(self, captured: CapturedHidden) -> None:
        seqs = captured.seqs
        ntok = np.fromiter((s.num_tokens if s.status == SequenceStatus.RUNNING else -1 for s in seqs),
                           dtype=np.int64, count=len(seqs))
        keep = captured.positions <= ntok[captured.req_idx] - 2
        if not keep.any():
            return
        ti = np.nonzero(keep)[0]
        req, pos = captured.req_idx[ti], captured.positions[ti]  # per sequence a contiguous, ascending run
        counts = np.bincount(req, minlength=len(seqs))
        sel = np.nonzero(counts)[0]
        num_new = counts[sel]
        first = np.cumsum(num_new) - num_new
        rows = captured.rows[sel]
        ids = self.token_ids[captured.rows[req], pos + 1]
        prev = captured.hidden[torch.from_numpy(ti).to(captured.hidden.device)]
        out = None
        for i in range(self.mtp.num_layers):
            y = self._run(i, ids, pos, prev, rows, num_new, pos[first])
            out = y if i == 0 else out
        last = first + num_new - 1
        r = torch.from_numpy(rows).to(self.device)
        self.last_h[r] = out[torch.from_numpy(last).to(self.device)].to(self.last_h.dtype)
        self.last_pos[rows] = pos[last]
        self.owner[rows] = np.fromiter((seqs[j].seq_id for j in sel.tolist()), dtype=np.int64, count=len(sel))

    # -------------------------------------------------------------------------------------------------- drafting
    @torch.inference_mode()
    def propose(self, seqs, rows, token_ids, lengths, max_lens) -> Proposal:
        N, k = len(seqs), self.num_speculative_tokens
        drafts = np.zeros((N, k), dtype=np.int64)
        n = np.zeros(N, dtype=np.int64)
        sid = np.fromiter((s.seq_id for s in seqs), dtype=np.int64, count=N)
        ready = (self.owner[rows] == sid) & (self.last_pos[rows] == lengths - 2)
        idx = np.nonzero(ready)[0]
        if len(idx) == 0:
            return Proposal(drafts, n, None)
        sub = [seqs[i] for i in idx.tolist()]
        r, L = rows[idx], lengths[idx]
        M = len(idx)
        st = SamplingTensors.from_seqs(sub, self.vocab_size)
        h = self.last_h[torch.from_numpy(r).to(self.device)]
        logits = self.mtp.compute_logits(0, h)  # drawn where they are: only the drafts come back
        ones = np.ones(M, dtype=np.int64)
        q_all = None
        uniforms = None if bool(st.greedy.all()) else DraftUniforms(sub, self.generator, k)
        for j in range(k):
            tok, q = draw_draft(logits, st, uniforms, j)
            tok = tok.cpu().numpy()  # the next MTP step's input ids: one small read per draft
            drafts[idx, j] = tok
            if q is not None:  # the draft probabilities stay on the device, where the verifier reads them
                if q_all is None:
                    q_all = torch.zeros(N, k, q.shape[-1], dtype=torch.float32, device=q.device)
                q_all[torch.from_numpy(idx).to(q.device), j] = q
            if j == k - 1:
                break
            layer = (j + 1) % self.mtp.num_layers
            pos = L - 1 + j  # draft j + 1 is token L + j; its MTP position is L - 1 + j
            ys = [self._run(i, tok, pos, h, r, ones, pos) for i in range(self.mtp.num_layers)]
            h = ys[layer]  # every layer writes this position from the same inputs; the drafting one's output goes on
            logits = self.mtp.compute_logits(layer, h)
        n[idx] = np.minimum(k, np.maximum(max_lens[idx], 0))
        return Proposal(drafts, n, q_all)
