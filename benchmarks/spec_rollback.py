"""Verified step cost with KDA state roll back on a hybrid (Kimi Linear) model, and the state memory per row.

A random Kimi Linear checkpoint (hidden 512, 4 layers: 3 KDA with 8 heads x 64 and one MLA, dense MLPs of 1024,
vocabulary 512) in float32 on CPU. B sequences (48-token prompts) are prefilled, then for each k in --ks one
verification step of 1 + k tokens per row is timed directly on the model runner (``ModelRunner.execute`` of the
batch the speculative step builds, with ``spec_lens`` = k) followed by ``ModelRunner.roll_back_state``:

* kept = k (the worst case: k - 1 drafts accepted, the last rejected; the replay runs k recurrence steps) and
  kept = 1 (the first draft rejected: one step); k = 0 is a plain decode step of the same rows.

After each timed step the KDA states are restored from an untimed copy, so every repetition starts from the same
state (K/V rows written for the drafts are overwritten by the next repetition). Variants are interleaved and
repeated; the best of the repetitions is reported with ratios to k = 0 at the same batch (the machine is shared: ratios, not
absolute times, are the result).

The alternative not chosen, one state snapshot per draft position (state_rollback.py's docstring), is measured
at the layer level: materializing S after each of the 1 + k tokens of every row (1 + k recurrence steps, each
state copied into a [B, 1 + k, H, D, D] buffer) against the roll back's replay (kept steps on the rows), for the
same shapes; and its memory, (1 + k) x the recurrent state per row and layer.

    .venv/bin/python benchmarks/spec_rollback.py --batches 1 16 --ks 0 1 3 7 --reps 9
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_file import unused_stem, write_markdown  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def make_checkpoint(root: str) -> str:
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from test_kimi_linear import make_kimi_linear
    from tokenfab.testing.tokenizer_builder import build_tokenizer

    tok = build_tokenizer(os.path.join(root, "tok"), vocab_size=512)
    return make_kimi_linear(os.path.join(root, "kl"), tok, hidden_size=512, intermediate_size=1024,
                            num_hidden_layers=4, layer_types=LAYERS, mlp_layer_types=["dense"] * 4,
                            num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=192,
                            qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, linear_num_heads=8,
                            linear_head_dim=64)


def verify_batch(eng, seqs, k: int):
    """The ScheduledBatch a speculative step builds for ``seqs`` (each at its last sampled token) with k drafts
    (random tokens written into the runner's token array); k = 0: a plain decode batch."""
    from tokenfab.engine.scheduler import ScheduledBatch

    B = len(seqs)
    rows = np.fromiter((s.row for s in seqs), dtype=np.int64, count=B)
    nc = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=B)
    if k:
        rng = np.random.default_rng(k)
        for s in seqs:
            eng.runner.token_ids[s.row, s.num_tokens:s.num_tokens + k] = rng.integers(5, 500, size=k)
    return ScheduledBatch(seqs=list(seqs), num_decodes=B if k == 0 else 0, rows=rows,
                          num_new=np.full(B, 1 + k, dtype=np.int64), num_computed=nc,
                          spec_lens=np.full(B, k, dtype=np.int64) if k else None)


