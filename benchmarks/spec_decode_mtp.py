"""MTP speculative decoding on the embedded DeepSeek-V3 default shape (random weights, bf16, CPU): the cost of a
speculative step with MTP drafting, per k, beside the plain decode step.

The default model (tokenfab/default_model.py) is copied once to ``<cache>/models/tokenfab-tiny-deepseek-v3-mtp`` and
given one random MTP layer in DeepSeek-V3's layout (``tokenfab.testing.tiny_checkpoints.add_mtp_layers``: MLA
attention + MoE block of layer index 6, enorm / hnorm / eh_proj / shared_head.norm; embedding and LM head the
target's). Engines for k = 0 (no speculation: the fused plain decode step) and k = 1, 3 (``{"method": "mtp"}``,
always k drafts) are built once and timed interleaved: per round, per batch (1 and 16 sequences of ~300-token random
prompts, greedy), the median of ``--steps`` engine steps of each engine in turn. A speculative step includes
everything: the MTP draft chain (k - 1 one-token MTP forwards plus the LM head), the verification forward of
1 + k tokens per row, acceptance, and the MTP catch-up over the accepted positions (``observe``); the time spent in
the proposer (propose + observe) is measured separately. Random MTP weights are unrelated to the random target, so
acceptance is ~0 there and a speculative step yields ~1 token per row: the ratio to k = 0 is the overhead a real
MTP layer must repay with acceptance. The upper bound runs the same shapes as a crafted pair whose MTP layer is a
perfect drafter (every draft accepted: k + 1 tokens per row and step).

Usage: ``python benchmarks/spec_decode_mtp.py [--steps 15] [--rounds 3]``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_steps import start_requests  # noqa: E402
from results_file import write_markdown  # noqa: E402


def mtp_default_models() -> dict[str, str]:
    """{"random": the default model's folder copied once and given one random MTP layer, "perfect": that pair
    made a bigram target with an MTP layer that predicts it exactly (tiny_checkpoints.perfect_mtp_pair)}."""
    from tokenfab.cache_paths import cache_dir
    from tokenfab.default_model import ensure_default_model
    from tokenfab.testing.tiny_checkpoints import add_mtp_layers, perfect_mtp_pair
    dst = os.path.join(cache_dir(), "models", "tokenfab-tiny-deepseek-v3-mtp")
    if not os.path.isfile(os.path.join(dst, "model-mtp.safetensors")):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(ensure_default_model(quiet=True), dst)
        add_mtp_layers(dst, 1, seed=4321)
    perfect = dst + "-perfect"
    if not os.path.isfile(os.path.join(perfect, "model-mtp.safetensors")):
        shutil.rmtree(perfect, ignore_errors=True)
        perfect_mtp_pair(dst, perfect)
    return {"random": dst, "perfect": perfect}


class ProposerClock:
    """Wall time spent in the MTP proposer's propose() and observe() (wraps them in place)."""

    def __init__(self, prop):
        self.total = 0.0
        for name in ("propose", "observe"):
            fn = getattr(prop, name)

            def timed(*a, _fn=fn, **kw):
                t = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    self.total += time.perf_counter() - t
            setattr(prop, name, timed)


