"""A 2,048-token prefill step of the embedded default model (8 prompts x 256 tokens, the serve budget): median
step time, torch-profiler and cProfile tables. Read by benchmarks/NOTES.md entry 30.

    .venv/bin/python benchmarks/prefill_profile.py
"""
import time, torch, statistics, cProfile, pstats
from tokenfab import LLM, SamplingParams
from tokenfab.default_model import ensure_default_model
llm = LLM(ensure_default_model(), max_model_len=700, max_num_seqs=16, max_num_batched_tokens=2048, progress=False)
eng = llm.llm_engine
def run():
    for i in range(8):
        eng.add_request(f"r{i}-{time.time()}", None, [(7*j+i)%4000+5 for j in range(256)], SamplingParams(max_tokens=1, ignore_eos=True))
    t=time.perf_counter(); eng.step(); dt=time.perf_counter()-t
    while eng.has_unfinished_requests(): eng.step()
    return dt
for _ in range(2): run()
print("prefill step 8x256 ms", statistics.median([run() for _ in range(5)])*1e3)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(3): run()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
pr=cProfile.Profile(); pr.enable()
for _ in range(3): run()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(15)
