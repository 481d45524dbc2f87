"""Where a decode step's device time goes: torch.profiler over eager decode steps of one sequence.

Used by ``benchmarks/decode_floor.py --profile-steps N`` (after its batch-1 rows, with CUDA graphs switched off in
the same engine so that every kernel is launched from the host and seen): one request with the run's context is
prefilled, one decode step warms up, then N decode steps run under ``torch.profiler``. Reported:

* ``device_ms_per_step``: the sum of the kernels' self device time per step (on CPU: the self CPU time of the ops,
  a dry run whose numbers mean nothing for a GPU), and ``device_ms_per_layer`` (over ``num_hidden_layers``; the LM
  head, embedding and sampling included, so an upper bound of one layer's);
* ``launches_per_step`` and ``launches_per_layer`` (per step over ``num_hidden_layers``): kernel launches (on CPU:
  leaf ``aten::`` op calls, the ops that would each be a kernel on a GPU);
* ``top``: the kernels (by name) with the most device time: ms per step, launches per step, share of the total;
* ``by_kind``: the same split into GEMM / attention / MoE / other (from the kernel names, a heuristic).

:func:`summarize_events` takes plain (name, device us, count) tuples, so the aggregation is tested without a GPU.
(benchmarks/experiments/decode_profile.py is an older CPU experiment: a profiler table and each GEMV's bandwidth.)
"""
from __future__ import annotations

import time

import torch

GEMM_WORDS = ("gemm", "gemv", "matmul", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "addmm", "aten::mm", "bmm",
              "linear")
ATTENTION_WORDS = ("attention", "attn", "flash", "mla_decode", "paged")
MOE_WORDS = ("moe", "expert", "grouped_mm", "router", "topk")


def kind_of(name: str) -> str:
    """``gemm`` / ``attention`` / ``moe`` / ``other`` from a kernel's name (lower-cased substrings; MoE first)."""
    n = name.lower()
    for kind, words in (("moe", MOE_WORDS), ("attention", ATTENTION_WORDS), ("gemm", GEMM_WORDS)):
        if any(w in n for w in words):
            return kind
    return "other"


def summarize_events(events: list[tuple[str, float, int]], steps: int, num_layers: int, top: int = 15) -> dict:
    """Aggregate ``events`` (kernel name, total self device time in microseconds, launch count over ``steps``
    steps) into the per-step numbers of the module docstring. Names repeated in ``events`` are summed.

    Raises:
        ValueError: ``steps`` < 1 or ``num_layers`` < 1.
    """
    if steps < 1 or num_layers < 1:
        raise ValueError(f"steps and num_layers must be >= 1, got {steps} and {num_layers}.")
    by_name: dict[str, list[float]] = {}
    for name, us, count in events:
        acc = by_name.setdefault(name, [0.0, 0])
        acc[0] += float(us)
        acc[1] += int(count)
    total_us = sum(v[0] for v in by_name.values())
    launches = sum(v[1] for v in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    kinds: dict[str, list[float]] = {}
    for name, (us, count) in by_name.items():
        k = kinds.setdefault(kind_of(name), [0.0, 0])
        k[0] += us
        k[1] += count
    return {
        "steps": steps, "num_layers": num_layers,
        "device_ms_per_step": total_us / steps / 1e3,
        "device_ms_per_layer": total_us / steps / num_layers / 1e3,
        "launches_per_step": launches / steps,
        "launches_per_layer": launches / steps / num_layers,
        "top": [{"name": name[:120], "ms_per_step": us / steps / 1e3, "launches_per_step": count / steps,
                 "share": us / total_us if total_us else 0.0, "kind": kind_of(name)}
                for name, (us, count) in ranked[:top]],
        "by_kind": {k: {"ms_per_step": v[0] / steps / 1e3, "launches_per_step": v[1] / steps,
                        "share": v[0] / total_us if total_us else 0.0} for k, v in sorted(kinds.items())},
    }


def _device_events(prof, cuda: bool) -> list[tuple[str, float, int]]:
    """(name, device us, 1) for every kernel a finished profiler saw (device events: CUDA kernels, memcpy and
    memset, ROCm's as CUDA); on CPU (``cuda`` False) every leaf ``aten::`` op (one calling no other aten op) with
    its self CPU time."""
    out = []
    for ev in prof.events():
        if cuda:
            if not str(getattr(ev, "device_type", "")).endswith("CUDA"):
                continue
            us = ev.time_range.elapsed_us()  # a device event's own span (what device_time_total returns for it)
        else:
            if not ev.name.startswith("aten::") or any(c.name.startswith("aten::") for c in ev.cpu_children):
                continue
            us = ev.self_cpu_time_total
        out.append((ev.name, float(us), 1))
    return out


def profile_decode(eng, context: int, steps: int, top: int = 15) -> dict:
    """Run ``steps`` decode steps of one fresh sequence (``context`` prompt tokens) of engine ``eng`` under
    torch.profiler and return :func:`summarize_events`'s dict plus ``wall_ms_per_step`` and ``device``. The caller
    chooses eager or graphs (``eng.runner.decode_graphs``); the request is run to its end before returning.

    Raises:
        ValueError: ``steps`` < 1.
    """
    from torch.profiler import ProfilerActivity, profile

    from tokenfab import SamplingParams
    if steps < 1:
        raise ValueError(f"--profile-steps must be >= 1, got {steps}.")
    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    eng.add_request("profile-0", None, [(11 * j) % 4000 + 5 for j in range(context)],
                    SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    eng.step()  # warm-up decode step
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        wall = time.perf_counter() - t
    while eng.has_unfinished_requests():
        eng.step()
    out = summarize_events(_device_events(prof, cuda), steps, eng.model_config.num_hidden_layers, top)
    out.update({"wall_ms_per_step": wall / steps * 1e3, "device": str(eng.device), "context": context,
                "counted": "CUDA kernels" if cuda else "leaf aten ops on CPU (a dry run)"})
    return out


def profile_markdown(p: dict) -> list[str]:
    """Markdown lines for :func:`profile_decode`'s dict: one summary sentence and the top-kernel table."""
    lines = [f"Eager decode profile (torch.profiler, batch 1, context {p.get('context')}, {p['steps']} steps, "
             f"{p.get('counted', 'kernels')}): device time {p['device_ms_per_step']:.3f} ms per step of "
             f"{p.get('wall_ms_per_step', float('nan')):.3f} ms wall, {p['launches_per_step']:.0f} launches per "
             f"step = {p.get('device_ms_per_layer', 0.0):.3f} ms and {p['launches_per_layer']:.1f} launches per "
             f"layer over {p['num_layers']} layers. By kind: "
             + ", ".join(f"{k} {v['ms_per_step']:.3f} ms ({v['launches_per_step']:.0f} launches)"
                         for k, v in p["by_kind"].items()) + ".", "",
             "| kernel | kind | ms / step | launches / step | share |", "|---|---|---|---|---|"]
    for r in p["top"]:
        name = r["name"].replace("|", "/")
        lines.append(f"| `{name[:80]}` | {r['kind']} | {r['ms_per_step']:.3f} | {r['launches_per_step']:.1f} "
                     f"| {r['share'] * 100:.1f}% |")
    return lines
