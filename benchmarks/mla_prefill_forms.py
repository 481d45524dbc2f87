"""MLA prefill: expanded form (kv_b_proj over the context, per-head keys) against absorbed form (attention over the
latent rows, W_UK / W_UV per head), timed side by side on one MLA layer of a real checkpoint.

    .venv/bin/python benchmarks/mla_prefill_forms.py [--model DIR] [--shapes 256:256,1024:1024,...] [--reps 7]

Each shape Q:L is a prefill chunk of Q new tokens whose sequence then holds L tokens (L - Q already cached), batch
1, bf16, the layer's whole forward (projections, cache write, attention, o_proj). The two forms alternate within
each repetition; the median per form is reported with the FLOP ratio predicted from the parts that differ, with S =
L - (Q - 1) / 2 keys seen per query on average (causal): expanded 2LCH(nope + v) (kv_b_proj over the context) +
2HQS(nope + rope + v) (attention); absorbed 2QHC(nope + v) (W_UK, W_UV) + 2HQS(2C + rope) (arXiv:2405.04434
section 2.1.3 for the absorption). Writes
<out>/<date>-mla-prefill-forms.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.results_file import unused_stem  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    ap.add_argument("--shapes", default="256:256,1024:1024,512:4096,128:4096,64:4096,32:4096,16:2048",
                    help="comma-separated Q:L (chunk tokens : sequence tokens after the chunk)")
    ap.add_argument("--reps", type=int, default=7, help="alternating repetitions per shape (default: 7)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"),
                    help="folder for the results (default: benchmarks/results)")
    args = ap.parse_args()
    from tokenfab import LLM
    from tokenfab.default_model import ensure_default_model
    from tokenfab.layers.attention_metadata import AttentionMetadata
    from tokenfab.layers.mla import MLAttention

    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    max_len = max(L for _, L in shapes)
    llm = LLM(args.model or ensure_default_model(), max_model_len=max_len + 16, max_num_seqs=1, progress=False)
    runner = llm.llm_engine.runner
    layer_idx, attn = next((i, m) for i, m in enumerate(runner.model.modules()) if isinstance(m, MLAttention))
    cache = next(c for c in runner.kv_caches if isinstance(c, torch.Tensor))
    cache.normal_()  # latents of a plausible scale: the forms are compared on their outputs too
    bs = runner.block_size
    cfg = llm.llm_engine.model_config
    C, R, nope, v = attn.kv_lora, attn.rope_dim, attn.nope, attn.v_dim
    rows = []
    for Q, L in shapes:
        nblk = -(-L // bs)
        bt = np.arange(nblk, dtype=np.int64)[None]
        group = runner._group(bt, np.array([0]), np.array([Q]), np.array([L - Q]), Q)
        pos = np.arange(L - Q, L)
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(bt[0, pos // bs] * bs + pos % bs), decode=None,
                                 prefill=group, num_tokens=Q, block_size=bs)
        x = torch.randn(Q, cfg.hidden_size, dtype=torch.bfloat16) * 0.5
        positions = torch.from_numpy(pos)
        times = {"expanded": [], "absorbed": []}
        outs = {}
        with torch.inference_mode():
            for rep in range(args.reps + 1):
                for form in ("expanded", "absorbed") if rep % 2 else ("absorbed", "expanded"):
                    attn.prefill_form = form
                    t = time.perf_counter()
                    outs[form] = attn(positions, x, cache, meta)
                    if rep:  # the first repetition warms up
                        times[form].append(time.perf_counter() - t)
        attn.prefill_form = "auto"
        diff = (outs["absorbed"].float() - outs["expanded"].float()).abs().max().item()
        scale = outs["expanded"].float().abs().max().item()
        H, seen = attn.num_heads, L - (Q - 1) / 2  # causal: keys each query sees, on average
        flops_exp = 2 * L * C * H * (nope + v) + 2 * H * Q * seen * (nope + R + v)
        flops_abs = 2 * Q * H * C * (nope + v) + 2 * H * Q * seen * (2 * C + R)
        row = {"Q": Q, "L": L, "expanded_ms": statistics.median(times["expanded"]) * 1e3,
               "absorbed_ms": statistics.median(times["absorbed"]) * 1e3,
               "predicted_flop_ratio_absorbed_over_expanded": flops_abs / flops_exp,
               "max_abs_diff": diff, "max_abs_out": scale}
        row["measured_ratio_absorbed_over_expanded"] = row["absorbed_ms"] / row["expanded_ms"]
        row["auto_picks"] = "absorbed" if attn._absorb_prefill(group) else "expanded"
        rows.append(row)
        print(json.dumps(row), flush=True)
    date = dt.date.today().isoformat()
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "layer": layer_idx,
           "model": cfg.architectures if hasattr(cfg, "architectures") else None, "H": attn.num_heads, "C": C,
           "rope": R, "nope": nope, "v": v, "command": " ".join(sys.argv)}
    os.makedirs(args.out, exist_ok=True)
    base = unused_stem(os.path.join(args.out, f"{date}-mla-prefill-forms"))
    with open(base + ".json", "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    lines = [f"# MLA prefill: expanded vs absorbed form ({date})", "",
             f"One MLA layer of the embedded default model (H {attn.num_heads}, C {C}, rope {R}, nope {nope}, v "
             f"{v}), bf16, batch 1, {env['threads']} threads, median of {args.reps} alternating runs.", "",
             f"Command: `{env['command']}`", "",
             "| Q (chunk) | L (sequence) | expanded ms | absorbed ms | absorbed / expanded | predicted (FLOPs) | "
             "max abs Δ out | \"auto\" picks |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['Q']} | {r['L']} | {r['expanded_ms']:.2f} | {r['absorbed_ms']:.2f} | "
              f"{r['measured_ratio_absorbed_over_expanded']:.2f} | "
              f"{r['predicted_flop_ratio_absorbed_over_expanded']:.2f} | {r['max_abs_diff']:.1e} | {r['auto_picks']} |"
              for r in rows]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {base}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
