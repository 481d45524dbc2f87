"""Verified step cost with the KDA state commit on a hybrid (Kimi Linear) model, and what it holds per row.

A random Kimi Linear checkpoint (hidden 512, 4 layers: 3 KDA with 8 heads x 64 and one MLA, dense MLPs of 1024,
vocabulary 512) in float32 on CPU. B sequences (48-token prompts) are prefilled, then for each k in --ks one
verification step of 1 + k tokens per row is timed directly on the model runner (``ModelRunner.execute`` of the
batch the speculative step builds, with ``spec_lens`` = k: the KDA layers hold the rows' states) followed by
``ModelRunner.commit_state`` (engine/state_commit.py: the conv and recurrence run again over the kept tokens):

* kept = 1 (the first draft rejected) and kept = k + 1 (every draft accepted: the commit's most tokens); k = 0 is a
  plain decode step of the same rows.

After each timed step the KDA states are restored from an untimed copy, so every repetition starts from the same
state (K/V rows written for the drafts are overwritten by the next repetition). Variants are interleaved and
repeated; the best of the repetitions is reported with ratios to k = 0 at the same batch (the machine is shared:
ratios, not absolute times, are the result).

    .venv/bin/python benchmarks/spec_state_commit.py --batches 1 16 --ks 0 1 3 7 --reps 9
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
    variants = [(k, kept) for k in ks for kept in ((None,) if k == 0 else sorted({1, k + 1}))]
    times = {v: {"step": [], "commit": []} for v in variants}
    batches = {k: verify_batch(eng, seqs, k) for k in ks}
    for rep in range(reps + 1):
        for v in variants:
            k, kept = v
            batch = batches[k]
            t0 = time.perf_counter()
            runner.execute(batch)
            t1 = time.perf_counter()
            if k:
                runner.commit_state(batch.rows, np.full(B, kept, dtype=np.int64))
            t2 = time.perf_counter()
            for c, (conv, rec) in zip(caches, saved):  # untimed: back to the same starting state
                c.conv[rows_t] = conv
                c.recurrent[rows_t] = rec
            if rep:  # the first round warms up
                times[v]["step"].append(t1 - t0)
                times[v]["commit"].append(t2 - t1)
    state_bytes = sum(c.nbytes_per_slot() for c in caches)
    rec_bytes = sum(c.recurrent[0].numel() * 4 for c in caches)
    out = {"B": B, "state_bytes_per_row": state_bytes, "recurrent_bytes_per_row": rec_bytes, "rows": []}
    base = min(times[(0, None)]["step"])
    for v in variants:
        k, kept = v
        st, rb = min(times[v]["step"]), min(times[v]["commit"])
        out["rows"].append({"k": k, "kept": kept, "verify_ms": 1e3 * st, "commit_ms": 1e3 * rb,
                            "total_ms": 1e3 * (st + rb), "ratio_to_k0": (st + rb) / base})
    eng.shutdown()
    return out


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
    cmd = "python benchmarks/spec_state_commit.py " + " ".join(sys.argv[1:])
    sb, rb = runs[0]["state_bytes_per_row"], runs[0]["recurrent_bytes_per_row"]
    lines = ["# KDA state commit for speculative decoding: verified step cost and what is held per row", "",
             f"Command: `{cmd}` (float32, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, "
             "machine shared with other jobs: read the ratios).", "",
             "Model: random Kimi Linear, hidden 512, 4 layers (3 KDA of 8 heads x 64, 1 MLA), dense MLP 1024, "
             "vocabulary 512, 48-token prompts. Verified step = `ModelRunner.execute` of the speculative batch "
             "(1 + k tokens per row, the KDA states held) + `commit_state` (the conv and recurrence again over the "
             "kept tokens); k = 0 is a plain decode step. kept = tokens of the step written to the state (1: first "
             "draft rejected; k + 1: all accepted). "
             f"Best (minimum) of {a.reps} interleaved repetitions.", "",
             "| batch | k | kept | verify forward ms | commit ms | total ms | total / k=0 |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        for x in r["rows"]:
            lines.append(f"| {r['B']} | {x['k']} | {x['kept'] if x['kept'] is not None else '-'} | "
                         f"{x['verify_ms']:.2f} | {x['commit_ms']:.2f} | {x['total_ms']:.2f} | "
                         f"{x['ratio_to_k0']:.2f} |")
    lines += ["", "## Held per row until the commit", "",
              f"KDA state per row (3 layers, conv + recurrent): {sb / 1024:.1f} KiB, of which recurrent "
              f"{rb / 1024:.1f} KiB. The commit copies no state. It holds references to what the forward "
              "computed anyway: on the GPU path the step's q | k | v projections and gate inputs, (3HD + HD + H) "
              "values per token and layer; on the PyTorch path (this run) also the conv window (3HD x (K - 1 + "
              "1 + k)) and the recurrence inputs k, v, g, beta ((3HD + H) per token), which it replays.", "",
              "| k | GPU path | PyTorch path | per-position snapshots ((1 + k) x state) |", "|---:|---:|---:|---:|"]
    H, D, K, L = 8, 64, 4, 3
    for k in a.ks:
        if k:
            gpu = L * (1 + k) * (4 * H * D + H) * 4
            cpu = gpu + L * (3 * H * D * (K + k) + (1 + k) * (3 * H * D + H)) * 4
            lines.append(f"| {k} | {gpu / 1024:.1f} KiB | {cpu / 1024:.1f} KiB | {(1 + k) * sb / 1024:.1f} KiB |")
    stem = unused_stem(os.path.join(a.out, "2026-12-06-spec-state-commit"))
    write_markdown(a.out, os.path.basename(stem) + ".md", lines)
    with open(stem + ".json", "w") as f:
        json.dump({"command": cmd, "engine": runs}, f, indent=1)


if __name__ == "__main__":
    main()
