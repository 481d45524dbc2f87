"""Quick probe: one weight [1024, 4096] (L3-resident), one input row, best of 200 calls per format: bf16 VNNI GEMV vs
the packed GGUF GEMVs. ``python benchmarks/gguf_linear_probe.py THREADS``. benchmarks/gguf_linear.py is the full
side-by-side run (many distinct weights streamed from memory, prefill rows too)."""
import torch, time, numpy as np, sys
sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), ".."))
from benchmarks.gguf_linear import random_rows
from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni
from tokenfab.quant.gguf_weight import GGUFWeight
torch.set_num_threads(int(sys.argv[1]))
rng = np.random.default_rng(0)
n, k = 1024, 4096
x = torch.randn(1, k, dtype=torch.bfloat16)
wb = cpu_vnni.pack_linear_weight(torch.randn(n, k, dtype=torch.bfloat16))
def bench(fn, reps=200):
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter(); fn(); best = min(best, time.perf_counter()-t)
    return best
tb = bench(lambda: cpu_vnni.vnni_linear(x, wb, n))
print(f"bf16 {tb*1e6:.1f}us {n*k*2/tb/1e9:.1f}GB/s")
for fmt in ("Q8_0", "Q4_0", "Q4_1"):
    w = GGUFWeight.from_rows(random_rows(fmt, n, k, rng), fmt, k)
    t = bench(lambda: cpu_gguf.gguf_linear(x, w.tiles, w.block.ggml_type, n))
    print(f"{fmt} {t*1e6:.1f}us {w.nbytes/t/1e9:.1f}GB/s  {n*k/t/1e9:.1f} Gweights/s")
