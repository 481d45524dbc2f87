"""A step's output processing in two halves, so that the costly one can run while the device computes the next step.

``advance`` (what the next step's scheduling needs, right after the sampled ids arrive): sequence progress, the new
tokens in the sequences and the runner's token array, first-token times, counters, logprobs, and every stop rule
that needs no text — EOS, ``stop_token_ids``, ``max_tokens``, the model length — each finishing its sequence at
once. It returns the (request, sequence) pairs that got a token.

``emit`` (what only the client needs): incremental detokenization, stop strings and the RequestOutputs. A stop
string found here finishes its sequence ("stop", the string as ``stop_reason``), or, for a sequence that an
``advance`` rule finished on the same token, becomes its reason: the same precedence as checking all rules in one
place (stop string, then EOS, stop token, length). A detokenizer that raises fails its request alone.

Deferred outputs (GPU engines: ``TOKENFAB_ASYNC_OUTPUT``, :func:`async_output_enabled`): ``LLMEngine.step`` runs
``advance`` for step k when its ids arrive, then launches step k + 1 and runs ``emit`` for step k while the device
computes, before waiting for step k + 1's ids — the detokenization and output objects (about 10-15 µs per sequence
and step on the host, measured on CPU) leave the critical path, as in vLLM V1, where a separate process
detokenizes. The cost: a stop string is seen one step later, so its sequence computes one more token, which is
dropped (its text is cut at the stop string as before; its blocks are freed before the next schedule). Outputs reach
the caller one step later in wall time by the launch of the next step only. Token ids, text, finish reasons and
logprobs are the same as with outputs in line (tests/test_async_output.py).
"""
from __future__ import annotations

import time

import torch

from tokenfab.engine.overlap_setting import overlap_setting
from tokenfab.logprobs import position_logprobs
from tokenfab.outputs import CompletionOutput, RequestOutput


def async_output_enabled(device: torch.device) -> bool:
    """``TOKENFAB_ASYNC_OUTPUT``: "auto" (default; on for CUDA / ROCm engines, whose steps launch without waiting),
    "1" (always; tests on CPU) or "0" (never) (engine/overlap_setting.py).

    Raises:
        EngineConfigError: any other value.
    """
    return overlap_setting("TOKENFAB_ASYNC_OUTPUT", device)


