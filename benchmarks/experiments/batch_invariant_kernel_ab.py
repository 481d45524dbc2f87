"""Default-mode cost of the batch-invariant switch at kernel level: vnni_linear's best time (us, 300 calls, 1 thread)
at decode shapes, for the checkout on PYTHONPATH and its kernel build. Run it alternately for two checkouts:

    for i in 1 2 3; do for t in A B; do PYTHONPATH=$t TOKENFAB_KERNEL_CACHE=<its cache> python \
        benchmarks/experiments/batch_invariant_kernel_ab.py; done; done

Prints one JSON line {"NxK@M": microseconds}.
"""
import torch, time, json, sys
torch.set_num_threads(1)
from tokenfab.kernels.cpu import build as cpu_build
from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni
assert cpu_build.load() is not None, cpu_build.load_error()
torch.manual_seed(0)
out = {}
for (N, K) in [(960, 576), (1536, 576), (576, 1536)]:
    w = torch.randn(N, K).bfloat16(); p = cpu_vnni.pack_linear_weight(w)
    for M in (1, 16):
        x = torch.randn(M, K).bfloat16()
        best = 1e9
        for _ in range(300):
            t = time.perf_counter(); cpu_vnni.vnni_linear(x, p, N); best = min(best, time.perf_counter() - t)
        out[f"{N}x{K}@{M}"] = best * 1e6
print(json.dumps(out))
