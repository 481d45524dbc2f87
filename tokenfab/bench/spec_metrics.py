"""Speculative-decoding acceptance as ``vllm bench serve`` reports it: the server's ``/metrics`` counters
(``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens`` /
``_num_accepted_tokens_per_pos{position}``) read before and after the run; the section appears only when the
server exports them and drafted during the run.

acceptance rate = accepted / draft tokens; acceptance length = 1 + accepted / drafts (tokens per verification,
the bonus included); per-position rate j = accepted at position j / drafts.
"""
from __future__ import annotations

import urllib.request

_NAMES = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
          "vllm:spec_decode_num_accepted_tokens": "accepted"}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def fetch_spec_counters(base_url: str, timeout: float = 5.0) -> dict | None:
    """The server's spec-decode counters (summed over label sets) or None when /metrics is missing or has none.

    Returns: {"drafts", "draft_tokens", "accepted": float, "per_pos": {position: float}}.
    """
    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 (no /metrics: no section)
        return None
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    seen = False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name[:-6] if s.name.endswith("_total") else s.name
            if name in _NAMES:
                out[_NAMES[name]] += s.value
                seen = True
            elif name == _PER_POS and "position" in s.labels:
                pos = int(s.labels["position"])
                out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + s.value
    return out if seen else None


def spec_decode_result(before: dict | None, after: dict | None) -> dict | None:
    """vLLM's result keys from two counter snapshots, or None when nothing was drafted in between."""
    if before is None or after is None:
        return None
    drafts = after["drafts"] - before["drafts"]
    draft_tokens = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted"] - before["accepted"]
    if drafts <= 0 or draft_tokens <= 0:
        return None
    positions = sorted(after["per_pos"])
    per_pos = [(after["per_pos"][j] - before["per_pos"].get(j, 0.0)) / drafts for j in positions]
    return {"spec_decode_acceptance_rate": 100.0 * accepted / draft_tokens,
            "spec_decode_acceptance_length": 1.0 + accepted / drafts,
            "spec_decode_num_drafts": int(drafts), "spec_decode_draft_tokens": int(draft_tokens),
            "spec_decode_accepted_tokens": int(accepted),
            "spec_decode_per_position_acceptance_rates": per_pos}


def format_spec_decode(result: dict, fmt_line) -> list[str]:
    """The "Speculative Decoding" lines of the result block (empty without spec-decode keys)."""
    if "spec_decode_acceptance_rate" not in result:
        return []
    lines = ["{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"),
             fmt_line("Acceptance rate (%):", result["spec_decode_acceptance_rate"], ".2f"),
             fmt_line("Acceptance length:", result["spec_decode_acceptance_length"], ".2f"),
             fmt_line("Drafts:", result["spec_decode_num_drafts"]),
             fmt_line("Draft tokens:", result["spec_decode_draft_tokens"]),
             fmt_line("Accepted tokens:", result["spec_decode_accepted_tokens"])]
    rates = result.get("spec_decode_per_position_acceptance_rates") or []
    if rates:
        lines.append("Per-position acceptance (%):")
        for j, r in enumerate(rates):
            lines.append(fmt_line(f"  Position {j}:", 100.0 * r, ".2f"))
    return lines
