"""``tokenfab bench``: client-side serving benchmarks for any OpenAI-compatible server.

The workload and metric definitions follow vLLM's ``vllm bench serve`` (random, sharegpt and custom datasets,
TTFT / TPOT / ITL / E2EL, goodput, throughputs over the benchmark duration, the same flag names and JSON key names)
so that numbers compare with published ones and pasted ``vllm bench serve`` command lines run unchanged.

Modules (one concept each):

- :mod:`tokenfab.bench.datasets` -- the random, sharegpt and custom datasets (prompt text, prompt length, expected
  output length).
- :mod:`tokenfab.bench.request`  -- one streamed HTTP request -> :class:`~tokenfab.bench.request.RequestRecord`.
- :mod:`tokenfab.bench.metrics`  -- pure math from records to the metrics dict (no I/O).
- :mod:`tokenfab.bench.serve`    -- orchestration: arrivals, concurrency, progress, print, save;
  :func:`tokenfab.bench.serve.run_bench_serve`.

Importing this package is cheap (no torch / transformers / httpx at import time).
"""
from __future__ import annotations


class BenchError(ValueError):
    """A benchmark input or setup problem reported as one line (names the flag at fault); no stack trace."""

    user_error = True


__all__ = ["BenchError"]
