"""LLMEngine: the step loop. ``step()`` = scheduler.schedule() -> model_runner.execute() -> sampler ->
output processing (engine/output_processor.py: advance = append tokens, stop checks without text; emit =
detokenize, stop strings, RequestOutputs for the requests that progressed; on GPU engines a step's emit runs while
the next step's forward does). With async scheduling (GPU engines by default: engine/async_scheduling.py) the next
step is scheduled and launched before this step's ids reach the host, and this step's output processing runs while
the device computes it.

Failure isolation: every request is validated completely in ``add_request`` (tokenfab/request_validation.py), so
nothing invalid reaches a step. If a step raises anyway, the engine re-runs the step's sequences in halves
(bisection) to find the ones whose rows raise, finishes their requests with ``finish_reason="error"`` (the message in
``RequestOutput.error``) and serves every other sequence of the step from the re-runs. Re-running is safe: a re-run
writes the same K/V at the same positions, and sequence progress (``num_computed_tokens``, tokens) is only advanced
in output processing, after a run succeeded. Models with recurrent state (KDA), which a failed run may have advanced,
recompute the other sequences from scratch instead (preemption). The normal path pays nothing for this (a ``try``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from tokenfab.engine.async_scheduling import AsyncScheduling, async_scheduling_enabled, refuse_unsupported
from tokenfab.engine.block_manager import BlockManager
from tokenfab.engine.detokenizer import IncrementalDetokenizer
from tokenfab.engine.engine_config import EngineConfig, resolve_kv_cache_dtype
from tokenfab.request_validation import bad_words_token_ids, check_processor_params_for_model
from tokenfab.engine.model_loader import LoadedModel, load_model
from tokenfab.engine.model_runner import ModelRunner, StepOutput
from tokenfab.engine.output_processor import OutputProcessor, async_output_enabled
from tokenfab.engine.sampler import Sampler
from tokenfab.engine.scheduler import ScheduledBatch, Scheduler
from tokenfab.engine.scheduling_policy import check_priority, make_policy
from tokenfab.engine.sequence import Sequence
from tokenfab.errors import InvalidRequestError, PromptTooLongError, UnsupportedError
from tokenfab.logprobs import TokenTexts
from tokenfab.outputs import RequestMetrics, RequestOutput
from tokenfab.request_validation import check_prompt_text, check_token_ids
from tokenfab.sampling_params import SamplingParams

logger = logging.getLogger("tokenfab")


@dataclass
class Request:
    """A user request: one prompt, ``params.n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    error: str | None = None  # why the engine failed this request (finish_reason "error"), else None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    """Continuous-batching engine over one model.

    Build with :meth:`from_config`. Thread-unsafe: one thread calls ``add_request`` / ``step`` / ``abort_request``
    (the server wraps it in a single engine thread).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        self.config = config
        self.model_config = loaded.model_config
        self.tokenizer = loaded.tokenizer
        self.token_texts = TokenTexts(self.tokenizer)  # Logprob.decoded_token, decoded once per id
        self.device, self.dtype = loaded.device, loaded.dtype
        from tokenfab.kernels.cpu import build as cpu_build
        host_experts = (getattr(config, "host_experts", None) is not None
                        or getattr(config, "num_device_experts", None) is not None)
        if cpu_build.wanted(self.device, host_experts):  # build (once per checkout) or load the fused CPU kernels
            cpu_build.load()  # now, not mid-request; a GPU engine without host experts never does
        self.max_model_len = config.max_model_len
        bs = config.block_size
        self.block_manager = BlockManager(config.num_kv_blocks, bs, config.max_num_seqs, config.max_model_len)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   make_policy(config.scheduling_policy, bs))
        self.generator = torch.Generator().manual_seed(config.seed)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)  # the KV pool's dtype
        self.runner = ModelRunner(loaded.model, self.block_manager, config.max_num_seqs, config.max_model_len,
                                  self.device, self.dtype, Sampler(self.generator), config.enforce_eager,
                                  batch_invariant=config.batch_invariant,
                                  kv_dtype=self.kv_dtype)
        if config.enable_prefix_caching:  # KV blocks shared by content hash (prefix_cache.py)
            from tokenfab.engine.prefix_cache import build_prefix_cache
            if self.runner.has_state and loaded.tp_group is not None:
                raise UnsupportedError("enable_prefix_caching with a hybrid (KDA) model and tensor_parallel_size > 1 "
                                       "is not supported yet (the state snapshots live on every rank); use one "
                                       "device or leave prefix caching off.")
            self.block_manager.enable_prefix_caching(build_prefix_cache(
                config.num_kv_blocks, bs, f"{config.model}|{self.dtype}", self.runner.kv_caches, config.max_num_seqs))
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = [self.tokenizer.eos_token_id]
        self.runner.eos_ids = self.eos_token_ids
        self.requests: dict[str, Request] = {}
        self.outputs = OutputProcessor(self)  # advance / emit halves of output processing
        self.async_output = async_output_enabled(self.device)  # emit a step's outputs during the next forward
        self._pending: list | None = None  # (request, sequence) pairs advanced, not yet emitted
        self._ready: list[RequestOutput] = []  # outputs emitted by an abort's flush, returned by the next step
        self._next_seq_id = 0
        self._grammar_compiler = None  # structured outputs (grammar_compiler), made on first use
        self.stats = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "requests_finished_total": 0,
                      "requests_aborted_total": 0, "requests_failed_total": 0, "step_failures_total": 0}
        self.skipped_weights = loaded.skipped_weights
        self.tp_group = loaded.tp_group  # tensor parallel > 1: workers to drive (tokenfab.parallel.launcher)
        if self.tp_group is not None:
            self.tp_group.attach(self.runner)
        self.expert_popularity = None  # routed-pair counts per layer per expert (engine/expert_popularity.py)
        if getattr(config, "record_expert_popularity", None):
            from tokenfab.engine.expert_popularity import ExpertPopularity
            self.expert_popularity = ExpertPopularity(loaded.model)
        self.spec = None  # speculative decoding (tokenfab/spec_decode/spec_decoder.py) when configured
        if config.speculative_config is not None:
            from tokenfab.spec_decode.spec_decoder import SpecDecoder
            self.spec = SpecDecoder(self, config.speculative_config)
        # async scheduling: not with speculative decoding (drafters read each step's ids); under tensor parallel the
        # workers receive the drawn ids with each step (parallel/worker.py)
        self.ahead: AsyncScheduling | None = None
        wanted = getattr(config, "async_scheduling", None)
        if wanted is None:
            wanted = async_scheduling_enabled(self.device) and self.spec is None
        if wanted:
            self.set_async_scheduling(True)  # refuses speculative decoding by name
        # CUDA graphs captured once the forward is settled (taps, drafts); under tensor parallel at the first step
        # that replays them, on every rank together (ModelRunner.follow_graphs), never by rank 0 alone
        if self.runner.decode_graphs is not None and not self.runner.sharded:
            self.runner.decode_graphs.capture_if_stale()

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True) -> "LLMEngine":
        """Load the model and size the KV pool as ``config`` says (see EngineConfig)."""
        from tokenfab.config import load_config
        config.check_max_model_len(load_config(config.model))  # settings errors before any weight is read
        from tokenfab.kernels.cpu import isa as cpu_isa
        from tokenfab.kernels.gpu import support as triton_support
        from tokenfab.layers.linear import cpu_linear_backend
        cpu_linear_backend()  # TOKENFAB_CPU_LINEAR / TOKENFAB_CPU_ISA / TOKENFAB_TRITON typos, also before loading
        cpu_isa.selected_level()
        from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
        cpu_gguf.gguf_int8_setting()  # TOKENFAB_GGUF_INT8_ACT typos, before loading
        from tokenfab.quant.packed_experts import check_setting
        check_setting()  # TOKENFAB_PACKED_EXPERTS typos, before loading
        from tokenfab.quant.packed_weight import dense_fallback_budget
        dense_fallback_budget()  # TOKENFAB_DENSE_FALLBACK_GIB typos, before loading
        async_scheduling_enabled(torch.device("cpu"))  # TOKENFAB_ASYNC_SCHEDULING typos, before loading
        if getattr(config, "async_scheduling", None):
            refuse_unsupported(config.speculative_config is not None)
        triton_support.check_env()
        if config.tensor_parallel_size != 1:
            from tokenfab.parallel.launcher import load_tensor_parallel
            loaded = load_tensor_parallel(config, progress=progress)
        else:
            loaded = load_model(config, progress=progress)
        try:
            config.finalize(loaded.model_config, loaded.dtype, loaded.model)
            return cls(config, loaded)
        except BaseException:
            if loaded.tp_group is not None:
                loaded.tp_group.close()
            raise

    def health_error(self) -> str | None:
        """Why this engine can no longer serve (a tensor-parallel rank failed), or None when it is healthy."""
        g = getattr(self, "tp_group", None)
        if g is not None and g.closed:
            return ("a tensor-parallel rank failed" + (f" (rank {g.failed_rank})" if g.failed_rank is not None else "")
                    + "; restart the server")
        return None

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and leave the process group (no-op on one device), and write the
        expert-popularity file when recording. Idempotent."""
        if getattr(self, "expert_popularity", None) is not None:
            self.expert_popularity.write(self.config.record_expert_popularity)
        if self.tp_group is not None:
            self.tp_group.close()

    # ---- requests --------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams, arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request after validating all of it (request_validation.py). Tokenizes ``prompt`` when
        ``prompt_token_ids`` is None.

        Raises:
            PromptTooLongError: the prompt has more than max_model_len tokens, or more than the whole KV pool holds.
            InvalidRequestError (a ValueError): a SamplingParams field out of range or outside the vocabulary, an
                empty prompt, token ids that are not integers in [0, vocab_size), a lone surrogate in the prompt
                text, a text prompt or stop strings for a model without tokenizer, a structured-output schema /
                regex / grammar that does not compile, allowed_token_ids that are all end tokens (EOS or
                stop_token_ids) while min_tokens forbids them.
            ValueError: duplicate request id.
            InvalidRequestError: ``priority`` not an integer, or not 0 while scheduling_policy is not "priority"
                (scheduling_policy.check_priority).
        """
        if request_id in self.requests:
            raise ValueError(f"request id '{request_id}' is already in use.")
        priority = check_priority(priority, self.config.scheduling_policy)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}.",
                                      "sampling_params")
        V = self.model_config.vocab_size
        params.validate(V)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer and this model has none (no tokenizer files "
                                      "in its folder); use stop_token_ids instead.", "stop")
        if params.min_tokens > 0 and params.allowed_token_ids:
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if set(params.allowed_token_ids) <= ends:  # min_tokens masks them all: no token could be drawn
                raise InvalidRequestError(
                    f"allowed_token_ids {sorted(set(params.allowed_token_ids))} are all end tokens (EOS or "
                    f"stop_token_ids), which min_tokens = {params.min_tokens} forbids: no token could be generated; "
                    "allow another token, set min_tokens 0 or ignore_eos.", "allowed_token_ids")
        bad_ids = bad_words_token_ids(params.bad_words, self.tokenizer) if params.bad_words else []
        check_processor_params_for_model(params, V, bad_ids)  # bad words encoded once per request, in the vocabulary
        grammar = self.compile_grammar(params)  # structured outputs: compiled once per request (cached by schema)
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("a request needs a prompt string or prompt_token_ids.", "prompt")
            check_prompt_text("prompt", prompt)
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer (no tokenizer files in its folder), so a text "
                                          "prompt cannot be tokenized; pass prompt_token_ids instead.", "prompt")
            prompt_token_ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        ids = check_token_ids("prompt_token_ids", prompt_token_ids, V)
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens, more than max_model_len "
                                     f"({self.max_model_len}); shorten it or raise max_model_len.")
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs, detoks = [], []
        for i in range(params.n):
            seqs.append(Sequence(self._next_seq_id, request_id, i, ids, params, now))
            seqs[-1].bad_words_token_ids = bad_ids
            seqs[-1].grammar = grammar
            seqs[-1].priority = priority
            self._next_seq_id += 1
            detoks.append(IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop))
        req = Request(request_id, prompt, ids, params, seqs, detoks, RequestMetrics(arrival_time=now))
        self.requests[request_id] = req
        for s in seqs:
            self.scheduler.add(s)

    @property
    def grammar_compiler(self):
        """The :class:`~tokenfab.structured_output.compiler.GrammarCompiler` for this model's tokenizer (made on
        first use; the server compiles requests with it before they stream, so bad schemas are 400s)."""
        if self._grammar_compiler is None:
            from tokenfab.structured_output.compiler import GrammarCompiler
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                     self.eos_token_ids)
        return self._grammar_compiler

    def use_grammar_tokenizer(self, tokenizer) -> None:
        """Compile grammars against ``tokenizer`` (an equal copy of the model's: the server's own, so that its
        handler threads never read the tokenizer the engine thread detokenizes with). Before the first compile."""
        if self._grammar_compiler is None and tokenizer is not None:
            from tokenfab.structured_output.compiler import GrammarCompiler
            self._grammar_compiler = GrammarCompiler(tokenizer, self.model_config.vocab_size, self.eos_token_ids)

    def compile_grammar(self, params: SamplingParams):
        """``params.structured_outputs`` compiled (xgrammar CompiledGrammar), or None without one.

        Raises:
            InvalidRequestError: a schema / regex / grammar that does not compile, naming the field.
        """
        so = params.structured_outputs
        if so is None:
            return None
        so.check()
        return self.grammar_compiler.compile(so)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks. Returns its final output (``finish_reason`` "abort" for the
        sequences that were still running), or None for unknown or finished ids (ignored)."""
        self._ready = self._flush()  # deferred text first (the next step returns those outputs)
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.stats["requests_aborted_total"] += 1
        for s, d in zip(req.seqs, req.detoks):
            if not s.is_finished:
                d.finish(s.output_token_ids, check_stop=False)
                self.scheduler.finish(s, "abort")
        return self._make_output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> dict:
        """Gauges and counters: running / waiting sequences and requests (a request with n > 1 counts once; one
        with any sequence running is running), KV usage 0..1, preemptions, prefix-cache queries and hits (tokens),
        token and request totals; with decode-graph buffers (engine/cuda_graph_runner.py) the steps they served,
        ``graph_steps_decode`` and ``graph_steps_verify`` (hybrid models' steps of up to 1 + k tokens a sequence:
        speculative verification, short prefill chunks beside it) and, with a DSpark drafter, ``graph_steps_draft``
        (its passes from its own buffers)."""
        running_reqs = {s.request_id for s in self.scheduler.running}
        pc = self.block_manager.prefix_cache
        waiting_reqs = {s.request_id for s in self.scheduler.waiting} - running_reqs
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "num_requests_running": len(running_reqs), "num_requests_waiting": len(waiting_reqs),
                "kv_cache_usage": self.block_manager.usage(), "num_preemptions": self.scheduler.num_preemptions,
                "prefix_cache_queries": pc.queries if pc is not None else 0,
                "prefix_cache_hits": pc.hits if pc is not None else 0,
                **self.stats, **self._host_expert_stats(), **self._graph_stats()}

    def _graph_stats(self) -> dict:
        g = self.runner.decode_graphs
        if g is None:
            return {}
        out = {"graph_steps_decode": g.replays - g.verify_replays, "graph_steps_verify": g.verify_replays}
        drafter = getattr(getattr(getattr(self, "spec", None), "proposer", None), "graphs", None)
        if drafter is not None:  # the DSpark drafter's passes from its own buffers (spec_decode/dspark_graphs.py)
            out["graph_steps_draft"] = drafter.replays
        return out

    def _host_expert_stats(self) -> dict:
        """{"host_experts": cumulative split accounting (layers/host_experts.py, this process = rank 0)} when the
        model has host experts, else {}."""
        hs = getattr(self.runner.model, "host_expert_stats", None)
        if hs is None:
            return {}
        from tokenfab.layers.host_experts import host_expert_bytes
        return {"host_experts": dict(hs.snapshot(), resident_bytes=host_expert_bytes(self.runner.model))}

    # ---- the step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling + forward + sampling step; returns outputs of requests that gained a token or
        finished. With deferred outputs (``self.async_output``, engine/output_processor.py) a step's text and
        outputs are made while the device computes the next step, and returned by that next call. With async
        scheduling (``self.ahead``) a call launches the next step and returns the outputs of the step launched by
        the call before."""
        if self.ahead is not None:
            return self._step_ahead()
        if self.spec is not None and self.spec.active():  # propose, verify in this batch, accept (spec_decode/)
            return self._flush() + self.spec.step()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            flushed = self._flush()
            if not flushed and self.scheduler.waiting and not self.scheduler.running:  # a valid pool never gets here
                raise RuntimeError("scheduler made no progress: KV pool too small for the waiting request")
            return flushed
        self._stamp_scheduled(batch)
        outputs: list[RequestOutput] = []
        try:
            out = self._run(batch)
            outputs = self._flush()  # the previous step's text and outputs while the device runs this one
            if out.sampler_output is not None:
                out.sampler_output.wait()  # the step's one wait: its sampled ids (a device error surfaces here)
        except Exception as exc:  # some sequence's rows raised: find it, fail its request alone, serve the rest
            if self.health_error() is not None:  # a tensor-parallel rank died: no request is at fault, none can run
                raise
            return outputs + self._flush() + self._step_isolating(batch, exc)
        pairs = self.outputs.advance(batch, out)
        if self.spec is not None:  # drafters that follow the target's hidden states see this forward's
            self.spec.observe()
        if self.async_output and (self.scheduler.running or self.scheduler.waiting):
            self._pending = pairs  # emitted by the next step, while its forward runs
        else:
            outputs += self.outputs.emit(pairs)
        return outputs

    def set_async_scheduling(self, on: bool) -> None:
        """Turn async scheduling on or off between steps (benchmarks measure both in one engine). Turning it off
        waits for the step in flight and processes it; its outputs are returned by the next :meth:`step`.

        Raises:
            UnsupportedError: ``on`` with speculative decoding (engine/async_scheduling.py)."""
        if on:
            refuse_unsupported(self.spec is not None)
            if self.ahead is None:
                self._ready = self._flush()
                self.ahead = AsyncScheduling(self)
                self.runner.penalty_counts_at_draw(True)  # penalized rows schedule ahead (draw_time_counts.py)
            return
        if self.ahead is not None:
            prev, self.ahead = self.ahead.inflight, None
            if prev is not None:
                self._ready = self._flush() + self._process(*prev)
            self.runner.penalty_counts_at_draw(False)  # every id recorded on the host: its counts are current

    def _step_ahead(self) -> list[RequestOutput]:
        """:meth:`step` with async scheduling (engine/async_scheduling.py): place the step in flight (progress and
        placeholders for its ids), schedule and launch the next one, then fill the placed step's ids and emit its
        outputs while the device computes. A step in flight whose rows use logits processors is processed in line
        first. If the launch raises, the placed step is filled first, so the failing batch is isolated on real ids."""
        ahead = self.ahead
        outputs = self._flush()  # an abort's flushed outputs
        prev, ahead.inflight = ahead.inflight, None
        source = None
        if prev is not None:
            if ahead.can_place(*prev):
                source = ahead.place(*prev)
            else:  # its ids are needed before the next draw: wait for them and process it in line
                outputs += self._process(*prev)
                prev = None
        batch = self.scheduler.schedule()
        if batch.seqs:
            self._stamp_scheduled(batch)
            try:
                self.runner.placeholder_source = source
                out = self._run(batch)
            except Exception as exc:  # as in step(): find the failing sequences, fail their requests alone
                self.runner.placeholder_source = None
                outputs += self.outputs.emit(ahead.fill())
                if self.health_error() is not None:
                    raise
                return outputs + self._step_isolating(batch, exc)
            self.runner.placeholder_source = None
            ahead.inflight = (batch, out)
            ahead.steps_ahead += source is not None
        elif prev is None and self.scheduler.waiting and not self.scheduler.running:  # a valid pool never gets here
            raise RuntimeError("scheduler made no progress: KV pool too small for the waiting request")
        return outputs + self.outputs.emit(ahead.fill())

    @staticmethod
    def _stamp_scheduled(batch: ScheduledBatch) -> None:
        """The first-scheduled time of the sequences ``batch`` admits for the first time (metrics)."""
        now = time.monotonic()
        for s in batch.admitted:
            if s.first_scheduled_time is None:
                s.first_scheduled_time = now

    def _run(self, batch: ScheduledBatch) -> StepOutput:
        """Write admitted sequences' tokens and run the forward + sampling of ``batch`` (no sequence state
        changes: safe to repeat). What :meth:`step` runs inline."""
        self.runner.admit(batch.admitted)
        return self.runner.execute(batch) if self.tp_group is None else self.tp_group.execute(self.runner, batch)

    @staticmethod
    def _sub_batch(batch: ScheduledBatch, idx: np.ndarray) -> ScheduledBatch:
        """The part of ``batch`` at the sorted indices ``idx`` (decodes still first)."""
        seqs = [batch.seqs[i] for i in idx.tolist()]
        ids = {id(s) for s in seqs}
        return ScheduledBatch(seqs=seqs, num_decodes=int((idx < batch.num_decodes).sum()), rows=batch.rows[idx],
                              num_new=batch.num_new[idx], num_computed=batch.num_computed[idx],
                              admitted=[s for s in batch.admitted if id(s) in ids])

    def _step_isolating(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        """After ``batch`` raised ``exc``: bisect it (re-run each half, recurse into halves that raise) down to the
        single sequences that raise, fail their requests (finish_reason "error", ``RequestOutput.error``), and
        process the outputs of the halves that ran. With recurrent-state models the halves' outputs are dropped
        and every other sequence of the batch is preempted (recomputed from its tokens). RNG draws of runs that
        raised (or whose outputs are dropped) are given back; those of the first, failed run cannot be, so a
        seeded request keeps its tokens when the step failed before sampling (the forward, the min_tokens mask).
        Returns the outputs of the requests that progressed, finished or failed."""
        self.stats["step_failures_total"] += 1
        logger.warning("engine step over %d sequences failed (%s: %s); isolating the failing requests",
                       len(batch), type(exc).__name__, str(exc).strip().splitlines()[:1])
        recurrent = self.runner.has_state
        results: dict[str, RequestOutput] = {}
        failed: dict[str, Exception] = {}

        def bisect(idx: np.ndarray, err: Exception) -> None:
            if len(idx) == 1:
                failed.setdefault(batch.seqs[int(idx[0])].request_id, err)
                return
            half = len(idx) // 2
            for part in (idx[:half], idx[half:]):
                sub = self._sub_batch(batch, part)
                rng = self._rng_states(sub.seqs)
                try:
                    out = self._run(sub)
                except Exception as e:
                    self._restore_rng(rng)  # draws of a run that raised never happened
                    bisect(part, e)
                    continue
                if recurrent:
                    self._restore_rng(rng)  # its tokens are dropped: so are its draws
                else:
                    for o in self._process(sub, out):
                        results[o.request_id] = o

        bisect(np.arange(len(batch)), exc)
        if recurrent:  # the failed runs may have advanced their recurrent state: recompute from scratch
            for s in reversed(batch.seqs):
                if s.request_id not in failed and not s.is_finished:
                    self.scheduler._preempt(s)
        for rid, err in failed.items():
            req = self.requests.get(rid)
            if req is not None:
                results[rid] = self._fail_request(req, err)
        return list(results.values())

    def _rng_states(self, seqs: list[Sequence]) -> list[tuple[torch.Generator, torch.Tensor]]:
        """(generator, state) of the engine's RNG and of every seeded sequence in ``seqs`` (isolation re-runs
        only: a re-run that raises or whose tokens are dropped gives its draws back, so seeded requests keep the
        tokens they would have had)."""
        gens = [self.generator] + [s.generator for s in seqs if s.generator is not None]
        return [(g, g.get_state()) for g in gens]

    @staticmethod
    def _restore_rng(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        for g, st in states:
            g.set_state(st)

    def _fail_request(self, req: Request, err: BaseException) -> RequestOutput:
        """Finish every sequence of ``req`` with finish_reason "error", free its blocks and rows, and return its
        final output (``error`` says what raised; the traceback goes to the log)."""
        first = (str(err).strip().splitlines() or [""])[0][:300]
        req.error = f"{type(err).__name__}: {first}"
        logger.error("request %s failed in an engine step: %s", req.request_id, req.error, exc_info=err)
        for s in req.seqs:
            if not s.is_finished:
                self.scheduler.finish(s, "error")
        self.requests.pop(req.request_id, None)
        self.stats["requests_failed_total"] += 1
        return self._make_output(req)

    def _process(self, batch: ScheduledBatch, out: StepOutput) -> list[RequestOutput]:
        """All output processing of ``batch``'s step output ``out`` in line (advance, then emit:
        engine/output_processor.py); the outputs of the requests that progressed, finished or failed."""
        return self.outputs.emit(self.outputs.advance(batch, out))

    def _flush(self) -> list[RequestOutput]:
        """Outputs held back: those of an abort's flush (but the aborted requests': their abort returned their final
        output), then the deferred emit of the last step (if any)."""
        ready = [o for o in self._ready if o.finished or o.request_id in self.requests]
        self._ready = []
        if self._pending is not None:
            pending, self._pending = self._pending, None
            ready += self.outputs.emit(pending)
        return ready

    def _make_output(self, req: Request) -> RequestOutput:
        return self.outputs.make_output(req)
