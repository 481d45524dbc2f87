"""Prometheus metrics for ``/metrics``, under vLLM's names (``vllm:...``) so existing dashboards work.

Each :class:`ServerMetrics` owns its own ``CollectorRegistry`` (several servers may live in one process, e.g. in
tests). Gauges and token counters are synced from the engine's stats when scraped; request histograms are fed
from the engine thread (``on_step`` / ``on_finish`` callbacks of :class:`~tokenfab.server.async_engine.AsyncLLM`).

Units: all times in seconds; token counts in tokens; ``vllm:kv_cache_usage_perc`` is a fraction in [0, 1].
"""
from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import disable_created_metrics
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServerMetrics:
    """The server's metric set, labelled ``model_name`` (vLLM's label).

    Exposed (vLLM names): ``vllm:num_requests_running`` / ``_waiting`` (gauges, sequences), ``vllm:kv_cache_usage_perc``
    (gauge, 0..1), ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` / ``vllm:num_preemptions_total`` /
    ``vllm:request_success_total{finished_reason}`` (counters; finished_reason "stop", "length", "abort" for requests
    the client gave up on, "error" for requests the engine failed), the histograms ``vllm:time_to_first_token_seconds``,
    ``vllm:time_per_output_token_seconds``, ``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds``,
    ``vllm:request_queue_time_seconds``, ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``, and the
    speculative-decoding counters ``vllm:spec_decode_num_drafts_total`` / ``_num_draft_tokens_total`` /
    ``_num_accepted_tokens_total`` (0: no drafter yet), the prefix-cache counters ``vllm:prefix_cache_queries_total`` /
    ``vllm:prefix_cache_hits_total`` (tokens looked up / found cached at admission; 0 with prefix caching off). tokenfab
    adds ``tokenfab:num_aborted_requests_total`` and ``tokenfab:num_engine_step_failures_total``,
    ``tokenfab:graph_steps_total{kind="decode"|"verify"|"draft"}`` (steps the decode-graph buffers served; verify:
    hybrid models' steps of several tokens a sequence, speculative verification and short chunks beside it; draft:
    DSpark drafter passes from its own buffers, spec_decode/dspark_graphs.py), and with
    host-offloaded experts (rank 0's accounting, tokenfab/layers/host_experts.py) the counters
    ``tokenfab:host_experts_device_seconds_total`` (device-expert compute), ``_host_seconds_total`` (host-expert compute
    on the worker), ``_copy_seconds_total`` (gather and device <-> host copies), ``_wait_seconds_total`` (the device
    side waiting for the host), ``_routed_pairs_total{side="device"|"host"}``,
    ``_copied_bytes_total{direction="to_host"|"to_device"}``, ``_forward_passes_total`` and the gauge
    ``tokenfab:host_experts_resident_bytes`` (host-resident weights).
    """

    def __init__(self, model_name: str):
        disable_created_metrics()  # no *_created series (as vLLM)
        self.model_name = model_name
        self.registry = reg = CollectorRegistry()
        L = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, L, registry=reg)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, L + list(labels), registry=reg)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, L, buckets=buckets, registry=reg)

        self.running = gauge("vllm:num_requests_running", "Number of sequences in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of sequences waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.success = counter("vllm:request_success", "Count of successfully processed requests.", "finished_reason")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.spec_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", "position")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              _ITL_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", _LATENCY_BUCKETS)
        self.req_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens per request.",
                                           _TOKEN_BUCKETS)
        self.req_gen_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens per request.",
                                        _TOKEN_BUCKETS)
        self.aborted = counter("tokenfab:num_aborted_requests", "Requests aborted before finishing (client gone).")
        self.step_failures = counter("tokenfab:num_engine_step_failures", "Engine steps that raised an error.")
        self.graph_steps = counter("tokenfab:graph_steps", "Steps served from the decode-graph buffers.", "kind")
        for m in (self.aborted, self.step_failures, self.prompt_tokens, self.generation_tokens, self.preemptions, self.spec_drafts,
                  self.spec_draft_tokens, self.spec_accepted, self.prefix_queries, self.prefix_hits):
            m.labels(model_name).inc(0)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(model_name, reason).inc(0)
        for kind in ("decode", "verify", "draft"):
            self.graph_steps.labels(model_name, kind).inc(0)
        self._lock = threading.Lock()
        self._seen = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "num_preemptions": 0,
                      "num_aborted": 0, "num_step_failures": 0, "spec_decode_num_drafts": 0,
                      "spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0,
                      "prefix_cache_queries": 0, "prefix_cache_hits": 0, "graph_steps_decode": 0,
                      "graph_steps_verify": 0, "graph_steps_draft": 0}
        self._seen_per_pos: list[int] = []
        self._last: dict[str, tuple[float, int]] = {}  # request id -> (time of last token, tokens so far)
        self._host = None  # host-expert metrics, made when the engine first reports them (_sync_host_experts)

    # ------------------------------------------------------------------------------------------- engine thread
    def on_step(self, outputs, stats: dict, step_seconds: float) -> None:
        """Observe inter-token gaps of the requests that progressed in a step (called on the engine thread)."""
        now = time.monotonic()
        m = self.model_name
        for out in outputs:
            ntok = sum(len(o.token_ids) for o in out.outputs)
            prev = self._last.get(out.request_id)
            if prev is not None and ntok > prev[1]:
                gap = (now - prev[0]) / (ntok - prev[1])
                for _ in range(ntok - prev[1]):
                    self.itl.labels(m).observe(gap)
                    self.tpot.labels(m).observe(gap)
            if out.finished:
                self._last.pop(out.request_id, None)
            else:
                self._last[out.request_id] = (now, ntok)
        if len(self._last) > 4096:  # aborted requests never finish: forget the stale ones
            cutoff = now - 600.0
            self._last = {k: v for k, v in self._last.items() if v[0] >= cutoff}
        self.sync(stats)

    def on_finish(self, out) -> None:
        """Observe a finished request's latencies and token counts (engine thread)."""
        m = self.model_name
        met = out.metrics
        if met is not None:
            end = met.finished_time or time.monotonic()
            if met.first_token_time is not None:
                self.ttft.labels(m).observe(max(0.0, met.first_token_time - met.arrival_time))
            self.e2e.labels(m).observe(max(0.0, end - met.arrival_time))
            if met.first_scheduled_time is not None:
                self.queue_time.labels(m).observe(max(0.0, met.first_scheduled_time - met.arrival_time))
        self.req_prompt_tokens.labels(m).observe(len(out.prompt_token_ids))
        self.req_gen_tokens.labels(m).observe(sum(len(o.token_ids) for o in out.outputs))
        for o in out.outputs:
            self.success.labels(m, o.finish_reason or "abort").inc()

    # ---------------------------------------------------------------------------------------------------- any
    def sync(self, stats: dict) -> None:
        """Set gauges and advance counters from the engine's cumulative stats (thread-safe)."""
        m = self.model_name
        with self._lock:
            self.running.labels(m).set(stats.get("num_requests_running", stats.get("num_running", 0)))
            self.waiting.labels(m).set(stats.get("num_requests_waiting", stats.get("num_waiting", 0)))
            self.kv_usage.labels(m).set(stats.get("kv_cache_usage", 0.0))
            for key, counter in (("prompt_tokens_total", self.prompt_tokens),
                                 ("generation_tokens_total", self.generation_tokens),
                                 ("num_preemptions", self.preemptions), ("num_aborted", self.aborted),
                                 ("num_step_failures", self.step_failures),
                                 ("spec_decode_num_drafts", self.spec_drafts),
                                 ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
                                 ("spec_decode_num_accepted_tokens", self.spec_accepted),
                                 ("prefix_cache_queries", self.prefix_queries),
                                 ("prefix_cache_hits", self.prefix_hits)):
                cur = int(stats.get(key, 0))
                if cur > self._seen[key]:
                    counter.labels(m).inc(cur - self._seen[key])
                    self._seen[key] = cur
            for kind in ("decode", "verify", "draft"):
                key = f"graph_steps_{kind}"
                cur = int(stats.get(key, 0))
                if cur > self._seen[key]:
                    self.graph_steps.labels(m, kind).inc(cur - self._seen[key])
                    self._seen[key] = cur
            if stats.get("host_experts"):
                self._sync_host_experts(stats["host_experts"])
            per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos") or []  # speculative decoding on
            for j, cur in enumerate(per_pos):
                if j >= len(self._seen_per_pos):
                    self._seen_per_pos.append(0)
                    self.spec_per_pos.labels(m, str(j)).inc(0)
                if cur > self._seen_per_pos[j]:
                    self.spec_per_pos.labels(m, str(j)).inc(cur - self._seen_per_pos[j])
                    self._seen_per_pos[j] = cur

    _HOST_COUNTERS = (("device_s", "device_seconds", "Seconds of device-expert compute (host-expert layers).", {}),
                      ("host_s", "host_seconds", "Seconds of host-expert compute on the host worker.", {}),
                      ("copy_s", "copy_seconds", "Seconds of gathering and copying rows device <-> host.", {}),
                      ("wait_s", "wait_seconds", "Seconds the device side waited for the host experts.", {}),
                      ("device_pairs", "routed_pairs", "Routed (token, expert) pairs per side.", {"side": "device"}),
                      ("host_pairs", "routed_pairs", "Routed (token, expert) pairs per side.", {"side": "host"}),
                      ("bytes_to_host", "copied_bytes", "Activation bytes copied between device and host.",
                       {"direction": "to_host"}),
                      ("bytes_to_device", "copied_bytes", "Activation bytes copied between device and host.",
                       {"direction": "to_device"}),
                      ("passes", "forward_passes", "Forward passes that ran host experts.", {}))

    def _sync_host_experts(self, hs: dict) -> None:
        """Advance the host-expert counters to the engine's cumulative values (lock held)."""
        m = self.model_name
        if self._host is None:
            made: dict[str, Counter] = {}
            for _, name, doc, labels in self._HOST_COUNTERS:
                if name not in made:
                    made[name] = Counter(f"tokenfab:host_experts_{name}", doc, ["model_name", *labels],
                                         registry=self.registry)
            resident = Gauge("tokenfab:host_experts_resident_bytes", "Bytes of expert weights kept in host memory.",
                             ["model_name"], registry=self.registry)
            self._host = (made, resident, {key: 0.0 for key, *_ in self._HOST_COUNTERS})
            for key, name, _, labels in self._HOST_COUNTERS:
                made[name].labels(m, *labels.values()).inc(0)
        made, resident, seen = self._host
        for key, name, _, labels in self._HOST_COUNTERS:
            cur = float(hs.get(key, 0))
            if cur > seen[key]:
                made[name].labels(m, *labels.values()).inc(cur - seen[key])
                seen[key] = cur
        resident.labels(m).set(hs.get("resident_bytes", 0))

    def render(self, stats: dict) -> bytes:
        """The Prometheus text exposition, after syncing with ``stats``."""
        self.sync(stats)
        return generate_latest(self.registry)
