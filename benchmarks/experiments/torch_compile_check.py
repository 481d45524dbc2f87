"""Does torch.compile help tokenfab's CPU decode step? One engine per run, batch 1, 512 context tokens, the median
of 60 decode steps after 8 warm-up steps (which include compilation).

    .venv/bin/python benchmarks/experiments/torch_compile_check.py eager
    TOKENFAB_CPU_LINEAR=torch TOKENFAB_CPU_KERNELS=0 .venv/bin/python benchmarks/experiments/torch_compile_check.py eager
    FREEZE=1 TOKENFAB_CPU_LINEAR=torch TOKENFAB_CPU_KERNELS=0 .venv/bin/python benchmarks/experiments/torch_compile_check.py compile

"compile" wraps the model's forward in ``torch.compile(dynamic=True)`` (Inductor; ``FREEZE=1`` sets
``torch._inductor.config.freezing`` so Inductor packs the weights itself). With tokenfab's own packed linears
Inductor's mkldnn lowering refuses the weights (not graph constants), hence the plain-PyTorch variants. Result and
decision: benchmarks/NOTES.md entry 31.
"""
import os
import statistics
import sys
import time

import torch

mode = sys.argv[1] if len(sys.argv) > 1 else "eager"
if mode not in ("eager", "compile"):
    sys.exit(__doc__)
from tokenfab import LLM, SamplingParams  # noqa: E402
from tokenfab.default_model import ensure_default_model  # noqa: E402

llm = LLM(ensure_default_model(), max_model_len=700, max_num_seqs=4, progress=False)
eng = llm.llm_engine
model = eng.runner.model
if mode == "compile":
    import torch._dynamo
    import torch._inductor.config as ic
    ic.freezing = os.environ.get("FREEZE") == "1"
    torch._dynamo.config.cache_size_limit = 64
    model.forward = torch.compile(model.forward, dynamic=True)
eng.add_request("a", None, [(7 * j) % 4000 + 5 for j in range(512)], SamplingParams(max_tokens=600, ignore_eos=True))
t0 = time.perf_counter()
for _ in range(8):
    eng.step()
print(mode, "warm-up s", round(time.perf_counter() - t0, 1), flush=True)
ts = []
for _ in range(60):
    t = time.perf_counter()
    eng.step()
    ts.append(time.perf_counter() - t)
print(mode, "decode step ms (median)", round(statistics.median(ts) * 1e3, 2), flush=True)
