"""The default model's folder (SmolLM2-135M-Instruct, bf16 safetensors: what ``tokenfab demo`` serves) on this CPU
in bfloat16 vs float32, alternated in fresh processes: what ``dtype="auto"`` should mean at the avx2 ISA level.

Per run: one engine, 16 prompts of 256 random tokens, 32 greedy tokens each (ignore_eos), all submitted at once;
prefill time (until every sequence has its first token), the whole run, total tokens per second, the resident set
after load, and the first 8 tokens of the first answer.

    PYTHONPATH=. python benchmarks/experiments/avx2_auto_dtype.py [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
from tokenfab import LLM, SamplingParams
from tokenfab.default_model import default_model_path
from tokenfab.kernels.cpu import isa
llm = LLM(default_model_path(quiet=True), dtype=sys.argv[1], progress=False, max_model_len=512)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(10, 40000, (256,), generator=g).tolist()} for _ in range(16)]
first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
full = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
llm.generate(prompts[:2], first, use_tqdm=False)  # warm-up
t0 = time.perf_counter(); llm.generate(prompts, first, use_tqdm=False); t1 = time.perf_counter()
out = llm.generate(prompts, full, use_tqdm=False); t2 = time.perf_counter()
toks = sum(len(o.outputs[0].token_ids) for o in out)
print(json.dumps({"isa": isa.selected_level(), "dtype": str(llm.llm_engine.dtype), "prefill_s": t1 - t0,
                  "full_s": t2 - t1, "total_tok_s": (16 * 256 + toks) / (t2 - t1), "max_rss_mb_after_load": rss,
                  "first_ids": out[0].outputs[0].token_ids[:8]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for r in range(a.rounds):
        for dtype in ("bfloat16", "float32"):
            res = subprocess.run([sys.executable, "-c", CHILD, dtype], env=dict(os.environ), capture_output=True,
                                 text=True, check=True)
            rows.append(dict(json.loads(res.stdout.strip().splitlines()[-1]), round=r))
            print(json.dumps(rows[-1]), flush=True)
    print("| dtype | round | prefill s (16 x 256) | prefill + 31 decode steps s | total tok/s | max RSS MB | first ids |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for x in rows:
        print(f"| {x['dtype']} | {x['round']} | {x['prefill_s']:.2f} | {x['full_s']:.2f} | {x['total_tok_s']:.0f} | "
              f"{x['max_rss_mb_after_load']:.0f} | {x['first_ids']} |")


if __name__ == "__main__":
    main()
