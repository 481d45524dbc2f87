"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) on a CPU without the packed kernels: per-call dequantization
(TOKENFAB_DENSE_FALLBACK_GIB=0) vs the float32 copies made once at load (the default budget), alternated in fresh
processes.

Per run: one engine, 16 prompts of 256 random tokens, 32 greedy tokens each (ignore_eos), all submitted at once;
prefill time (until every sequence has its first token), the rest (decode), and total tokens per second. Also
the engine's resident set after load.

    PYTHONPATH=. python benchmarks/experiments/avx2_dense_fallback.py [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, os, time, resource
import torch
from tokenfab import LLM, SamplingParams
from tokenfab.default_model import real_model_gguf
from tokenfab.kernels.cpu import isa
path = real_model_gguf()
llm = LLM(path, progress=False, max_model_len=512)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(10, 40000, (256,), generator=g).tolist()} for _ in range(16)]
first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
full = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
llm.generate(prompts[:2], first, use_tqdm=False)  # warm-up
t0 = time.perf_counter(); llm.generate(prompts, first, use_tqdm=False); t1 = time.perf_counter()
out = llm.generate(prompts, full, use_tqdm=False); t2 = time.perf_counter()
toks = sum(len(o.outputs[0].token_ids) for o in out)
print(json.dumps({"isa": isa.selected_level(), "prefill_s": t1 - t0, "full_s": t2 - t1,
                  "decode_s": (t2 - t1) - (t1 - t0), "total_tok_s": (16 * 256 + toks) / (t2 - t1),
                  "max_rss_mb_after_load": rss, "first_ids": out[0].outputs[0].token_ids[:8]}))
"""


def run(budget: str) -> dict:
    env = dict(os.environ, TOKENFAB_DENSE_FALLBACK_GIB=budget)
    res = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for r in range(a.rounds):
        for label, budget in (("per-call dequantization", "0"), ("float32 copies at load", "4")):
            t = time.perf_counter()
            rows.append(dict(run(budget), variant=label, round=r, wall_s=time.perf_counter() - t))
            print(json.dumps(rows[-1]), flush=True)
    print("| variant | round | prefill s (16 x 256) | full run s (+ 31 decode steps) | total tok/s | max RSS MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for x in rows:
        print(f"| {x['variant']} | {x['round']} | {x['prefill_s']:.2f} | {x['full_s']:.2f} | {x['total_tok_s']:.0f} | "
              f"{x['max_rss_mb_after_load']:.0f} |")


if __name__ == "__main__":
    main()
