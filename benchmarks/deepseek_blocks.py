"""DeepSeek-V3's blocks as one C++ call each (``cpu_kernels.mla_decode`` for MLA decode, ``cpu_kernels.deepseek_moe``
for the MoE block) against their Python paths, side by side on one engine: decode steps alternate between the three
settings (both blocks, MLA block only, Python paths) in runs of ``--steps``, ``--rounds`` times; median step time each.

    .venv/bin/python benchmarks/deepseek_blocks.py [--model DIR] [--batch 1,4,16] [--context 512]

All settings give bit-identical outputs (tests/test_deepseek_blocks.py), so only the time differs. Writes
<out>/<date>-deepseek-blocks.md (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    ap.add_argument("--batch", default="1,4,16", help="decode batch sizes, comma-separated (default 1,4,16)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per sequence (default 512)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block (default 20)")
    ap.add_argument("--rounds", type=int, default=5, help="on/off blocks per batch size (default 5)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="output folder")
    args = ap.parse_args()
    from tokenfab import LLM, SamplingParams
    from tokenfab.default_model import ensure_default_model
    from tokenfab.layers.mla import MLAttention
    from tokenfab.models.deepseek_v3 import DeepseekV3MoE
    batches = [int(b) for b in args.batch.split(",")]
    total = 2 * args.rounds * args.steps + 10
    llm = LLM(args.model or ensure_default_model(), max_model_len=args.context + total + 16,
              max_num_seqs=max(batches), progress=False)
    eng = llm.llm_engine
    layers = [m for m in eng.runner.model.modules() if isinstance(m, MLAttention)]
    moes = [m for m in eng.runner.model.modules() if isinstance(m, DeepseekV3MoE)]
    if not layers or layers[0]._block_weights is None or not moes or not moes[0]._block_ok:
        print("the DeepSeek blocks do not apply here (need CPU bf16 with AVX512-BF16 kernels and a DeepSeek-V3 "
              "model)", file=sys.stderr)
        return 2

    def setting(mla: bool, moe: bool) -> None:
        for m in layers:
            m.decode_block = mla
        for m in moes:
            m.fused_block = moe
    settings = {"both blocks": (True, True), "MLA block only": (True, False), "Python paths": (False, False)}
    rows = []
    for B in batches:
        for i in range(B):
            eng.add_request(f"b{B}-{i}", None, [(7 * j + 13 * i) % 4000 + 5 for j in range(args.context)],
                            SamplingParams(max_tokens=total, ignore_eos=True, temperature=0.0))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        times = {name: [] for name in settings}
        for _ in range(args.rounds):
            for name, flags in settings.items():
                setting(*flags)
                eng.step()  # untimed switch-over step
                for _ in range(args.steps):
                    t = time.perf_counter()
                    eng.step()
                    times[name].append(time.perf_counter() - t)
        setting(True, True)
        med = {name: statistics.median(v) for name, v in times.items()}
        rows.append((B, med))
        print(f"batch {B}: " + ", ".join(f"{n} {v * 1e3:.2f} ms" for n, v in med.items()))
        for i in range(B):
            eng.abort_request(f"b{B}-{i}")
        while eng.has_unfinished_requests():
            eng.step()
    date = dt.date.today().isoformat()
    names = list(settings)
    lines = [f"# DeepSeek-V3 blocks as C++ calls vs Python paths ({date})", "",
             f"Command: `benchmarks/deepseek_blocks.py {' '.join(sys.argv[1:])}`; {torch.get_num_threads()} threads, "
             f"context {args.context}, {args.rounds} alternated runs of {args.steps} decode steps per setting; "
             "median ms per step.", "",
             "| batch | " + " | ".join(names) + " | both blocks / Python paths |", "|---:|" + "---:|" * (len(names) + 1)]
    lines += [f"| {B} | " + " | ".join(f"{med[n] * 1e3:.2f}" for n in names)
              + f" | {med['both blocks'] / med['Python paths']:.2f} |" for B, med in rows]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{date}-deepseek-blocks.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
