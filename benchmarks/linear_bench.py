"""What the CPU linear-kernel benchmarks (linear_kernels.py, fp8_linear.py, gguf_linear.py) share: the check that
the kernels are built, the run's metadata and the timing cells of their tables."""
from __future__ import annotations

import platform
import sys

import torch


def kernels_ready(ready: bool, what: str) -> bool:
    """``ready``; when False, print why to stderr: ``<what> the CPU kernels built with AVX512-BF16: <cause>`` (``what``
    e.g. "the FP8 and VNNI linears need")."""
    if not ready:
        from tokenfab.kernels.cpu import build as cpu_build
        print(f"{what} the CPU kernels built with AVX512-BF16: "
              f"{cpu_build.load_error() or 'this CPU has no AVX512-BF16'}", file=sys.stderr)
    return ready


def run_meta(date: str, script: str, threads: int, *, clock: str | None = None,
             copy_bandwidth: float | None = None) -> dict:
    """The results' ``meta``: date, command line (``script`` and this process's arguments), threads, the clock when
    given, torch version, CPU, and the copy bandwidth (bytes/s, stored as GB/s) when given."""
    meta = {"date": date, "command": " ".join([script] + sys.argv[1:]), "threads": threads}
    if clock is not None:
        meta["clock"] = clock
    meta.update(torch=torch.__version__, cpu=platform.processor() or platform.machine())
    if copy_bandwidth is not None:
        meta["copy_bandwidth_gbs"] = copy_bandwidth / 1e9
    return meta


def bandwidth_header(title: str, meta: dict) -> list[str]:
    """The Markdown head of a run with a measured copy bandwidth: ``# <title> (<date>)``, then the command, threads,
    torch version and copy bandwidth of ``meta`` (:func:`run_meta` with ``copy_bandwidth``)."""
    return [f"# {title} ({meta['date']})", "",
            f"Command: `{meta['command']}`; {meta['threads']} threads; torch {meta['torch']}; copy bandwidth "
            f"{meta['copy_bandwidth_gbs']:.1f} GB/s (read+write).", ""]


def time_rate_cells(r: dict, formats, gemv_rows: int) -> list[str]:
    """One ``µs | rate`` table cell per format of result ``r`` (``n``, ``k``, ``rows``, ``seconds`` and ``bytes``
    per format): GB/s of weight bytes read at most ``gemv_rows`` rows, GFLOP/s above."""
    n, k, rows, s = r["n"], r["k"], r["rows"], r["seconds"]
    cells = []
    for f in formats:
        rate = (f"{r['bytes'][f] / s[f] / 1e9:.1f} GB/s" if rows <= gemv_rows else
                f"{2 * rows * n * k / s[f] / 1e9:.0f} GFLOP/s")
        cells.append(f"{s[f] * 1e6:.1f} | {rate}")
    return cells
