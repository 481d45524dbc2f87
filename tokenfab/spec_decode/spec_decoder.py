"""The speculative step: propose, verify inside the continuous batch, accept, roll back.

One step (:meth:`SpecDecoder.step`, called by ``LLMEngine.step`` when speculation is configured):

1. Rows: running sequences in decode state (their last sampled token not yet in the KV cache) that the policy
   lets draft (policy.py) and whose sampling the verifier supports (:func:`row_supports_speculation`).
2. Propose: k drafts per row (a :class:`~tokenfab.spec_decode.proposer.Proposer`). The drafts are appended to the
   sequence's token list and to the runner's token array, so the unchanged scheduler schedules the row as a chunk
   of 1 + k tokens over its paged context (chunked prefill's path: blocks allocated, preemption as usual) and the
   runner reads them as input ids. Rows not scheduled or preempted lose their drafts at once.
3. Verify: the runner returns logits at every token of the speculative rows (``ScheduledBatch.spec_lens``,
   ``StepOutput.spec_logits``); other rows sample as always. The rejection sampler accepts a prefix of each row's
   drafts and adds one recovered or bonus token.
4. Roll back and emit: drafts leave the token list; ``num_computed_tokens`` goes back to the last sampled token and
   the emitted tokens are fed through the engine's normal output processing one position at a time (stop strings,
   EOS, max_tokens, stats exactly as for plain decoding; a stop inside the accepted run drops the rest).
   K/V rows written for rejected drafts are simply overwritten later; blocks past the new length go back to the
   free list (BlockManager.trim).

Metrics (engine stats, vLLM's counters): ``spec_decode_num_drafts`` (rows verified with >= 1 draft),
``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
``spec_decode_num_accepted_tokens_per_pos`` (a list: position j counts rows that accepted more than j drafts).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tokenfab.engine.input_staging import to_device
from tokenfab.engine.model_runner import StepOutput
from tokenfab.engine.sampler import SamplerOutput, token_logprobs
from tokenfab.engine.scheduler import ScheduledBatch
from tokenfab.engine.sequence import SequenceStatus
from tokenfab.spec_decode.config import SpeculativeConfig
from tokenfab.spec_decode.fused_verify import fused_verify_logits
from tokenfab.spec_decode.policy import SpecPolicy
from tokenfab.spec_decode.proposer import Proposer
from tokenfab.spec_decode.step_timing import StepTiming, bucket
from tokenfab.spec_decode.rejection_sampler import SamplingTensors, VerifyResult, VerifyUniforms, rejection_sample

logger = logging.getLogger("tokenfab")

# SamplingParams fields whose processing verification does not reproduce, with their "off" values: rows using any
# of them are not speculated (they decode plainly, exactly as without it). Penalties, min_p, logit_bias,
# allowed_token_ids and bad_words are applied per verified position (LogitsProcessorState.apply_verify).
_PROCESSOR_FIELDS = {"structured_outputs": None}  # grammar rows decode plainly: their matcher sees each token once


def row_supports_speculation(seq) -> bool:
    """True when the verifier reproduces ``seq``'s sampling exactly: no structured output (the logits processors
    and the min_tokens mask are applied per verified position; logprobs come from each position's raw logits)."""
    p = seq.params
    for name, off in _PROCESSOR_FIELDS.items():
        v = getattr(p, name, off)
        if v != off and not (off is None and not v):
            return False
    return True