def length_reached(seq, max_model_len: int) -> bool:
    """Whether ``seq`` (its last token counted) reached its ``max_tokens`` or the model length: the stop rule that
    needs no token id (async scheduling applies it before the id arrives)."""
    p = seq.params
    return (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= max_model_len


class OutputProcessor:
    """The two halves of a step's output processing for an :class:`~tokenfab.engine.engine.LLMEngine` (its requests,
    scheduler, runner, counters, EOS ids and model length)."""

    def __init__(self, engine):
        self.eng = engine

    # ---- advance: progress, tokens and the stop rules that need no text ---------------------------------------
    def advance(self, batch, out) -> list[tuple[object, object]]:
        """Apply step output ``out`` (a StepOutput, ids already on the host) to ``batch`` (a ScheduledBatch).
        Returns the (Request, Sequence) pairs that got a token, in batch order."""
        self.progress(batch, out)
        so = out.sampler_output
        if so is None:
            return []
        so.wait()
        toks = so.token_ids.numpy()
        idx = out.sampled_index
        if batch.num_decodes == len(batch.seqs):  # decode-only: every sequence sampled, in order
            self.eng.runner.write_tokens(batch.rows, batch.num_computed + 1, toks)
        else:
            self.eng.runner.write_tokens(batch.rows[idx], batch.num_computed[idx] + batch.num_new[idx], toks)
        seqs = batch.seqs
        live = []
        for j, i in enumerate(idx.tolist()):
            seq = seqs[i]
            if seq.is_finished:  # aborted (or stopped by a deferred stop string) while running
                continue
            seq.token_ids.append(None)  # its slot; take_tokens writes the id
            live.append((j, seq, False))
        return self.take_tokens(live, so)

    def progress(self, batch, out) -> None:
        """Sequence progress of a step that ran: ``num_computed_tokens`` += its tokens, and the prompt logprobs it
        scored. Needs no sampled id (async scheduling runs it before they arrive: engine/async_scheduling.py)."""
        seqs = batch.seqs
        if batch.num_decodes == len(seqs):  # one new token each
            for s in seqs:
                s.num_computed_tokens += 1
        else:
            for s, n in zip(seqs, batch.num_new.tolist()):
                s.num_computed_tokens += n
        if out.prompt_logprobs is not None:
            self._store_prompt_logprobs(seqs, out)

    def take_tokens(self, entries: list[tuple[int, object, bool]], so) -> list[tuple[object, object]]:
        """Record the sampled ids of ``so`` (a SamplerOutput whose ``token_ids`` are on the host) in the sequences
        of ``entries`` = (row j of ``so``, sequence whose last token slot receives id j, whether a length rule
        already finished it), with their logprobs, first-token times and counters, and apply the stop rules that
        need no text: EOS and ``stop_token_ids`` (from ``min_tokens`` on), then ``max_tokens`` and the model length.
        A sequence finished by length before its id was known (async scheduling) takes "stop" instead when the id
        is an end token, as if all rules had been checked at once. Returns the (Request, Sequence) pairs, in
        order."""
        eng = self.eng
        now = time.monotonic()
        tok_list = so.token_ids.tolist()
        lps = so.logprobs.tolist() if so.logprobs is not None else None
        ranks = so.ranks.tolist() if so.ranks is not None else None
        top_ids = so.top_ids.tolist() if so.top_ids is not None else None
        top_lps = so.top_logprobs.tolist() if so.top_logprobs is not None else None
        stats, eos, max_len, requests = eng.stats, eng.eos_token_ids, eng.max_model_len, eng.requests
        pairs = []
        for j, seq, by_length in entries:
            tok = tok_list[j]
            seq.token_ids[-1] = tok
            if seq.first_token_time is None:
                seq.first_token_time = now
            stats["generation_tokens_total"] += 1
            n_out = seq.num_output_tokens
            if n_out == 1:
                stats["prompt_tokens_total"] += seq.num_prompt_tokens
            p = seq.params
            if p.logprobs is not None:  # {token_id: Logprob}, vLLM's shape (tokenfab/logprobs.py)
                k = p.logprobs
                seq.output_logprobs.append(position_logprobs(
                    tok, lps[j], ranks[j], top_ids[j][:k] if top_ids is not None else None,
                    top_lps[j][:k] if top_lps is not None else None, eng.token_texts))
                seq.cumulative_logprob += lps[j]
            req = requests.get(seq.request_id)
            if req is None:
                continue
            reason = stop_reason = None
            if n_out >= p.min_tokens:  # below min_tokens neither EOS nor a stop token ends the sequence
                if not p.ignore_eos and tok in eos:
                    reason = "stop"
                elif tok in p.stop_token_ids:
                    reason, stop_reason = "stop", tok
            if by_length:  # already finished (its blocks freed) with "length"; an end token takes precedence
                if reason is not None:
                    seq.finish_reason, seq.stop_reason = reason, stop_reason
            else:
                if reason is None and length_reached(seq, max_len):
                    reason = "length"
                if reason is not None:
                    seq.stop_reason = stop_reason
                    eng.scheduler.finish(seq, reason)
            pairs.append((req, seq))
        return pairs

    def _store_prompt_logprobs(self, seqs, out) -> None:
        """Append this step's prompt positions to each sequence's ``prompt_logprobs`` ({token_id: Logprob} each)."""
        p = out.prompt_logprobs
        seq_i, lp, tgt = p.seq_index.tolist(), p.logprob.tolist(), p.token_ids.tolist()
        ranks = p.ranks.tolist()
        ti = p.top_ids.tolist() if p.top_ids is not None else None
        tv = p.top_logprobs.tolist() if p.top_logprobs is not None else None
        for j, i in enumerate(seq_i):
            seq = seqs[i]
            k = seq.params.prompt_logprobs
            top = ti is not None and k
            seq.prompt_logprobs.append(position_logprobs(tgt[j], lp[j], ranks[j], ti[j][:k] if top else None,
                                                         tv[j][:k] if top else None, self.eng.token_texts))

    # ---- emit: text, stop strings, outputs ------------------------------------------------------------------
    def emit(self, pairs: list[tuple[object, object]]) -> list[RequestOutput]:
        """Detokenize the new tokens of ``pairs`` (from :meth:`advance`), apply stop strings and return one
        RequestOutput per request still known to the engine (finished ones leave ``engine.requests``); a request
        whose detokenizer raised is failed alone."""
        eng = self.eng
        touched: dict[str, object] = {}
        failed: dict[str, tuple[object, Exception]] = {}
        for req, seq in pairs:
            rid = req.request_id
            if eng.requests.get(rid) is not req or rid in failed:  # aborted or failed since its advance
                continue
            try:
                self._stop_strings(req, seq)
            except Exception as e:  # detokenizing this sequence raised: fail its request only
                failed[rid] = (req, e)
                continue
            touched[rid] = req
        outputs = []
        for rid, (req, e) in failed.items():
            touched.pop(rid, None)
            outputs.append(eng._fail_request(req, e))
        for req in touched.values():
            out = self.make_output(req)
            outputs.append(out)
            if out.finished:
                eng.requests.pop(req.request_id, None)
                eng.stats["requests_finished_total"] += 1
        return outputs

    def _stop_strings(self, req, seq) -> None:
        """The text of ``seq``'s new token; a stop string ends the sequence (or becomes the reason of a sequence
        :meth:`advance` finished on this token); a finished sequence's held-back text is flushed."""
        detok = req.detoks[seq.index]
        ids = seq.output_token_ids
        check = len(ids) >= seq.params.min_tokens  # below min_tokens no stop string is searched
        _, stop_str = detok.update(ids, check)
        if stop_str is None and seq.is_finished:  # flush text held for an incomplete character (it may end a stop)
            _, stop_str = detok.finish(ids, check)
        if stop_str is None:
            return
        seq.stop_reason = stop_str
        if seq.is_finished:
            seq.finish_reason = "stop"
        else:
            self.eng.scheduler.finish(seq, "stop")

    def make_output(self, req) -> RequestOutput:
        """The RequestOutput of ``req`` now (cumulative token ids and text; the text held back for stop strings
        while it runs)."""
        seqs = req.seqs
        outs = []
        finished = True
        for s, d in zip(seqs, req.detoks):
            done = s.is_finished
            finished = finished and done
            lp = s.params.logprobs is not None
            outs.append(CompletionOutput(
                index=s.index, text=d.text if done else d.visible_text(), token_ids=s.output_token_ids,
                logprobs=s.output_logprobs if lp else None, cumulative_logprob=s.cumulative_logprob if lp else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        m = req.metrics
        # the earliest first token / first schedule of the request's sequences: once set, later ones cannot lower it
        if m.first_token_time is None:
            firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
            m.first_token_time = min(firsts) if firsts else None
        if m.first_scheduled_time is None:
            sched = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
            m.first_scheduled_time = min(sched) if sched else None
        m.num_preemptions = seqs[0].num_preemptions if len(seqs) == 1 else sum(s.num_preemptions for s in seqs)
        if finished:
            m.finished_time = time.monotonic()
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=outs, finished=finished, prompt_logprobs=seqs[0].prompt_logprobs,
                             metrics=m, error=req.error)
