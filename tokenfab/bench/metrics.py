"""Serving metrics from per-request records: pure math, no I/O.

Definitions follow vLLM's ``vllm bench serve`` (vllm/benchmarks/serve.py, ``calculate_metrics``) so numbers
compare with published ones:

- TTFT (s) = first non-empty text chunk arrival - request send time, one value per successful request.
- E2EL (s) = last text chunk arrival - request send time (the request "latency").
- TPOT (s) = (E2EL - TTFT) / (output_tokens - 1), per successful request with output_tokens > 1 only.
- ITL (s): every gap between consecutive text chunks, pooled over all successful requests (a chunk carrying
  several tokens counts as one gap, as in vLLM).
- output_tokens: the server's ``usage.completion_tokens``; when absent, the tokenizer count of the generated text.
- Throughputs divide by the benchmark duration (first send to last completion, s):
  request_throughput = completed / duration (req/s); output_throughput = total output tokens / duration (tok/s);
  total_token_throughput = (total input + total output tokens) / duration (tok/s). The per-device variants divide
  further by ``num_devices``.
- Summaries are reported in milliseconds: mean, median, population std (numpy ``std``), and percentiles by
  linear interpolation (numpy ``percentile`` default). An empty list summarizes as 0, as in vLLM.
- Failed requests count in ``failed``, contribute 0 output tokens and nothing to the latency statistics or the
  input-token total.
- request_goodput (req/s) = successful requests meeting every service-level objective / duration (vLLM's
  ``--goodput``, after DistServe): a request is good when ``value <= SLO`` for each of its TTFT, TPOT and E2EL
  objectives given (milliseconds); a request with one output token has TPOT 0 for this test. None when no
  objective is given.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # request-level metrics an SLO can bound (vLLM's VALID_NAMES)


def percentile_key(p: float) -> str:
    """``99 -> "p99"``, ``99.9 -> "p99.9"`` (vLLM's key spelling)."""
    return f"p{int(p)}" if float(p) == int(p) else f"p{p}"


def _percentile(sorted_vals: Sequence[float], p: float) -> float:
    """Linear-interpolation percentile (numpy's default method): rank = p/100 * (n - 1)."""
    n = len(sorted_vals)
    if n == 0:
        return 0.0
    rank = (p / 100.0) * (n - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, n - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (rank - lo)


def summarize_ms(values_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """Mean, median, population std and percentiles of ``values_s`` (seconds), returned in milliseconds.

    Keys: ``mean``, ``median``, ``std`` and ``percentile_key(p)`` for each p. Empty input gives zeros.
    """
    vals = sorted(float(v) for v in values_s)
    n = len(vals)
    out: dict[str, float] = {}
    if n == 0:
        out.update(mean=0.0, median=0.0, std=0.0)
    else:
        mean = sum(vals) / n
        out["mean"] = mean * 1000.0
        out["median"] = _percentile(vals, 50.0) * 1000.0
        out["std"] = math.sqrt(sum((v - mean) ** 2 for v in vals) / n) * 1000.0
    for p in percentiles:
        out[percentile_key(p)] = _percentile(vals, float(p)) * 1000.0
    return out


def peak_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Largest number of half-open ``[start, end)`` intervals (seconds) that overlap at any instant."""
    events = sorted((t, d) for s, e in intervals for t, d in ((s, 1), (e, -1)))
    cur = peak = 0
    for _, d in events:  # at equal times -1 sorts before +1: a request ending lets the next start
        cur += d
        peak = max(peak, cur)
    return peak


def steady_state_window(intervals: Sequence[tuple[float, float]], concurrency: int | None = None
                        ) -> tuple[float, float] | None:
    """The span in which the benchmark runs at its target concurrency (tokenfab's addition to vLLM's metrics).

    ``intervals`` are per-request ``[send, end)`` times (s). The target level is
    ``min(concurrency, len(intervals))`` when ``concurrency`` (``--max-concurrency``) is given, else the peak
    concurrency. Returns ``(start, end)``: from the first instant that many requests are in flight to the last
    instant they still are (the ramp-up before and the drain after are excluded). None when the level is never
    reached or the span is empty.
    """
    if not intervals:
        return None
    level = min(int(concurrency), len(intervals)) if concurrency else peak_concurrency(intervals)
    if level < 1:
        return None
    events = sorted((t, d) for s, e in intervals for t, d in ((s, 1), (e, -1)))
    cur = 0
    start = end = None
    for t, d in events:
        before = cur
        cur += d
        if start is None and cur >= level:
            start = t
        if before >= level > cur:
            end = t
    if start is None or end is None or end <= start:
        return None
    return (start, end)


def steady_state_throughputs(records: Sequence[Any], output_lens: Sequence[int],
                             window: tuple[float, float]) -> dict[str, float]:
    """Throughputs inside ``window = (start, end)`` (perf-counter seconds, half-open), tokenfab's addition.

    Each successful request's ``output_lens[i]`` tokens are spread evenly over its text chunks and counted where
    the chunks arrived; its prompt tokens count when its first token arrived (prefill done); it counts as a
    completed request when its last token arrived. Returns ``steady_duration`` (s),
    ``steady_request_throughput`` (req/s), ``steady_output_throughput`` and ``steady_total_token_throughput``
    (tok/s).
    """
    a, b = window
    dur = b - a
    if dur <= 0:
        raise ValueError(f"empty window {window}")
    out_tok = 0.0
    in_tok = 0
    done = 0
    for r, n_out in zip(records, output_lens):
        if not r.success:
            continue
        if r.chunk_times:
            per_chunk = n_out / len(r.chunk_times)
            out_tok += per_chunk * sum(1 for dt in r.chunk_times if a <= r.send_time + dt < b)
        if a <= r.first_token_time < b:
            in_tok += int(r.prompt_len)
        if a <= r.last_token_time < b:
            done += 1
    return {
        "steady_duration": dur,
        "steady_request_throughput": done / dur,
        "steady_output_throughput": out_tok / dur,
        "steady_total_token_throughput": (in_tok + out_tok) / dur,
    }


def max_output_chunks_per_s(records: Sequence[Any]) -> float:
    """Peak generated-chunk rate in any whole 1-second bucket since the first send (vLLM's
    ``max_output_tokens_per_s``, which counts one token per streamed chunk)."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0
    t0 = min(r.send_time for r in ok)
    buckets: dict[int, int] = {}
    for r in ok:
        for dt in r.chunk_times:
            b = int(r.send_time + dt - t0)
            buckets[b] = buckets.get(b, 0) + 1
    return float(max(buckets.values())) if buckets else 0.0


def count_good_requests(per_request: Sequence[dict[str, float]], slos_ms: dict[str, float]) -> int:
    """How many requests meet every objective: ``per_request[i][name] <= slos_ms[name] / 1000`` for each name.

    Args:
        per_request: one dict per successful request with ``ttft``, ``tpot`` and ``e2el`` in seconds (``tpot`` 0
            for a one-token output, as vLLM counts it).
        slos_ms: objectives in milliseconds, keys from :data:`GOODPUT_METRICS`.

    Raises:
        ValueError: an objective name outside :data:`GOODPUT_METRICS`.
    """
    bad = [k for k in slos_ms if k not in GOODPUT_METRICS]
    if bad:
        raise ValueError(f"unknown goodput metric(s) {bad}; choose from {', '.join(GOODPUT_METRICS)}")
    limits = {k: float(v) / 1000.0 for k, v in slos_ms.items()}
    return sum(1 for r in per_request if all(r[k] <= lim for k, lim in limits.items()))


def compute_metrics(
    records: Sequence[Any],
    duration_s: float,
    percentiles: Iterable[float] = (99,),
    count_tokens: Callable[[str], int] | None = None,
    num_devices: int = 1,
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Aggregate per-request records into vLLM-named metrics.

    Args:
        records: :class:`tokenfab.bench.request.RequestRecord` (or objects with the same fields) in request order.
        duration_s: benchmark duration in seconds (first send to last completion).
        percentiles: percentiles to report, e.g. ``(50, 90, 99)``.
        count_tokens: ``text -> token count`` used when a successful record has no ``output_tokens`` (no usage
            chunk); without it such a request counts as 1 token (vLLM's fallback without a tokenizer).
        num_devices: accelerators serving the model, for the ``*_per_device`` throughputs.
        goodput_slos_ms: service-level objectives in ms (``{"ttft": 500, "tpot": 50}``); None or empty: no
            goodput (``request_goodput`` is None).

    Returns:
        A dict with ``completed``, ``failed``, ``total_input_tokens``, ``total_output_tokens``,
        ``request_throughput`` and ``request_goodput`` (req/s), ``output_throughput`` / ``total_token_throughput``
        (tok/s) and their ``*_per_device`` variants, per-request lists (``input_lens``, ``output_lens``, ``ttfts``,
        ``itls``, ``latencies``, ``tpots``; seconds), ``max_concurrent_requests``, ``max_output_tokens_per_s`` and,
        for each of ttft/tpot/itl/e2el, ``mean_X_ms``, ``median_X_ms``, ``std_X_ms`` and ``pNN_X_ms``.
    """
    percentiles = [float(p) for p in percentiles]
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    output_lens: list[int] = []
    per_request: list[dict[str, float]] = []
    completed = failed = total_input = 0
    for r in records:
        if not r.success:
            failed += 1
            output_lens.append(0)
            continue
        n_out = r.output_tokens
        if n_out is None:
            n_out = count_tokens(r.generated_text) if count_tokens is not None else 1
        n_out = int(n_out)
        output_lens.append(n_out)
        completed += 1
        total_input += int(r.prompt_len)
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        itls.extend(r.itl)
        tpot = (r.latency - r.ttft) / (n_out - 1) if n_out > 1 else 0.0
        if n_out > 1:
            tpots.append(tpot)
        per_request.append({"ttft": r.ttft, "tpot": tpot, "e2el": r.latency})
    total_output = sum(output_lens)
    goodput = None
    if goodput_slos_ms:
        goodput = count_good_requests(per_request, goodput_slos_ms) / duration_s
    m: dict[str, Any] = {
        "completed": completed,
        "failed": failed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": goodput,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "num_devices": int(num_devices),
        "output_throughput_per_device": total_output / duration_s / num_devices,
        "total_token_throughput_per_device": (total_input + total_output) / duration_s / num_devices,
        "input_lens": [int(r.prompt_len) for r in records],
        "output_lens": output_lens,
        "ttfts": [r.ttft if r.success else 0.0 for r in records],
        "itls": [list(r.itl) if r.success else [] for r in records],
        "latencies": [r.latency if r.success else 0.0 for r in records],
        "tpots": tpots,
        "max_concurrent_requests": peak_concurrency(
            (r.send_time, r.end_time) for r in records if r.success),
        "max_output_tokens_per_s": max_output_chunks_per_s(records),
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, value in summarize_ms(vals, percentiles).items():
            m[f"{stat}_{name}_ms"] = value
    return m
