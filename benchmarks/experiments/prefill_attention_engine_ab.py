"""SmolLM2-135M prefill engine steps (bf16 folder or packed Q4_1 GGUF; 2 x 1024-token prompts, the serve budget 2048)
with tokenfab's prefill attention as shipped vs two replacements patched in for this process only: SDPA per query
block with its mask (``paged_attention._prefill_attention``) and one SDPA flash call (``is_causal``) when every
sequence of the group is a whole prompt from position 0 of the same length (else the shipped path). Interleaved
rounds, thread CPU time of ``engine.step()`` (one thread); also checks that each variant samples the same first
tokens (greedy). Read by benchmarks/results/2026-12-02-prefill-vs-peers-profile.md.

    .venv/bin/python benchmarks/experiments/prefill_attention_engine_ab.py bf16|gguf [rounds]
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from prefill_vs_peers_profile import build, prompts  # noqa: E402

from tokenfab import SamplingParams  # noqa: E402
from tokenfab.layers import paged_attention as pa  # noqa: E402

SHIPPED = pa._prefill_attention_fused


def flash_when_whole(q, k, v, group, scale):
    """One causal SDPA call when the group holds whole prompts from position 0, all of length Q; else shipped."""
    B, H, Q, D = q.shape
    qp = group.query_pos
    if bool((qp[:, 0] == 0).all()) and bool((qp[:, -1] == Q - 1).all()) and k.shape[2] >= Q:
        return F.scaled_dot_product_attention(q, k[:, :, :Q], v[:, :, :Q], is_causal=True, scale=scale,
                                              enable_gqa=H != k.shape[1])
    return SHIPPED(q, k, v, group, scale)


VARIANTS = {"shipped (fused)": SHIPPED, "sdpa block mask": pa._prefill_attention, "sdpa flash when whole": flash_when_whole}


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    eng = build(kind, 2048, 1040).llm_engine
    salt = [500]

    def run():
        salt[0] += 1
        ids = []
        for i, p in enumerate(prompts(2, 1024, 7)):  # the same prompts every run: tokens comparable
            rid = f"a{salt[0]}-{i}"
            ids.append(rid)
            eng.add_request(rid, None, p, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
        cpu, toks = 0.0, {}
        while eng.has_unfinished_requests():
            t = time.thread_time()
            outs = eng.step()
            cpu += time.thread_time() - t
            for o in outs or []:
                if getattr(o, "finished", False):
                    toks[o.request_id] = list(o.outputs[0].token_ids)
        return cpu, [toks.get(r) for r in ids]

    run()
    res = {n: [] for n in VARIANTS}
    first = {}
    for _ in range(rounds):
        for n, f in VARIANTS.items():
            pa._prefill_attention_fused = f
            cpu, toks = run()
            res[n].append(round(cpu, 3))
            first.setdefault(n, toks)
            print(kind, n, round(cpu, 3), toks, flush=True)
    pa._prefill_attention_fused = SHIPPED
    med = {n: sorted(v)[len(v) // 2] for n, v in res.items()}
    base = med["shipped (fused)"]
    print(json.dumps({"model": kind, "cpu_s": res, "median_cpu_s": med,
                      "speedup_vs_shipped": {n: round(base / m, 2) for n, m in med.items()},
                      "same_first_tokens": {n: first[n] == first["shipped (fused)"] for n in first}}))


if __name__ == "__main__":
    main()
