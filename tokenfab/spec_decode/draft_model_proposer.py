"""A separate small draft model (``method: "draft_model"``): same vocabulary as the target, its own paged KV pool.

The draft model gets its own :class:`~tokenfab.engine.model_runner.ModelRunner` whose pool has the target's
geometry (same number of blocks, same block size), so a sequence's block table, owned by the target's block
manager, addresses both pools: draft K/V of token position t lives at the same slot as the target's. The caller
reserves the verification blocks (1 + k tokens) before :meth:`propose`, which writes draft K/V there.

Per sequence the proposer remembers how many leading positions of the draft pool are valid. A proposal first
catches the draft up to the sequence (the prompt on the first proposal, then the tokens accepted since the last
one; one forward over all rows, chunks as in chunked prefill), then runs kk - 1 one-token decode steps (the fused
CPU decode stack where the draft allows; kk: the longest draft cap this step, at most k). Drafts are the draft's
argmax for greedy rows and a draw from q (its distribution after the row's temperature / top-k / top-p) otherwise;
a seeded row's draft j takes the uniform its own stream holds for that position, read without consuming it
(rejection_sampler.DraftUniforms), so drafting never moves a seeded stream. After verification the valid prefix
becomes min(written, tokens before the first rejected draft); a preempted sequence (its blocks were freed) starts
over from 0.

Its cost for the cost rule (:meth:`DraftModelProposer.drafting_cost`, spec_decode/drafting_cost.py): the forwards
(prior: the draft/target weight-bytes ratio; then each proposal's measured seconds) and every row's catch-up beyond
the steady 1-2 tokens.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from tokenfab.errors import EngineConfigError, UnsupportedError
from tokenfab.spec_decode.drafting_cost import DraftCostModel, DraftingCost, checkpoint_bytes
from tokenfab.spec_decode.proposer import Proposal, Proposer
from tokenfab.spec_decode.rejection_sampler import DraftUniforms, SamplingTensors, draw_draft


class DraftModelProposer(Proposer):
    """Draft-model drafter.

    Args:
        path: draft checkpoint folder or ``.gguf`` file (resolved as ``LLM(model=...)`` resolves it).
        k: num_speculative_tokens.
        engine: the target LLMEngine (its config, block manager, device, dtype, generator and vocabulary).

    Raises:
        EngineConfigError: the draft's vocabulary size (or tokenizer vocabulary) differs from the target's, or its
            max_position_embeddings is below max_model_len.
        UnsupportedError: a draft with recurrent (KDA) layers.
    """

    def __init__(self, path: str, k: int, engine):
        from tokenfab.config import load_config
        from tokenfab.default_model import resolve_model
        from tokenfab.engine.engine_config import EngineConfig
        from tokenfab.engine.model_loader import load_model
        from tokenfab.engine.model_runner import ModelRunner

        self.num_speculative_tokens = k
        tgt = engine.model_config
        path = resolve_model(path, quiet=True)  # a .gguf file: itself (served packed) or its cached bf16 folder
        mc = load_config(path)
        if mc.vocab_size != tgt.vocab_size:
            raise EngineConfigError(f"speculative_config.model: the draft's vocab_size ({mc.vocab_size}) differs "
                                    f"from the target's ({tgt.vocab_size}); a draft model must share the target's "
                                    "tokenizer.")
        if mc.max_position_embeddings < engine.max_model_len:
            raise EngineConfigError(f"speculative_config.model: the draft's max_position_embeddings "
                                    f"({mc.max_position_embeddings}) is below max_model_len ({engine.max_model_len}); "
                                    "lower max_model_len.")
        dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[engine.dtype]
        dcfg = EngineConfig(model=path, dtype=dtype_name, device=str(engine.device),
                            max_model_len=engine.max_model_len, max_num_seqs=engine.config.max_num_seqs,
                            num_kv_blocks=engine.config.num_kv_blocks, block_size=engine.config.block_size,
                            enforce_eager=True, generation_config="vllm")
        loaded = load_model(dcfg, progress=False)
        if hasattr(loaded.model, "make_state_cache"):
            raise UnsupportedError("speculative_config.model: draft models with recurrent (KDA) layers are not "
                                   "supported yet; use an attention-only draft.")
        tt, dt = engine.tokenizer, loaded.tokenizer
        if tt is not None and dt is not None and hasattr(tt, "get_vocab") and hasattr(dt, "get_vocab"):
            if tt.get_vocab() != dt.get_vocab():
                raise EngineConfigError("speculative_config.model: the draft's tokenizer vocabulary differs from "
                                        "the target's; a draft model must share the target's tokenizer.")
        self.model = loaded.model
        self.bm = engine.block_manager
        self.runner = ModelRunner(loaded.model, self.bm, engine.config.max_num_seqs, engine.max_model_len,
                                  loaded.device, loaded.dtype, None, enforce_eager=True)
        self.vocab_size = tgt.vocab_size
        self.generator = engine.generator
        self._valid: dict[int, list[int]] = {}  # seq_id -> [num_preemptions, valid prefix, written, length]
        spec_cfg = getattr(engine.config, "speculative_config", None)
        r = getattr(spec_cfg, "verify_token_cost", 0.035)
        tgt_bytes = checkpoint_bytes(resolve_model(engine.config.model, quiet=True))
        self.cost_model = DraftCostModel(checkpoint_bytes(path) / tgt_bytes if tgt_bytes > 0 else 1.0, r)

    def preallocates_kv(self) -> bool:
        return True

    def _valid_prefix(self, seqs, lengths) -> np.ndarray:
        """[N] int64: how many leading positions of each row's draft K/V are valid (< its length)."""
        valid = np.empty(len(seqs), dtype=np.int64)
        for i, s in enumerate(seqs):
            st = self._valid.get(s.seq_id)
            valid[i] = st[1] if st is not None and st[0] == s.num_preemptions else 0
        return np.minimum(valid, lengths - 1)

    def drafting_cost(self, seqs, lengths, batch_size, plain_step_s) -> DraftingCost:
        """The draft's forwards (prior: the weight-bytes ratio; then measured) and each row's catch-up beyond 2
        tokens (its prompt the first time it drafts, the plain steps' tokens since), drafting_cost.py."""
        lengths = np.asarray(lengths, dtype=np.int64)
        greedy = all(s.params.temperature < 1e-5 for s in seqs)
        extra = np.maximum(lengths - self._valid_prefix(seqs, lengths) - 2, 0)
        return self.cost_model.estimate(len(seqs), batch_size, greedy, extra, plain_step_s)

    def last_catch_up_s(self) -> float:
        return self.cost_model.last_catch_up_s

    def propose(self, seqs, rows, token_ids, lengths, max_lens) -> Proposal:
        N, k = len(seqs), self.num_speculative_tokens
        kk = int(np.clip(np.max(max_lens), 1, k)) if N else 1  # drafting forwards: as many as the longest cap
        t_first = time.perf_counter()
        valid = self._valid_prefix(seqs, lengths)
        num_new = lengths - valid
        order = np.argsort(num_new != 1, kind="stable")  # one-token rows first (the runner's decode group)
        inv = np.empty(N, dtype=np.int64)
        inv[order] = np.arange(N)
        o_rows, o_new, o_valid = rows[order], num_new[order], valid[order]
        T = int(o_new.sum())
        starts = np.cumsum(o_new) - o_new
        req_idx = np.repeat(np.arange(N), o_new)
        positions = o_valid[req_idx] + np.arange(T) - starts[req_idx]
        bt = self.bm.block_tables[o_rows]
        d = int((o_new == 1).sum())
        ids = token_ids[o_rows[req_idx], positions]
        st = SamplingTensors.from_seqs(seqs, self.vocab_size)
        stack = self.runner.cpu_decode_stack
        # all rows greedy and the LM head inside the fused stack: forward, head and argmax in one C++ call per
        # draft token (run_sample at temperature 0, as the target's plain decode steps draw); no q is needed
        greedy = stack is not None and stack.vocab_size == self.vocab_size and bool(st.greedy.all())

        def _zeros(n):
            return torch.zeros(n, dtype=torch.float32), torch.zeros(n)

        tok_next = None
        if stack is not None and int(o_new.max()) <= k + 1:
            # short catch-ups (the 2 tokens after a fully accepted proposal): one-token rows through the fused
            # decode stack, as fused_verify.py verifies, instead of a module-path prefill (~2.4x a decode step)
            slots = self.runner._slots(bt, req_idx, positions)
            last = torch.from_numpy(starts + o_new - 1)
            with torch.inference_mode():
                if greedy:
                    tok_next = stack.run_sample(ids, positions, slots, bt[req_idx], positions + 1,
                                                *_zeros(T))[last][inv]
                else:
                    hidden = stack.run(ids, positions, slots, bt[req_idx], positions + 1)
                    logits = self.model.compute_logits(hidden[last]).float().cpu()[inv]
        else:
            logits = self.runner.forward(d, o_new, o_valid, bt, ids, starts + o_new - 1,
                                         (T, starts, req_idx, positions))[inv]
            if greedy:
                tok_next = logits.argmax(dim=-1)
        t_rest = time.perf_counter()
        bt = self.bm.block_tables[rows]
        drafts = torch.zeros(N, k, dtype=torch.int64)
        q_all = None
        ones = np.ones(N, dtype=np.int64)
        uniforms = None if greedy else DraftUniforms(seqs, self.generator, kk)
        for j in range(kk):
            tok, q = (tok_next, None) if greedy else draw_draft(logits, st, uniforms, j)
            drafts[:, j] = tok
            if q is not None:
                if q_all is None:
                    q_all = torch.zeros(N, k, q.shape[-1], dtype=torch.float32)
                q_all[:, j] = q
            if j == kk - 1:
                break
            if greedy:
                with torch.inference_mode():
                    tok_next = stack.run_sample(np.ascontiguousarray(tok.numpy()), lengths + j, None, bt,
                                                lengths + j + 1, *_zeros(N))
            else:
                logits = self.runner.forward(N, ones, lengths + j, bt, tok.numpy(), np.arange(N))
        t_end = time.perf_counter()
        self.cost_model.record(N, bool(st.greedy.all()), T, t_rest - t_first, t_end - t_rest, kk)
        for i, s in enumerate(seqs):
            self._valid[s.seq_id] = [s.num_preemptions, int(lengths[i]), int(lengths[i] + kk - 1), int(lengths[i])]
        if len(self._valid) > 4 * max(1, self.runner.token_ids.shape[0]):
            self._valid = {s.seq_id: self._valid[s.seq_id] for s in seqs}
        n = np.minimum(kk, np.maximum(max_lens, 0)).astype(np.int64)
        return Proposal(drafts.numpy(), n, q_all)

    def on_verified(self, seqs, num_accepted) -> None:
        for s, m in zip(seqs, num_accepted):
            st = self._valid.get(s.seq_id)
            if st is not None:
                st[1] = min(st[2], st[3] + int(m))
