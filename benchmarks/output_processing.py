"""Host time of a step's output processing on the default model (SmolLM2-135M-Instruct, its real tokenizer), split
into the half that must finish before the next step is scheduled (``advance``: tokens, progress, stop rules without
text) and the half deferred while the next forward runs on GPU engines (``emit``: detokenization, stop strings,
RequestOutputs; engine/output_processor.py). Runs B concurrent greedy requests on the CPU with outputs in line and
times both halves per sequence and step (every step, prefills included). Absolute times move with the machine's load;
the emit share is what the deferral takes off the critical path.

    python benchmarks/output_processing.py [--batch 64] [--tokens 48] [--out results/FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--stop", action="store_true", help="give every request two stop strings (never hit)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ["TOKENFAB_ASYNC_OUTPUT"] = "0"  # in line: both halves timed back to back
    from tokenfab import LLM, SamplingParams
    llm = LLM(None, max_num_seqs=args.batch, max_model_len=512, progress=False)
    eng = llm.llm_engine
    acc = {"advance": [0.0, 0], "emit": [0.0, 0]}

    def timed(obj, name, key, count):
        f = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            out = f(*a, **k)
            acc[key][0] += time.perf_counter() - t
            acc[key][1] += count(a, out)
            return out
        setattr(obj, name, wrapper)
    timed(eng.outputs, "advance", "advance", lambda a, out: len(out))
    timed(eng.outputs, "emit", "emit", lambda a, out: len(a[0]))
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True,
                        stop=["\u241e\u241f", "<|never|>"] if args.stop else None)
    prompts = [f"Write a short note number {i} about the sea." for i in range(args.batch)]
    llm.generate(prompts, sp)
    per = {k: v[0] / max(v[1], 1) * 1e6 for k, v in acc.items()}
    res = {"command": "python benchmarks/output_processing.py " + " ".join(sys.argv[1:]), "batch": args.batch,
           "tokens": args.tokens, "stop_strings": args.stop, "model": "SmolLM2-135M-Instruct (default, CPU)",
           "advance_us_per_seq_step": round(per["advance"], 2), "emit_us_per_seq_step": round(per["emit"], 2),
           "emit_share_of_output_processing": round(per["emit"] / (per["advance"] + per["emit"]), 3)}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
