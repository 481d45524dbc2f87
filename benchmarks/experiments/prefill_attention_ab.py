"""Interleaved A/B, thread CPU time, one thread: one SmolLM2-135M layer's prefill attention at 1024 tokens (B = 1, 2;
tokenfab's fused path, its SDPA-with-block-mask path, one SDPA flash call), the fused path's parts, and the glue ops.
Read by benchmarks/results/2026-12-02-prefill-vs-peers-profile.md.

    .venv/bin/python benchmarks/experiments/prefill_attention_ab.py OUT.json
"""
import time, types, torch, json, sys
import torch.nn.functional as F
torch.set_num_threads(1)
from tokenfab.kernels.cpu.ops import attention as cpu_attention
from tokenfab.kernels.cpu.ops import norms_activations as cpu_norms
from tokenfab.layers import paged_attention as pa
from tokenfab.layers.norm import RMSNorm

def once(fn):
    t = time.thread_time(); fn(); return time.thread_time() - t

out = {}
for B in (1, 2):
    L = 1024
    q = torch.randn(B, 9, L, 64).bfloat16(); k = torch.randn(B, 3, L, 64).bfloat16(); v = torch.randn(B, 3, L, 64).bfloat16()
    g = types.SimpleNamespace(query_pos=torch.arange(L).expand(B, L).contiguous(), q_len=L, max_context=L)
    variants = {
        "fused (tokenfab default: 256-query blocks, bmm + causal_softmax_)": lambda: pa._prefill_attention_fused(q, k, v, g, 0.125),
        "sdpa per 256-query block + block mask (tokenfab non-fused path)": lambda: pa._prefill_attention(q, k, v, g, 0.125),
        "sdpa one call, is_causal, enable_gqa (flash)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True),
    }
    for f in variants.values(): f()
    ts = {n: [] for n in variants}
    for r in range(5):
        for n, f in variants.items():
            ts[n].append(once(f))
    fl = 4 * B * 9 * 64 * L * (L + 1) / 2
    for n, t in ts.items():
        t.sort(); m = t[2]
        out[f"attn B={B} {n}"] = {"median_cpu_ms": round(m * 1e3, 2), "all_ms": [round(x * 1e3, 2) for x in t], "gflops": round(fl / m / 1e9, 1)}
        print(f"attn B={B} {n:70s} {m*1e3:7.2f} ms  {fl/m/1e9:6.1f} GFLOP/s  {[round(x*1e3,1) for x in t]}", flush=True)
# glue, 1024 tokens, one layer
T = 1024
gu = torch.randn(T, 3072).bfloat16(); h = torch.randn(T, 576).bfloat16(); res = torch.randn(T, 576).bfloat16()
norm = RMSNorm(576, eps=1e-5)
norm.weight.data = torch.ones(576, dtype=torch.bfloat16)
glue = {"silu_and_mul [1024,3072]": lambda: cpu_norms.silu_and_mul(gu),
        "rmsnorm [1024,576]": lambda: norm(h),
        "rmsnorm + residual [1024,576]": lambda: norm(h, res)}
for n, f in glue.items():
    f(); t = sorted(once(f) for _ in range(7)); out[n] = round(t[3] * 1e3, 3)
    print(f"{n:40s} {t[3]*1e3:7.3f} ms", flush=True)

# the fused path's parts, B = 1 (thread CPU per layer, repeats 2-4)
B, L, Hk, G, D = 1, 1024, 3, 3, 64
q = torch.randn(B, Hk * G, L, D).bfloat16(); k = torch.randn(B, Hk, L, D).bfloat16(); v = torch.randn(B, Hk, L, D).bfloat16()
qpos = torch.arange(L).expand(B, L).contiguous()
tot = {"qk matmul": 0.0, "causal_softmax_": 0.0, "pv matmul": 0.0}
for rep in range(4):
    if rep == 1: tot = {kk: 0.0 for kk in tot}
    for q0 in range(0, L, 256):
        q1 = q0 + 256; kend = q1
        qb = q[:, :, q0:q1].reshape(B, Hk, G * 256, D)
        t = time.thread_time(); s = torch.matmul(qb, k[:, :, :kend].transpose(-1, -2)); tot["qk matmul"] += time.thread_time() - t
        t = time.thread_time(); cpu_attention.causal_softmax_(s, qpos[:, q0:q1], 256, 0.125); tot["causal_softmax_"] += time.thread_time() - t
        t = time.thread_time(); o = torch.matmul(s, v[:, :, :kend]); tot["pv matmul"] += time.thread_time() - t
for kk, vv in tot.items():
    out[f"fused parts B=1 {kk} ms per layer"] = round(vv / 3 * 1e3, 2)
    print(f"{kk:16s} {vv/3*1e3:7.2f} ms per layer (1 x 1024, thread CPU time)")
n = sum(3 * 768 * kend for kend in (256, 512, 768, 1024))
print("score elements per layer", n, "flops per GEMM", 2 * n * 64)
json.dump(out, open(sys.argv[1], "w"), indent=1)
