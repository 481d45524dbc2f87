"""Shared expert fused into the routed-expert dispatch (one more "expert" with weight 1 per token) against the
separate shared MLP plus an add, on one DeepSeek-V3 MoE layer of the embedded default model (bf16, CPU).

    .venv/bin/python benchmarks/experiments/shared_expert_fusion.py

Prints the max output difference and the median time per layer call of both, alternated 15 x 50 calls, at T = 1,
4, 16 tokens. Result and decision: benchmarks/NOTES.md entry 28.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    from tokenfab import LLM
    from tokenfab.default_model import ensure_default_model
    from tokenfab.kernels.cpu.ops import moe as cpu_moe
    from tokenfab.models.deepseek_v3 import DeepseekV3MoE

    llm = LLM(ensure_default_model(), max_model_len=256, max_num_seqs=1, progress=False)
    moe = next(m for m in llm.llm_engine.runner.model.modules() if isinstance(m, DeepseekV3MoE))
    routed, shared = moe.experts, moe.shared_experts
    # the shared expert as local expert number E of the packed dispatch, weight 1 for every token
    p13 = routed._p13 + [shared.gate_up._packed]
    p2 = routed._p2 + [shared.down_proj._packed]

    def fused(x: torch.Tensor) -> torch.Tensor:
        w, ids = moe.gate(x)
        T = x.shape[0]
        ids = torch.cat([ids, torch.full((T, 1), routed.num_experts, dtype=ids.dtype)], 1)
        w = torch.cat([w, torch.ones(T, 1)], 1)
        return cpu_moe.moe_experts_packed(x, w, ids, p13, p2, 0)

    with torch.inference_mode():
        for T in (1, 4, 16):
            x = torch.randn(T, llm.llm_engine.model_config.hidden_size, dtype=torch.bfloat16)
            a, b = moe(x), fused(x)
            print(f"T {T}: max |diff| {(a.float() - b.float()).abs().max().item():.4f} on outputs up to "
                  f"{a.float().abs().max().item():.3f}")
            times = {"separate": [], "fused": []}
            for r in range(15):  # alternated, 50 calls per sample
                for name, f in (("separate", moe), ("fused", fused)) if r % 2 else (("fused", fused), ("separate", moe)):
                    t = time.perf_counter()
                    for _ in range(50):
                        f(x)
                    times[name].append((time.perf_counter() - t) / 50 * 1e6)
            sep, fus = statistics.median(times["separate"]), statistics.median(times["fused"])
            print(f"T {T}: separate {sep:.0f} us, fused {fus:.0f} us, ratio {fus / sep:.3f}")


if __name__ == "__main__":
    main()
