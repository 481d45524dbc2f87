"""Timing engine decode steps for the offline benchmarks (shared by logits_processors_overhead.py,
batch_invariant.py, structured_output_overhead.py, spec_decode.py, spec_dspark.py and experiments/decode_profile.py).

Requests are added straight to an ``LLMEngine`` and stepped until each sequence sampled its first token, so the
timed steps are decode steps of exactly those sequences.
"""
from __future__ import annotations

import statistics
import time


def start_requests(engine, prompts: list[list[int]], params, prefix: str = "bench") -> list[str]:
    """Add one request per prompt (token ids) with ``params`` and step until every sequence sampled once (prefill
    done, chunked as the scheduler likes); returns the request ids."""
    ids = []
    for i, p in enumerate(prompts):
        rid = f"{prefix}-{time.monotonic_ns()}-{i}"
        engine.add_request(rid, None, p, params)
        ids.append(rid)
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
        engine.step()
    return ids


def median_decode_ms(engine, prompts: list[list[int]], params, steps: int, warmup: int = 3) -> float:
    """Median wall time (ms) of ``steps`` decode steps of ``len(prompts)`` sequences with ``params`` (after
    ``warmup`` untimed ones); the requests are aborted afterwards."""
    ids = start_requests(engine, prompts, params)
    times = step_seconds(engine, steps, warmup)
    for rid in ids:
        engine.abort_request(rid)
    return 1e3 * statistics.median(times)


def step_seconds(engine, steps: int, warmup: int = 0) -> list[float]:
    """Wall seconds (perf_counter) of each of ``steps`` engine steps, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times