def build_proposer(cfg: SpeculativeConfig, engine) -> Proposer:
    """The proposer ``cfg.method`` names: ``ngram`` (prompt lookup), ``dspark`` (block drafter on the target's
    layer taps), ``mtp`` (the checkpoint's multi-token-prediction layers) or ``draft_model`` (a smaller model of the
    same vocabulary). ``engine`` is the target's LLMEngine, whose model, KV pool and config the drafters share."""
    if cfg.method == "ngram":
        from tokenfab.spec_decode.ngram_proposer import NgramProposer
        return NgramProposer(cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "dspark":
        from tokenfab.spec_decode.dspark_proposer import DSparkProposer
        return DSparkProposer(cfg.model, cfg.num_speculative_tokens, engine, cfg.dspark_tap)
    if cfg.method == "mtp":
        from tokenfab.spec_decode.mtp_proposer import MTPProposer
        return MTPProposer(cfg.num_speculative_tokens, engine)
    from tokenfab.spec_decode.draft_model_proposer import DraftModelProposer
    return DraftModelProposer(cfg.model, cfg.num_speculative_tokens, engine)


class SpecDecoder:
    """Speculative decoding for one LLMEngine (see the module docstring).

    Hybrid models (KDA layers): after acceptance each verification row's recurrent state is written up to its
    last accepted token (``ModelRunner.commit_state``, engine/state_commit.py).
    """

    def __init__(self, engine, cfg: SpeculativeConfig, proposer: Proposer | None = None):
        self.engine = engine
        self.cfg = cfg
        self.k = cfg.num_speculative_tokens
        self.proposer = proposer if proposer is not None else build_proposer(cfg, engine)
        self.hidden_request = self.proposer.hidden_request()  # the target-hidden-state seam (proposer.py)
        # hybrid models: verification rows from the decode-graph buffers (cuda_graph_runner.py); then the taps,
        # which capture the graphs again with the hooks' ops
        engine.runner.enable_verify_graphs(self.k)
        engine.runner.set_hidden_capture(self.hidden_request)
        self.policy = SpecPolicy(cfg)
        engine.stats.update({"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                             "spec_decode_num_accepted_tokens": 0,
                             "spec_decode_num_accepted_tokens_per_pos": [0] * self.k})
        self._plain_now = False
        self.num_fused_steps = 0  # verification steps run through the fused CPU decode stack (fused_verify.py)
        always = (cfg.verify_token_cost == 0.0 and cfg.verify_step_overhead == 0.0 and cfg.random_row_cost == 0.0
                  and cfg.min_acceptance_rate == 0.0)  # the always-draft mode stays clock-independent
        self.timing = StepTiming(cfg.probe_interval) if cfg.timed_switch_off and not always else None
        self._t0 = None

    def active(self) -> bool:
        """False while the engine runs a plain step on this decoder's behalf."""
        return not self._plain_now

    def observe(self) -> None:
        """Hand the last target forward's hidden states (``runner.captured``) to the proposer, once; called after
        each step's outputs are processed (LLMEngine.step, :meth:`step`). No-op for proposers that want none."""
        r = self.engine.runner
        cap, r.captured = r.captured, None
        if cap is not None and self.hidden_request is not None:
            self.proposer.observe(cap)

    def _plain(self):
        self._plain_now = True
        sch = self.engine.scheduler
        timed = (self.timing is not None and len(sch.running) > 0
                 and all(s.num_tokens - s.num_computed_tokens == 1 for s in sch.running))
        B = len(sch.running)
        before = {id(s) for s in sch.running} if timed else None
        t0 = time.perf_counter()
        try:
            out = self.engine.step()
        finally:
            self._plain_now = False
        if timed and all(id(s) in before for s in sch.running):  # a decode-only step: no request was admitted
            self.timing.record_plain(B, time.perf_counter() - t0)
        return out

    # ------------------------------------------------------------------------------------------------ the step
    def step(self):
        eng = self.engine
        sch = eng.scheduler
        if not self.policy.batch_allows(len(sch.running)):
            return self._plain()
        cand = [s for s in sch.running if s.num_tokens - s.num_computed_tokens == 1 and row_supports_speculation(s)]
        if not cand:
            return self._plain()
        if self.timing is not None and self.timing.wants_plain(len(sch.running)):  # step_timing.py: by the clock
            return self._plain()
        t_start, B_start, tok_start = time.perf_counter(), len(sch.running), eng.stats["generation_tokens_total"]
        lengths = np.fromiter((s.num_tokens for s in cand), dtype=np.int64, count=len(cand))
        big = np.iinfo(np.int64).max // 4
        left = np.fromiter((s.params.max_tokens - s.num_output_tokens if s.params.max_tokens is not None else big
                            for s in cand), dtype=np.int64, count=len(cand))
        max_lens = np.minimum(np.minimum(left - 1, eng.max_model_len - lengths - 1), self.k)
        B = len(sch.running)  # the proposer's own cost in plain steps (drafting_cost.py), measured with the clock
        cost_fn = getattr(self.proposer, "drafting_cost", None)  # duck-typed proposers without it are free
        cost = None if cost_fn is None else cost_fn(cand, lengths, B, None if self.timing is None
                                                    else self.timing.plain.get(bucket(B)))
        remaining = np.minimum(left, eng.max_model_len - lengths)
        max_lens = np.minimum(max_lens, self.policy.draft_caps(cand, B, cost, remaining))  # policy.py
        allow = max_lens > 0
        if not allow.any():
            return self._plain()
        if self.proposer.preallocates_kv():  # the draft writes K/V into the verification blocks: reserve them
            for i in np.nonzero(allow)[0].tolist():
                if eng.block_manager.can_allocate(cand[i], 1 + self.k):
                    eng.block_manager.allocate(cand[i], 1 + self.k)
                else:
                    allow[i] = False
            if not allow.any():
                return self._plain()
        sel = np.nonzero(allow)[0]
        seqs = [cand[i] for i in sel.tolist()]
        rows = np.fromiter((s.row for s in seqs), dtype=np.int64, count=len(seqs))
        prop = self.proposer.propose(seqs, rows, eng.runner.token_ids, lengths[sel], max_lens[sel])
        n = np.minimum(prop.draft_lens, max_lens[sel])
        drafted = {}  # id(seq) -> (proposal row, drafts appended)
        tok_arr = eng.runner.token_ids
        for j in np.nonzero(n > 0)[0].tolist():
            s, c = seqs[j], int(n[j])
            d = prop.draft_ids[j, :c]
            tok_arr[s.row, s.num_tokens:s.num_tokens + c] = d
            s.token_ids.extend(d.tolist())
            drafted[id(s)] = (j, c)
        if not drafted:
            self.proposer.on_verified(seqs, np.zeros(len(seqs), dtype=np.int64))
            self._trim(seqs)
            return self._plain()
        batch = sch.schedule()
        spec_lens = np.zeros(len(batch.seqs), dtype=np.int64)
        in_batch = set()
        for i, s in enumerate(batch.seqs):
            e = drafted.get(id(s))
            if e is not None and s.status == SequenceStatus.RUNNING:
                spec_lens[i] = e[1]
                in_batch.add(id(s))
        for s in seqs:  # drafts of rows that did not get scheduled (budget, preemption) go now
            if id(s) in drafted and id(s) not in in_batch:
                del s.token_ids[s.num_tokens - drafted[id(s)][1]:]
        if not batch.seqs:
            self.proposer.on_verified(seqs, np.zeros(len(seqs), dtype=np.int64))
            return []
        batch.spec_lens = spec_lens if spec_lens.any() else None
        now = time.monotonic()
        for s in batch.admitted:
            if s.first_scheduled_time is None:
                s.first_scheduled_time = now
        fused = self._can_fuse(batch, spec_lens)
        try:
            eng.runner.admit(batch.admitted)
            if fused:  # every row a decode row: verify through the fused decode stack (fused_verify.py)
                out = StepOutput(np.zeros(0, dtype=np.int64), None, None, fused_verify_logits(eng.runner, batch))
                self.num_fused_steps += 1
            else:
                out = (eng.runner.execute(batch) if eng.tp_group is None
                       else eng.tp_group.execute(eng.runner, batch))
                if out.sampler_output is not None:  # the other rows' ids, drawn on a GPU (a pinned buffer)
                    out.sampler_output.wait()
        except Exception:  # roll back the drafts and let the plain step (with its failure isolation) rerun it
            if eng.runner.has_state and eng.health_error() is None:  # KDA state of the verification rows: as before
                si = np.nonzero(spec_lens)[0]
                eng.runner.commit_state(batch.rows[si], np.zeros(len(si), dtype=np.int64))
            self._strip(batch, spec_lens)
            self.proposer.on_verified(seqs, np.zeros(len(seqs), dtype=np.int64))
            logger.warning("a speculative step failed; rerunning it without speculation", exc_info=True)
            return self._plain()
        verify = np.ones(len(batch.seqs), dtype=bool) if fused else spec_lens > 0
        outputs = self._accept(batch, out, spec_lens, verify, seqs, prop, drafted)
        self.observe()
        if self.timing is not None:  # a draft's one-time catch-up is the cost rule's to charge (policy.py rule 3)
            catch_fn = getattr(self.proposer, "last_catch_up_s", None)
            catch = catch_fn() if catch_fn is not None else 0.0
            self.timing.record_spec(B_start, time.perf_counter() - t_start - catch,
                                    eng.stats["generation_tokens_total"] - tok_start)
        return outputs

    def _can_fuse(self, batch: ScheduledBatch, spec_lens: np.ndarray) -> bool:
        """True when the whole batch can verify through the fused CPU decode stack: the model has one, one device,
        and every row is a decode row (plain, or verifying all its drafts) the rejection sampler samples exactly."""
        r = self.engine.runner
        if r.cpu_decode_stack is None or self.engine.tp_group is not None or batch.admitted:
            return False
        if self.hidden_request is not None and self.hidden_request.layer_ids:  # layer taps: the module path
            return False
        if not np.array_equal(batch.num_new, spec_lens + 1):
            return False
        return all(s.status == SequenceStatus.RUNNING and row_supports_speculation(s) for s in batch.seqs)

    def _trim(self, seqs) -> None:
        """Give back blocks past each running sequence's tokens (reserved for drafts that were rejected)."""
        bm = self.engine.block_manager
        for s in seqs:
            if s.status == SequenceStatus.RUNNING:
                bm.trim(s, s.num_tokens)

    @staticmethod
    def _strip(batch: ScheduledBatch, spec_lens: np.ndarray) -> None:
        for i in np.nonzero(spec_lens)[0].tolist():
            s = batch.seqs[i]
            del s.token_ids[int(batch.num_computed[i]) + 1:]

    def _accept(self, batch, out: StepOutput, spec_lens, verify, seqs, prop, drafted):
        """Verify the rows marked in ``verify`` (``out.spec_logits`` holds logits at each of their tokens; rows
        without drafts sample their one token as the plain sampler would), process the other rows as a plain step,
        then emit, roll back and count."""
        eng = self.engine
        si = np.nonzero(verify)[0]
        if len(si) == 0:
            self.proposer.on_verified(seqs, np.zeros(len(seqs), dtype=np.int64))
            return eng._process(batch, out)
        spec_seqs = [batch.seqs[i] for i in si.tolist()]
        n_new = batch.num_new[si]
        k_eff = np.minimum(spec_lens[si], n_new - 1)
        K1 = int(n_new.max())
        flat = out.spec_logits  # [sum(n_new), V], rows in batch order; on the GPU where the runner draws there
        V, dev = flat.shape[-1], flat.device
        put = lambda t: to_device(t, dev)  # noqa: E731
        pos_r, pos_c = np.nonzero(np.arange(K1)[None, :] < n_new[:, None])  # row-major: flat's order
        logits = torch.zeros(len(si), K1, V, dtype=flat.dtype, device=dev)
        logits[put(torch.from_numpy(pos_r)), put(torch.from_numpy(pos_c))] = flat
        prow = np.fromiter((drafted[id(s)][0] if id(s) in drafted else -1 for s in spec_seqs), dtype=np.int64,
                           count=len(si))
        has = torch.from_numpy(prow >= 0)
        pr = np.maximum(prow, 0)
        draft_ids = torch.from_numpy(np.ascontiguousarray(prop.draft_ids[pr, :K1 - 1]))
        q = None
        if prop.draft_probs is not None:  # rows without drafts never read q (k_eff 0)
            dp = prop.draft_probs
            q = dp[torch.from_numpy(pr).to(dp.device), :K1 - 1] * has.to(dp.device)[:, None, None]
        st = SamplingTensors.from_seqs(spec_seqs, V)
        procs = eng.runner.sampler.processors
        want_lp = [s.params.logprobs for s in spec_seqs if s.params.logprobs is not None]
        raw = logits  # logprobs come from the model's logits, before any processor (as the plain sampler's)
        active = procs is not None and procs.any_active(batch.rows[si])
        below = eng.runner._min_tokens_rows(spec_seqs)
        if want_lp and (active or below):
            logits = logits.clone()
        for t in below:  # min_tokens: EOS and stop tokens forbidden at positions that would still be below it
            p = spec_seqs[t].params
            ids = list(p.stop_token_ids) + ([] if p.ignore_eos else eng.runner.eos_ids)
            if ids:
                logits[t, :p.min_tokens - spec_seqs[t].num_output_tokens, ids] = float("-inf")
        if active:  # penalties, masks, bias, min_p per position
            logits = procs.apply_verify(logits, batch.rows[si], batch.num_computed[si] + 1, draft_ids.numpy(),
                                        st.temperatures)
        if bool(st.greedy.all()):
            u = VerifyUniforms(torch.zeros(len(si), K1 - 1), torch.zeros(len(si)), None, None)
        else:  # seeded rows: sampled match on their own streams, advanced by the tokens emitted (rejection_sampler)
            u = VerifyUniforms.draw(spec_seqs, K1, eng.generator, k_eff)
        res = rejection_sample(logits, draft_ids, torch.from_numpy(k_eff), q, st, u.u_accept, u.u_final,
                               u.match_rows, u.u_match)
        res = VerifyResult(res.token_ids.cpu(), res.num_accepted.cpu())  # the step's one device read
        u.advance(spec_seqs, res.num_emitted)
        acc = res.num_accepted.numpy()
        toks = res.token_ids.numpy()
        if eng.runner.has_state:  # KDA state: written up to the last accepted token (engine/state_commit.py)
            eng.runner.commit_state(batch.rows[si], acc + 1)
        self._strip(batch, spec_lens)
        outputs = {o.request_id: o for o in eng._process(batch, out)}  # the other rows, as a plain step
        for i, s in zip(si.tolist(), spec_seqs):
            s.num_computed_tokens = int(batch.num_computed[i])  # back to the last sampled token
        emit = acc + 1
        lp_all = None
        if want_lp:  # every emitted token's logprob and the top ones at its position, from the raw logits: one read
            et, ej = np.nonzero(np.arange(K1)[None, :] < emit[:, None])  # (row, position) pairs, row-major
            logp = torch.log_softmax(raw[put(torch.from_numpy(et)), put(torch.from_numpy(ej))], dim=-1)
            lp = token_logprobs(logp, put(torch.from_numpy(np.ascontiguousarray(toks[et, ej]))), max(want_lp),
                                eng.runner.batch_invariant)
            lp_all = [None if t is None else t.cpu() for t in lp]  # chosen, ranks, top ids, top values
            first = np.cumsum(emit) - emit  # row t's pairs start here
        for j in range(int(emit.max())):
            live = [t for t in range(len(si)) if emit[t] > j and not spec_seqs[t].is_finished]
            if not live:
                break
            lv = np.asarray(live, dtype=np.int64)
            lseqs = [spec_seqs[t] for t in live]
            sub = ScheduledBatch(seqs=lseqs, num_decodes=len(lseqs), rows=batch.rows[si[lv]],
                                 num_new=np.ones(len(lv), dtype=np.int64),
                                 num_computed=np.fromiter((s.num_computed_tokens for s in lseqs), dtype=np.int64,
                                                          count=len(lseqs)))
            tok_j = torch.from_numpy(np.ascontiguousarray(toks[lv, j]))
            so = SamplerOutput(tok_j, None, None, None)
            if lp_all is not None:
                sel = torch.from_numpy(first[lv] + j)
                chosen, ranks, top_ids, top_vals = (None if t is None else t[sel] for t in lp_all)
                so = SamplerOutput(tok_j, chosen, top_ids, top_vals, ranks)
            for o in eng._process(sub, StepOutput(np.arange(len(lv)), so, None)):
                outputs[o.request_id] = o
        self._trim(spec_seqs)
        if self.proposer.preallocates_kv():
            self._trim(seqs)
        st_ = eng.stats
        st_["spec_decode_num_drafts"] += int((k_eff > 0).sum())
        st_["spec_decode_num_draft_tokens"] += int(k_eff.sum())
        st_["spec_decode_num_accepted_tokens"] += int(acc.sum())
        # a new list each step: published stats snapshots (server thread) keep the list they were given
        st_["spec_decode_num_accepted_tokens_per_pos"] = [
            c + int((acc > j).sum()) for j, c in enumerate(st_["spec_decode_num_accepted_tokens_per_pos"])]
        self.policy.update(spec_seqs, k_eff.tolist(), acc.tolist())
        acc_by_seq = {id(s): int(a) for s, a in zip(spec_seqs, acc)}
        self.proposer.on_verified(seqs, np.fromiter((acc_by_seq.get(id(s), 0) for s in seqs), dtype=np.int64,
                                                    count=len(seqs)))
        if len(self.policy.rows) > 4 * eng.config.max_num_seqs:
            self.policy.prune(s.seq_id for s in eng.scheduler.running)
        return list(outputs.values())