def timed_steps(eng, prompts, steps, clock):
    """Median step ms, mean tokens emitted per row and step, proposer share of the step time, over ``steps``
    steps of ``prompts`` after prefill and 2 warm-up steps; the requests are aborted afterwards."""
    from tokenfab import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    ids = start_requests(eng, prompts, sp, prefix="mtp")
    for _ in range(2):
        eng.step()
    seqs = [s for r in ids for s in eng.requests[r].seqs]
    out0 = sum(s.num_output_tokens for s in seqs)
    p0 = clock.total if clock else 0.0
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    emitted = sum(s.num_output_tokens for s in seqs) - out0
    share = ((clock.total - p0) / sum(ts)) if clock else 0.0
    for r in ids:
        eng.abort_request(r)
    return 1e3 * statistics.median(ts), emitted / (steps * len(prompts)), share


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    import torch

    from tokenfab import LLM
    if args.threads:
        torch.set_num_threads(args.threads)
    models = mtp_default_models()
    ks = (0, 1, 3)
    keys = [(v, k) for v in ("random", "perfect") for k in ks]
    engines, clocks = {}, {}
    for v, k in keys:
        spec = None if k == 0 else {"method": "mtp", "num_speculative_tokens": k, "verify_token_cost": 0.0,
                                    "verify_step_overhead": 0.0, "random_row_cost": 0.0}
        engines[(v, k)] = LLM(models[v], progress=False, max_num_seqs=16, max_model_len=2048,
                              speculative_config=spec).llm_engine
        clocks[(v, k)] = ProposerClock(engines[(v, k)].spec.proposer) if k else None
    V = engines[keys[0]].model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = {bs: [rng.integers(100, V - 100, size=300).tolist() for _ in range(bs)] for bs in (1, 16)}
    res = {(key, bs): [] for key in keys for bs in (1, 16)}
    for r in range(args.rounds):
        for bs in (1, 16):
            for key in keys:
                ms, tok, share = timed_steps(engines[key], prompts[bs], args.steps, clocks[key])
                res[(key, bs)].append((ms, tok, share))
                print(f"round {r} batch {bs} {key[0]} k={key[1]}: {ms:.2f} ms/step, {tok:.3f} tokens/row/step, "
                      f"proposer {100 * share:.0f}%", flush=True)
    lines = ["# MTP speculative decoding: step cost on the embedded DeepSeek-V3 default shape", "",
             "Command: `python benchmarks/spec_decode_mtp.py " + " ".join(sys.argv[1:]) + "`", "",
             f"Model: the embedded default (6 layers, hidden 768, MLA kv_lora 512, 16 experts top-2 + 1 shared, vocab "
             f"{V}, bf16, random weights) plus one random MTP layer (MLA + MoE block); CPU, torch threads "
             f"{torch.get_num_threads()}, on a shared 2-core machine (other jobs running: compare ratios, not "
             "absolute times). Contexts ~300 tokens, greedy.", "",
             f"Each cell: median over {args.rounds} interleaved rounds of the per-round median of {args.steps} engine "
             "steps. k = 0: no speculation (the plain fused decode step). k >= 1: the whole speculative step "
             "with MTP drafting (draft chain + verification of 1 + k tokens per row + acceptance + MTP catch-up); "
             "'proposer' = share of the step in the MTP proposer (propose + observe). 'random': random MTP "
             "weights, acceptance ~0, so 'tokens / row / step' is ~1. 'perfect': the same shapes made a bigram "
             "target with an MTP layer that predicts it exactly (tokenfab.testing.tiny_checkpoints."
             "perfect_mtp_pair: attention / MLP output projections zeroed, eh_proj = [I | 0]), the upper bound: "
             "every draft accepted, k + 1 tokens per row and step. Ratios are to k = 0 of the same pair in the "
             "same round.", "",
             "| pair | batch | k | ms / step | x k=0 | tokens / row / step | ms / token | x k=0 per token "
             "| proposer share |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v in ("random", "perfect"):
        for bs in (1, 16):
            base = [m for m, _, _ in res[((v, 0), bs)]]
            for k in ks:
                cell = res[((v, k), bs)]
                ms = [m for m, _, _ in cell]
                toks = [t for _, t, _ in cell]
                ratio = statistics.median(a / b for a, b in zip(ms, base))
                tok_ratio = statistics.median((a / t) / b for a, t, b in zip(ms, toks, base))
                med = statistics.median(ms)
                tok = statistics.mean(toks)
                share = statistics.mean(s for _, _, s in cell)
                lines.append(f"| {v} | {bs} | {k} | {med:.2f} | {ratio:.2f} | {tok:.3f} | {med / bs / tok:.3f} | "
                             f"{tok_ratio:.2f} | {'-' if k == 0 else f'{100 * share:.0f}%'} |")
    lines += ["", "## Acceptance", "",
              "| pair | k | drafts | draft tokens | accepted | acceptance rate |", "|---|---|---|---|---|---|"]
    for v, k in keys:
        if not k:
            continue
        st = engines[(v, k)].get_stats()
        dt_ = st["spec_decode_num_draft_tokens"]
        lines.append(f"| {v} | {k} | {st['spec_decode_num_drafts']} | {dt_} | "
                     f"{st['spec_decode_num_accepted_tokens']} | "
                     f"{100 * st['spec_decode_num_accepted_tokens'] / max(1, dt_):.2f}% |")
    write_markdown(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   f"{time.strftime('%Y-%m-%d')}-spec-decode-mtp.md", lines)


if __name__ == "__main__":
    main()
