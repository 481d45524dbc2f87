"""``tokenfab plan``'s output: a :class:`~tokenfab.planner.memory_planner.MemoryPlan` as a rich table with its verdict
and suggestions, and a device sweep as rows (JSON) and a table."""
from __future__ import annotations

from typing import Any

from tokenfab.planner.memory_planner import MemoryPlan, mem_label


def _fmt_range(r) -> str:
    s, e = r
    return f"{s}:{e}" if e > s else "-"


def render_plan(mp: MemoryPlan, console=None) -> None:
    """Print ``mp`` as a rich table (ranges are [start:end) half-open; sizes in GiB = 2^30 bytes) plus a verdict
    and suggestions."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=140)
    w = mp.weights
    m = mp.model
    title = (f"{m['model_type']} ({m['architecture']}) on {mp.devices} x {mem_label(mp.device_memory_bytes)}\n"
             f"weights {w.weight_format} ("
             + ("read from safetensors headers" if w.source == "safetensors" else "parameter counts from config.json")
             + f"); KV cache {mp.kv_cache_dtype} ({mp.kv_dtype_bytes} B)")
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    mla = m["architecture"] == "DeepseekV3ForCausalLM"
    cols = ["rank", "heads", "kv heads", "experts", "vocab", "weights GiB"]
    if mp.offload_experts:
        cols.append("offloaded GiB")
    hybrid = any(r.state_bytes for r in mp.ranks)
    if hybrid:
        cols.append(f"KDA state GiB ({mp.max_num_seqs} req)")
    cols += ["KV B/token", "reserve GiB", "free GiB", "max KV tokens"]
    for col in cols:
        t.add_column(col, justify="right")
    for r in mp.ranks:
        row = [str(r.rank), _fmt_range(r.ranges["heads"]), "latent" if mla else _fmt_range(r.ranges["kv_heads"]),
               _fmt_range(r.ranges["experts"]), _fmt_range(r.ranges["vocab"]), f"{r.weight_bytes / 2**30:,.1f}"]
        if mp.offload_experts:
            row.append(f"{r.offloaded_bytes / 2**30:,.1f}")
        if hybrid:
            row.append(f"{r.state_bytes / 2**30:,.2f}")
        row += [f"{r.kv_bytes_per_token:,}", f"{r.reserve_bytes / 2**30:,.1f}",
                f"{r.free_bytes_for_kv / 2**30:,.1f}", "-" if r.max_kv_tokens is None else f"{r.max_kv_tokens:,}"]
        t.add_row(*row)
    console.print(t)
    console.print(f"weights: {w.num_params:,} params; {w.total_bytes:,} bytes for one copy, plus "
                  f"{w.replicated_bytes:,} bytes replicated on each further rank")
    console.print(f"KV pool: {mp.max_kv_tokens:,} tokens (the same tokens on every rank; min over ranks)")
    if mp.requested_tokens is not None:
        what = []
        if mp.max_model_len is not None:
            what.append(f"--max-model-len {mp.max_model_len:,}")
        if mp.kv_tokens is not None:
            what.append(f"--kv-tokens {mp.kv_tokens:,}")
        verdict = "[bold green]FITS[/bold green]" if mp.fits else "[bold red]DOES NOT FIT[/bold red]"
        console.print(f"requested {' and '.join(what)}: {verdict}")
    elif not mp.fits:
        console.print("[bold red]DOES NOT FIT[/bold red]: the weights and reserve exceed device memory")
    if mp.min_devices is not None:
        console.print(f"fewest devices of this size that fit: {mp.min_devices}")
    ep = mp.expert_placement
    if ep is not None:
        console.print(f"expert split ({ep.source}): {ep.summary()}")
        for r in mp.ranks:
            s, e = r.ranges["experts"]
            per_layer = [sum(1 for j in ids if s <= j < e) for ids in ep.host.values()] or [0]
            lo, hi = min(per_layer), max(per_layer)
            console.print(f"  rank {r.rank}: experts {s}:{e}, host {lo if lo == hi else f'{lo}-{hi}'} per layer "
                          f"({r.offloaded_bytes / 2**30:,.2f} GiB in host memory), device {e - s - hi}"
                          + ("" if lo == hi else f"-{e - s - lo}") + " per layer")
    for s in mp.suggestions:
        console.print(f"  - {s}")
    for a in mp.assumptions:
        console.print(f"[dim]assumes: {a}[/dim]")


def sweep_rows(plans: list[MemoryPlan]) -> list[dict[str, Any]]:
    """One dict per plan of a sweep (bytes per rank are the fullest rank's): devices, weights, KV bytes of the
    requested tokens (or of the largest pool when none is requested), KDA state, free memory after all of them,
    the largest pool, and whether the request fits."""
    rows = []
    for mp in plans:
        worst = max(mp.ranks, key=lambda r: r.weight_bytes + r.state_bytes)
        kv_tok = max(r.kv_bytes_per_token for r in mp.ranks)
        tokens = mp.requested_tokens if mp.requested_tokens is not None else mp.max_kv_tokens
        kv_bytes = tokens * kv_tok
        rows.append({"devices": mp.devices, "weight_bytes_per_rank": worst.weight_bytes,
                     "kv_bytes_per_token_per_rank": kv_tok, "tokens": tokens, "kv_bytes_per_rank": kv_bytes,
                     "state_bytes_per_rank": worst.state_bytes, "reserve_bytes": mp.reserve_bytes,
                     "headroom_bytes": mp.device_memory_bytes - mp.reserve_bytes - worst.weight_bytes
                     - worst.state_bytes - kv_bytes,
                     "max_kv_tokens": mp.max_kv_tokens, "weights_fit": mp.weights_fit, "fits": mp.fits})
    return rows


def render_sweep(plans: list[MemoryPlan], console=None) -> None:
    """Print a device-count sweep (:func:`plan_device_sweep`) as one table: a row per device count, sizes in
    GiB (2^30 bytes) on the fullest rank, headroom = device memory - reserve - weights - KDA state - KV of the
    requested tokens (negative: does not fit)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=140)
    mp0 = plans[0]
    req = mp0.requested_tokens
    title = (f"{mp0.model['model_type']} ({mp0.model['architecture']}) on N x {mem_label(mp0.device_memory_bytes)}; "
             f"weights {mp0.weights.weight_format}; KV cache {mp0.kv_cache_dtype} ({mp0.kv_dtype_bytes} B); "
             + (f"{req:,} KV tokens requested" if req is not None else "no KV size requested")
             + (f"; KDA state for {mp0.max_num_seqs} request(s)" if any(r.state_bytes for r in mp0.ranks) else ""))
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("devices", "weights GiB/rank", "KV B/token/rank", "KV GiB/rank", "KDA state GiB/rank",
                "reserve GiB", "headroom GiB", "max KV tokens", "fits"):
        t.add_column(col, justify="right")
    for row in sweep_rows(plans):
        t.add_row(str(row["devices"]), f"{row['weight_bytes_per_rank'] / 2**30:,.1f}",
                  f"{row['kv_bytes_per_token_per_rank']:,}", f"{row['kv_bytes_per_rank'] / 2**30:,.1f}",
                  f"{row['state_bytes_per_rank'] / 2**30:,.2f}", f"{row['reserve_bytes'] / 2**30:,.1f}",
                  f"{row['headroom_bytes'] / 2**30:,.1f}", f"{row['max_kv_tokens']:,}",
                  "[bold green]yes[/bold green]" if row["fits"] else "[bold red]no[/bold red]")
    console.print(t)
    for a in mp0.assumptions[1:]:
        console.print(f"[dim]assumes: {a}[/dim]")
