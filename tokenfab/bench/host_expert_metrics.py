"""The host-offloaded experts' time split, read from the server's ``/metrics`` before and after a benchmark run
(counters ``tokenfab:host_experts_*``, tokenfab/server/metrics.py). The section appears only when the server runs
host experts (``tokenfab serve --host-experts ...``) and ran forward passes during the run.

Per forward pass (one engine step's model call; rank 0 under tensor parallel), in milliseconds: device-expert
compute, host-expert compute (on the host worker, overlapped with the device side), copies (gathering the host
rows, device -> host, host -> device, putting them back), and the device side's wait for the host after its own
experts were done. ``host_experts_exposed_ms`` = copies + wait: what the offload adds to a step beyond the device's
own expert time. Also the share of routed pairs computed on the host and the activation bytes copied.
"""
from __future__ import annotations

import urllib.request

_PREFIX = "tokenfab:host_experts_"


def fetch_host_expert_counters(base_url: str, timeout: float = 5.0) -> dict | None:
    """{"device_seconds", "host_seconds", "copy_seconds", "wait_seconds", "forward_passes", "pairs_device",
    "pairs_host", "bytes_to_host", "bytes_to_device", "resident_bytes"} summed over label sets, or None when the
    server exports none (no host experts, or no /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 (no /metrics: no section)
        return None
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith(_PREFIX):
                continue
            name = s.name[len(_PREFIX):]
            name = name[:-6] if name.endswith("_total") else name
            if name == "routed_pairs":
                name = f"pairs_{s.labels.get('side', '')}"
            elif name == "copied_bytes":
                name = f"bytes_{s.labels.get('direction', '')}"
            out[name] = out.get(name, 0.0) + s.value
    return out or None


def host_experts_result(before: dict | None, after: dict | None) -> dict | None:
    """Result keys from two counter snapshots, or None when no forward pass ran host experts in between."""
    if before is None or after is None:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    passes = d.get("forward_passes", 0.0)
    if passes <= 0:
        return None
    pairs = d.get("pairs_device", 0.0) + d.get("pairs_host", 0.0)
    ms = {k: 1e3 * d.get(f"{k}_seconds", 0.0) / passes for k in ("device", "host", "copy", "wait")}
    return {"host_experts_forward_passes": int(passes),
            "host_experts_device_ms_per_pass": ms["device"], "host_experts_host_ms_per_pass": ms["host"],
            "host_experts_copy_ms_per_pass": ms["copy"], "host_experts_wait_ms_per_pass": ms["wait"],
            "host_experts_exposed_ms_per_pass": ms["copy"] + ms["wait"],
            "host_experts_host_pair_share": d.get("pairs_host", 0.0) / pairs if pairs else 0.0,
            "host_experts_routed_pairs": int(pairs),
            "host_experts_bytes_to_host": int(d.get("bytes_to_host", 0.0)),
            "host_experts_bytes_to_device": int(d.get("bytes_to_device", 0.0)),
            "host_experts_resident_bytes": int(after.get("resident_bytes", 0.0))}


def format_host_experts(result: dict, fmt_line) -> list[str]:
    """The "Host Experts" lines of the result block (empty without host-expert keys)."""
    if "host_experts_forward_passes" not in result:
        return []
    return ["{s:{c}^{n}}".format(s="Host Experts (per forward pass)", n=50, c="-"),
            fmt_line("Forward passes:", result["host_experts_forward_passes"]),
            fmt_line("Device experts (ms):", result["host_experts_device_ms_per_pass"], ".3f"),
            fmt_line("Host experts (ms, overlapped):", result["host_experts_host_ms_per_pass"], ".3f"),
            fmt_line("Copies (ms):", result["host_experts_copy_ms_per_pass"], ".3f"),
            fmt_line("Wait for host (ms):", result["host_experts_wait_ms_per_pass"], ".3f"),
            fmt_line("Host share of routed pairs (%):", 100.0 * result["host_experts_host_pair_share"], ".1f"),
            fmt_line("Bytes to host / to device:", f"{result['host_experts_bytes_to_host']:,} / "
                                                   f"{result['host_experts_bytes_to_device']:,}"),
            fmt_line("Host-resident expert MiB:", result["host_experts_resident_bytes"] / 2**20, ".1f")]
