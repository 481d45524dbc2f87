"""Host time of a decode step at batch 64, by part (NOTES.md entry 72): output emit, schedule, place and fill (async
scheduling), execute (CPU: includes the tiny model's forward). A tiny random llama (built here), 64 sequences at
temperature 0.8, the padded graph buffers and async scheduling forced on (the GPU engine's Python path), median of
150 steps after 5.

    TOKENFAB_DECODE_GRAPHS=eager TOKENFAB_ASYNC_SCHEDULING=1 PYTHONPATH=. .venv/bin/python \
        benchmarks/experiments/host_step_time.py [--out /tmp/host_step_time]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/host_step_time", help="folder for the tiny checkpoint and tokenizer")
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args()
    from tokenfab import LLM, SamplingParams
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
    from tokenfab.testing.tokenizer_builder import build_tokenizer
    tok = build_tokenizer(os.path.join(args.out, "tok"), vocab_size=512)
    path = make_tiny_checkpoint(os.path.join(args.out, "llama"), "llama", vocab_size=512, tokenizer_dir=tok)
    llm = LLM(path, dtype="float32", max_model_len=512, max_num_seqs=64, progress=False)
    eng = llm.llm_engine
    parts = {"emit": 0.0, "schedule": 0.0, "place": 0.0, "fill": 0.0, "execute": 0.0}

    def wrap(obj, name, key):
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            parts[key] += time.perf_counter() - t
            return r
        setattr(obj, name, timed)

    wrap(eng.outputs, "emit", "emit")
    wrap(eng.scheduler, "schedule", "schedule")
    wrap(eng.runner, "execute", "execute")
    if eng.ahead is not None:
        wrap(eng.ahead, "place", "place")
        wrap(eng.ahead, "fill", "fill")
    sp = SamplingParams(temperature=0.8, max_tokens=400, ignore_eos=True)
    for i in range(64):
        eng.add_request(str(i), None, [5 + (i * 7 + j) % 400 for j in range(20)], sp)
    for _ in range(5):
        eng.step()
    for k in parts:
        parts[k] = 0.0
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
    print(f"median ms/step {1e3 * statistics.median(walls):.3f} (async scheduling {eng.ahead is not None}); "
          "ms per step: " + ", ".join(f"{k} {v / args.steps * 1e3:.3f}" for k, v in parts.items()))


if __name__ == "__main__":
    main()
