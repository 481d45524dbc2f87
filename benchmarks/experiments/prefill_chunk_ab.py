"""SmolLM2-135M (bf16 folder or the packed Q4_1 GGUF), 4 x 1024-token prompts: one engine step (budget 4096) vs the
serve CPU budget 2048 (2 steps), interleaved, 2 rounds, thread CPU time of the engine steps (one thread). Read by
benchmarks/results/2026-12-02-prefill-vs-peers-profile.md.

    .venv/bin/python benchmarks/experiments/prefill_chunk_ab.py bf16|gguf
"""
import time, sys, json, torch
torch.set_num_threads(1)
sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__import__("os").path.abspath(__file__)), ".."))
from prefill_vs_peers_profile import build, prompts
from tokenfab import SamplingParams
kind = sys.argv[1] if len(sys.argv) > 1 else "bf16"
engs = {b: build(kind, b, 1040).llm_engine for b in (4096, 2048)}
salt = [100]
def run(eng):
    salt[0] += 1
    for i, p in enumerate(prompts(4, 1024, salt[0])):
        eng.add_request(f"c{salt[0]}-{i}", None, p, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
    cpu = wall = 0.0; n = 0
    while eng.has_unfinished_requests():
        t, w = time.thread_time(), time.perf_counter(); eng.step(); cpu += time.thread_time() - t; wall += time.perf_counter() - w; n += 1
    return cpu, wall, n
for e in engs.values(): run(e)
res = {b: [] for b in engs}
for r in range(2):
    for b, e in engs.items():
        res[b].append(run(e)); print(kind, b, res[b][-1], flush=True)
print(json.dumps({"model": kind, **{str(b): {"cpu_s": [round(x[0], 3) for x in v], "wall_s": [round(x[1], 3) for x in v], "steps": v[0][2], "tok_per_cpu_s": round(4096 / min(x[0] for x in v), 1)} for b, v in res.items()}}))
