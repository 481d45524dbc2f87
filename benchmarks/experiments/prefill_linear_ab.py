"""Interleaved A/B, thread CPU time, one thread: SmolLM2-135M's four prefill linears at M = 1024 / 2048 rows, bf16
kernels vs the packed Q4_1 kernel vs dequantize-to-bf16 (C++ gguf_embedding over every row) + the bf16 GEMM, on random
Q4_1 weights of the model's shapes. Read by benchmarks/results/2026-12-02-prefill-vs-peers-profile.md.

    .venv/bin/python benchmarks/experiments/prefill_linear_ab.py OUT.json
"""
import time, torch, json, sys
import torch.nn.functional as F
torch.set_num_threads(1)
torch.manual_seed(0)
from tokenfab.kernels.cpu.ops import gguf_embedding as cpu_gguf_embedding
from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni
from tokenfab.quant.gguf_weight import GGUFWeight

def once(fn):
    t = time.thread_time(); fn(); return time.thread_time() - t

def q41_raw(out, inn):
    nb = inn // 32
    raw = torch.randint(0, 256, (out, nb, 20), dtype=torch.uint8)
    raw[:, :, 0:2] = (torch.rand(out, nb) * 0.01 + 0.001).half().view(torch.uint8).view(out, nb, 2)
    raw[:, :, 2:4] = (-torch.rand(out, nb) * 0.05).half().view(torch.uint8).view(out, nb, 2)
    return raw.reshape(out, nb * 20)

out = {}
for M in (1024, 2048):
    for name, (N, K) in {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}.items():
        x = torch.randn(M, K).bfloat16()
        gw = GGUFWeight.from_rows(q41_raw(N, K), "Q4_1", K); gw.prepare()
        ids = torch.arange(N)
        W = cpu_gguf_embedding.gguf_embedding(gw.tiles, gw.block.ggml_type, N, ids, torch.bfloat16).contiguous()
        vp = cpu_vnni.pack_linear_weight(W)
        v = {"bf16 vnni_linear (tokenfab bf16)": lambda: cpu_vnni.vnni_linear(x, vp, N),
             "bf16 F.linear (oneDNN matmul)": lambda: F.linear(x, W),
             "Q4_1 gguf_linear AMX (tokenfab GGUF)": lambda: gw.linear(x, None),
             "Q4_1 dequant C++ -> bf16 [N,K] only": lambda: cpu_gguf_embedding.gguf_embedding(gw.tiles, gw.block.ggml_type, N, ids, torch.bfloat16),
             "Q4_1 dequant C++ + F.linear": lambda: F.linear(x, cpu_gguf_embedding.gguf_embedding(gw.tiles, gw.block.ggml_type, N, ids, torch.bfloat16))}
        for f in v.values(): f()
        ts = {n: [] for n in v}
        for r in range(5):
            for n, f in v.items(): ts[n].append(once(f))
        fl = 2 * M * N * K
        for n, t in ts.items():
            t.sort(); m = t[2]
            out[f"{name} M={M} {n}"] = {"median_cpu_ms": round(m * 1e3, 3), "gflops": round(fl / m / 1e9, 1)}
            print(f"{name:8s} M={M} {n:40s} {m*1e3:8.3f} ms {fl/m/1e9:7.1f} GFLOP/s {[round(a*1e3,2) for a in t]}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