def time_engine(path: str, B: int, ks: list[int], reps: int) -> dict:
    from tokenfab import LLM, SamplingParams

    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256, max_num_seqs=max(B, 2),
              max_num_batched_tokens=2048, progress=False)
    eng = llm.llm_engine
    rng = np.random.default_rng(0)
    for i in range(B):
        eng.add_request(f"r{i}", None, rng.integers(5, 500, size=48).tolist(),
                        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    while any(s.num_output_tokens == 0 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    seqs = list(eng.scheduler.running)
    for s in seqs:
        eng.block_manager.allocate(s, 1 + max(ks))
    runner = eng.runner
    caches = runner.state_caches
    rows_t = torch.from_numpy(np.fromiter((s.row for s in seqs), dtype=np.int64, count=B))
    saved = [(c.conv[rows_t].clone(), c.recurrent[rows_t].clone()) for c in caches]
    variants = [(k, kept) for k in ks for kept in ((None,) if k == 0 else sorted({1, k}))]
    times = {v: {"step": [], "roll": []} for v in variants}
    batches = {k: verify_batch(eng, seqs, k) for k in ks}
    for rep in range(reps + 1):
        for v in variants:
            k, kept = v
            batch = batches[k]
            t0 = time.perf_counter()
            runner.execute(batch)
            t1 = time.perf_counter()
            if k:
                runner.roll_back_state(batch.rows, np.full(B, kept, dtype=np.int64))
            t2 = time.perf_counter()
            for c, (conv, rec) in zip(caches, saved):  # untimed: back to the same starting state
                c.conv[rows_t] = conv
                c.recurrent[rows_t] = rec
            if rep:  # the first round warms up
                times[v]["step"].append(t1 - t0)
                times[v]["roll"].append(t2 - t1)
    state_bytes = sum(c.nbytes_per_slot() for c in caches)
    rec_bytes = sum(c.recurrent[0].numel() * 4 for c in caches)
    out = {"B": B, "state_bytes_per_row": state_bytes, "recurrent_bytes_per_row": rec_bytes, "rows": []}
    base = min(times[(0, None)]["step"])
    for v in variants:
        k, kept = v
        st, rb = min(times[v]["step"]), min(times[v]["roll"])
        out["rows"].append({"k": k, "kept": kept, "verify_ms": 1e3 * st, "rollback_ms": 1e3 * rb,
                            "total_ms": 1e3 * (st + rb), "ratio_to_k0": (st + rb) / base})
    eng.shutdown()
    return out


def time_layer_alternatives(B: int, k: int, H: int, D: int, reps: int) -> dict:
    """Per KDA layer: per-position snapshots (1 + k steps, each state stored) vs replay of kept = k steps."""
    from tokenfab.layers.kda import kda_recurrent_step

    g = torch.Generator().manual_seed(0)
    Q = 1 + k
    S0 = torch.randn(B, H, D, D, generator=g) * 0.1
    kk = torch.nn.functional.normalize(torch.randn(B, Q, H, D, generator=g), dim=-1)
    vv = torch.randn(B, Q, H, D, generator=g)
    gg = -torch.rand(B, Q, H, D, generator=g) * 0.1
    bb = torch.rand(B, Q, H, generator=g)
    buf = torch.empty(B, Q, H, D, D)

    def snapshots():
        S = S0
        for j in range(Q):
            _, S = kda_recurrent_step(kk[:, j], kk[:, j], vv[:, j], gg[:, j], bb[:, j], S)
            buf[:, j] = S

    def replay():
        S = S0.clone()  # the kept copy
        for j in range(k):
            _, S = kda_recurrent_step(kk[:, j], kk[:, j], vv[:, j], gg[:, j], bb[:, j], S)
        buf[:, 0] = S

    t = {"snapshots": [], "replay": []}
    for rep in range(reps + 1):
        for name, fn in (("snapshots", snapshots), ("replay", replay)):
            t0 = time.perf_counter()
            fn()
            if rep:
                t[name].append(time.perf_counter() - t0)
    return {"B": B, "k": k, "snapshots_ms": 1e3 * min(t["snapshots"]), "replay_ms": 1e3 * min(t["replay"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3, 7])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    if 0 not in a.ks:
        a.ks = [0] + a.ks
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        path = make_checkpoint(root)
        runs = [time_engine(path, B, a.ks, a.reps) for B in a.batches]
    layer = [time_layer_alternatives(B, k, 8, 64, 3 * a.reps) for B in a.batches for k in a.ks if k]
    cmd = "python benchmarks/spec_rollback.py " + " ".join(sys.argv[1:])
    sb, rb = runs[0]["state_bytes_per_row"], runs[0]["recurrent_bytes_per_row"]
    lines = ["# KDA state roll back for speculative decoding: verified step cost and state memory", "",
             f"Command: `{cmd}` (float32, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, "
             "machine shared with other jobs: read the ratios).", "",
             "Model: random Kimi Linear, hidden 512, 4 layers (3 KDA of 8 heads x 64, 1 MLA), dense MLP 1024, "
             "vocabulary 512, 48-token prompts. Verified step = `ModelRunner.execute` of the speculative batch "
             "(1 + k tokens per row) + `roll_back_state`; k = 0 is a plain decode step. kept = tokens of the "
             "step left in the state (k: last draft rejected, replay of k steps; 1: first draft rejected). "
             f"Best (minimum) of {a.reps} interleaved repetitions (the machine is shared: the minimum is the "
             "least disturbed run; on a loaded 2-core machine single steps still vary several-fold between "
             "repetitions, so the engine table is coarse, and the layer-level table below is the cleaner "
             "comparison of the two roll back forms).", "",
             "| batch | k | kept | verify forward ms | roll back ms | total ms | total / k=0 |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        for x in r["rows"]:
            lines.append(f"| {r['B']} | {x['k']} | {x['kept'] if x['kept'] is not None else '-'} | "
                         f"{x['verify_ms']:.2f} | {x['rollback_ms']:.2f} | {x['total_ms']:.2f} | "
                         f"{x['ratio_to_k0']:.2f} |")
    lines += ["", "## State memory per row", "",
              f"KDA state per row (3 layers, conv + recurrent): {sb / 1024:.1f} KiB, of which recurrent "
              f"{rb / 1024:.1f} KiB.", "",
              "| k | kept for roll back (1x recurrent + conv window + per-token k, v, g, beta) | per-position "
              "snapshots ((1 + k) x state) |", "|---:|---:|---:|"]
    for k in a.ks:
        if k:
            extra = rb + 3 * (8 * 64 * 3 * (3 + k) * 4 + (1 + k) * (3 * 8 * 64 + 8) * 4)
            lines.append(f"| {k} | {extra / 1024:.1f} KiB | {(1 + k) * sb / 1024:.1f} KiB |")
    lines += ["", "## The alternative: per-position snapshots vs replay, one KDA layer (8 heads x 64)", "",
              "Extra work beyond a verification forward that yields only outputs and the final state: snapshots "
              "materialize and store S after each of the 1 + k tokens of every row; the roll back replays kept = k "
              "steps from the kept copy (its worst case; rows keeping all tokens replay nothing). Best of "
              f"{3 * a.reps} interleaved repetitions.", "",
              "| batch | k | snapshots ms | replay ms | snapshots / replay |", "|---:|---:|---:|---:|---:|"]
    for x in layer:
        lines.append(f"| {x['B']} | {x['k']} | {x['snapshots_ms']:.3f} | {x['replay_ms']:.3f} | "
                     f"{x['snapshots_ms'] / x['replay_ms']:.2f} |")
    stem = unused_stem(os.path.join(a.out, "2026-12-01-spec-rollback"))
    write_markdown(a.out, os.path.basename(stem) + ".md", lines)
    with open(stem + ".json", "w") as f:
        json.dump({"command": cmd, "engine": runs, "layer": layer}, f, indent=1)


if __name__ == "__main__":
    main()
