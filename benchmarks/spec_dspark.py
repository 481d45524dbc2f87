"""DSpark on a tiny Kimi K3 layout (CPU, float32): the verified step cost per k, and acceptance with a perfect drafter.

Target: a K3-shaped random checkpoint (nested text_config, hybrid KDA + gated NoPE MLA with attention residuals,
latent MoE with MXFP4 experts; 8 layers, hidden 128). Drafter: a random SpecForge-layout ``KimiK3DSpark5MLADraftModel``
(5 MLA layers, block_size 7, taps after target layers 1, 3, 5, 7, Markov rank 32).

For k = 0 (no speculation), 3 and 6 at batch 1 and 16, measured side by side (each round runs every variant once,
in turn; medians over rounds of per-round medians):

* ``perfect``: the drafter pass runs and its drafts are replaced by the target's own greedy continuation (known
  from a plain run), so every draft is accepted: the step emits k + 1 tokens per row (the upper bound).
* ``random``: the random drafter as is (its acceptance on a random target is ~0: the verification cost per
  emitted token when drafting does not pay; the policy's switch-off is disabled here).

Per variant: ms per engine step (draft pass + verification + acceptance + KDA state roll back), of which the drafter
pass (``propose``), tokens emitted per row and step, ms per emitted token, acceptance rate.

Usage: ``python benchmarks/spec_dspark.py [--rounds 3] [--steps 6] [--threads 1] [--label dspark]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from engine_steps import step_seconds  # noqa: E402
from results_file import write_markdown  # noqa: E402

from tokenfab.testing.tiny_k3 import k3_text_config  # noqa: E402

TEXT = k3_text_config(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=8,
                      kv_lora_rank=32, q_lora_rank=48, num_experts=8, routed_expert_hidden_size=64,
                      attn_res_block_size=4, model_max_length=4096, kda_layers=(1, 2, 3, 5, 6, 7),
                      full_attn_layers=(4, 8), kda_head_dim=32)
TAPS = (1, 3, 5, 7)
ALWAYS = {"verify_token_cost": 0.0, "verify_step_overhead": 0.0, "random_row_cost": 0.0}


def build(root: str) -> tuple[str, str]:
    from test_kimi_k3 import k3_tensors, write_k3
    from tokenfab.testing.tiny_dspark import write_tiny_dspark
    from tokenfab.testing.tokenizer_builder import build_tokenizer
    tok = build_tokenizer(os.path.join(root, "tok"), vocab_size=512)
    stored, _ = k3_tensors(TEXT)
    target = write_k3(os.path.join(root, "k3"), tok, text=TEXT, tensors=stored)
    drafter = write_tiny_dspark(os.path.join(root, "dspark"), "specforge", ["mla"] * 5, hidden=128, target_hidden=128,
                                target_layer_ids=TAPS, target_num_layers=8, block_size=7, intermediate=256,
                                markov_rank=32, seed=1)[0]
    return target, drafter


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (length,), generator=g).tolist() for _ in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--label", default="dspark")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenfab import LLM, SamplingParams
    root = tempfile.mkdtemp(prefix="spec-dspark-")
    target, drafter = build(root)
    batches, ks = (1, 16), (0, 3, 6)
    max_new = (args.steps + 3) * 7 + 8
    sp = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    P = {bs: prompts(bs, args.prompt_len, seed=bs) for bs in batches}
    plain = LLM(target, dtype="float32", progress=False, max_num_seqs=16, max_model_len=2048)
    cont = {bs: [p + o.outputs[0].token_ids for p, o in zip(P[bs], plain.generate(
        [{"prompt_token_ids": p} for p in P[bs]], sp, use_tqdm=False))] for bs in batches}
    engines = {0: plain.llm_engine}
    for k in ks[1:]:
        engines[k] = LLM(target, dtype="float32", progress=False, max_num_seqs=16, max_model_len=2048,
                         speculative_config=dict(ALWAYS, method="dspark", model=drafter,
                                                 num_speculative_tokens=k)).llm_engine
    results: dict[tuple, list] = {}

    def run(k: int, bs: int, mode: str):
        eng = engines[k]
        full = {}
        prop = eng.spec.proposer if eng.spec is not None else None
        t_prop = []
        if prop is not None:
            orig = type(prop).propose

            def propose(seqs, rows, token_ids, lengths, max_lens):
                t0 = time.perf_counter()
                out = orig(prop, seqs, rows, token_ids, lengths, max_lens)
                if mode == "perfect":
                    for i, (s, L) in enumerate(zip(seqs, lengths)):
                        want = full[s.request_id][L:L + out.draft_ids.shape[1]]
                        out.draft_ids[i, :len(want)] = want
                t_prop.append(time.perf_counter() - t0)
                return out

            prop.propose = propose
        for i, p in enumerate(P[bs]):
            rid = f"{mode}-{k}-{bs}-{i}-{time.monotonic_ns()}"
            full[rid] = cont[bs][i]
            eng.add_request(rid, None, p, sp)
        while any(s.num_output_tokens == 0 for r in eng.requests.values() for s in r.seqs):
            eng.step()
        for _ in range(2):
            eng.step()
        st0 = dict(eng.get_stats())
        out0 = sum(s.num_output_tokens for r in eng.requests.values() for s in r.seqs)
        t_prop.clear()
        ts = step_seconds(eng, args.steps)
        out1 = sum(s.num_output_tokens for r in eng.requests.values() for s in r.seqs)
        st1 = eng.get_stats()
        for rid in list(eng.requests):
            eng.abort_request(rid)
        if prop is not None:
            del prop.propose
        dt = st1.get("spec_decode_num_draft_tokens", 0) - st0.get("spec_decode_num_draft_tokens", 0)
        da = st1.get("spec_decode_num_accepted_tokens", 0) - st0.get("spec_decode_num_accepted_tokens", 0)
        tok_per_row_step = (out1 - out0) / (args.steps * bs)
        step_ms = 1e3 * statistics.median(ts)
        min_ms = 1e3 * min(ts)
        prop_ms = 1e3 * statistics.median(t_prop) if t_prop else 0.0
        results.setdefault((mode, k, bs), []).append((step_ms, prop_ms, tok_per_row_step, da / dt if dt else None,
                                                      min_ms))
        print(f"{mode:7s} k={k} batch={bs:2d}: {step_ms:7.2f} ms/step (draft {prop_ms:6.2f}), "
              f"{tok_per_row_step:.2f} tok/row/step, acceptance {da}/{dt}", flush=True)

    for r in range(args.rounds):
        for bs in batches:
            for k in ks:
                for mode in (("plain",) if k == 0 else ("perfect", "random")):
                    run(k, bs, mode)
    lines = ["# DSpark on a tiny Kimi K3 layout: verified step cost per k, perfect-drafter acceptance", "",
             f"Command: `python benchmarks/spec_dspark.py --rounds {args.rounds} --steps {args.steps} "
             f"--prompt-len {args.prompt_len} --threads {args.threads}` (CPU, float32, {args.threads} thread(s), a "
             "heavily shared 2-core machine: absolute times are noise, compare rows within this table; ms / step is "
             "the median over rounds of each round's median step, `min` the fastest step seen; variants "
             "interleaved within each round).", "",
             "Target: K3-shaped random checkpoint, 8 layers (6 KDA + 2 gated NoPE MLA), hidden 128, attention "
             "residuals (block 4), latent MoE (8 experts, top-2, MXFP4). Drafter: random SpecForge-layout "
             "KimiK3DSpark5MLADraftModel (5 MLA layers, block_size 7 -> up to 6 drafts, taps after layers 1, 3, 5, "
             f"7, Markov rank 32). Prompts {args.prompt_len} random tokens, greedy.", "",
             "| drafter | k | batch | ms / step | min ms / step | of which draft pass | tokens / row / step "
             "| ms / token / row | step cost vs k=0 (median, min) | acceptance |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base, base_min = {}, {}
    for (mode, k, bs), rs in results.items():
        if k == 0:
            base[bs], base_min[bs] = statistics.median(r[0] for r in rs), min(r[4] for r in rs)
    for (mode, k, bs), rs in sorted(results.items(), key=lambda x: (x[0][2], x[0][1], x[0][0])):
        step = statistics.median(r[0] for r in rs)
        prop_ms = statistics.median(r[1] for r in rs)
        tps = statistics.median(r[2] for r in rs)
        acc = [r[3] for r in rs if r[3] is not None]
        mn = min(r[4] for r in rs)
        lines.append(f"| {mode} | {k} | {bs} | {step:.1f} | {mn:.1f} | {prop_ms:.1f} | {tps:.2f} | {step / tps:.1f} | "
                     f"{step / base[bs]:.2f}x, {mn / base_min[bs]:.2f}x | "
                     f"{'-' if not acc else f'{100 * statistics.median(acc):.1f}%'} |")
    lines += ["", "Read: `step cost vs k=0` is the verified step (drafter pass + target forward over 1 + k tokens "
              "per row + acceptance + KDA state roll back) relative to a plain decode step at the same batch; "
              "`ms / token / row` divides by the tokens a row emits per step (k + 1 when every draft is accepted)."]
    write_markdown(os.path.join(HERE, "results"), f"2026-12-01-spec-decode-{args.label}.md", lines)


if __name__ == "__main__":
    main()
