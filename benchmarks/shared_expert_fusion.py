"""Shared expert fused into the routed-expert dispatch (one more "expert" with weight 1 per token) against the
separate shared MLP plus an add, on one DeepSeek-V3 MoE layer of the embedded default model (bf16, CPU).

    .venv/bin/python benchmarks/shared_expert_fusion.py

Prints the max output difference and the median time per layer call of both, alternated 15 x 50 calls, at T = 1,
4, 16 tokens. Result and decision: benchmarks/NOTES.md entry 28.
"""
import argparse
import statistics
import time

import torch
from tokenfab import LLM
from tokenfab.default_model import ensure_default_model
from tokenfab.models.deepseek_v3 import DeepseekV3MoE
from tokenfab.kernels import cpu_kernels
argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
llm = LLM(ensure_default_model(), max_model_len=256, max_num_seqs=1, progress=False)
moe = next(m for m in llm.llm_engine.runner.model.modules() if isinstance(m, DeepseekV3MoE))
ex, sh = moe.experts, moe.shared_experts
E = ex.num_experts
p13 = ex._p13 + [sh.gate_up._packed]; p2 = ex._p2 + [sh.down_proj._packed]
def fused(x):
    w, ids = moe.gate(x)
    T = x.shape[0]
    ids2 = torch.cat([ids, torch.full((T, 1), E, dtype=ids.dtype)], 1)
    w2 = torch.cat([w, torch.ones(T, 1)], 1)
    return cpu_kernels.moe_experts_packed(x, w2, ids2, p13, p2, 0)
with torch.inference_mode():
  for T in (1, 4, 16):
    x = torch.randn(T, 768, dtype=torch.bfloat16)
    a, b = moe(x), fused(x)
    print("T", T, "maxdiff", (a.float()-b.float()).abs().max().item(), "scale", a.float().abs().max().item())
    ta, tb = [], []
    for r in range(15):
        for f, acc in ((moe, ta), (fused, tb)) if r % 2 else ((fused, tb), (moe, ta)):
            t = time.perf_counter()
            for _ in range(50): f(x)
            acc.append((time.perf_counter() - t) / 50 * 1e6)
    print(f"T {T}: separate {statistics.median(ta):.0f} us, fused {statistics.median(tb):.0f} us, ratio {statistics.median(tb)/statistics.median(ta):.3f}")
