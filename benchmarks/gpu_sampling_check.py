"""Sampling on the device against the host sampler, on the same device's logits (a GPU check step).

One engine on ``--device`` (the embedded default model, float32) serves the same requests twice: once with every
batch drawn where the logits are (``ModelRunner.device_draw``: ``Sampler.draw_on_device`` for plain rows,
``Sampler.on_device`` for rows with logits processors or below min_tokens, prompt logprobs scored there) and once
with the logits copied to the host sampler. The requests cover greedy and seeded / unseeded temperature rows, top-k
/ top-p, repetition / frequency / presence penalties, min_p, logit_bias, allowed_token_ids, bad words, min_tokens,
logprobs and prompt logprobs, and a regex structured output, in one batch; then n-gram speculation (verification
on the device vs on the host) over greedy, seeded, top-k and penalized rows. Both runs see the same forward (the
model's logits do not depend on the sampler), so greedy rows must give the same tokens; sampled rows too unless
the device's softmax rounds a uniform across a cdf step (rare: reported, not failed); logprobs within 1e-4.

    .venv/bin/python benchmarks/gpu_sampling_check.py --device cuda [--out DIR]

Prints one line per request and a verdict; writes ``sampling_check.json`` to ``--out``; exits 1 when a greedy row
differs, a logprob is off or either run raises (a device mismatch in the device path shows up here first).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def requests():
    """(prompt token ids, SamplingParams) pairs: every sampler feature in one batch."""
    from tokenfab import SamplingParams, StructuredOutputsParams
    n = 8
    P = SamplingParams
    return [
        ([5, 17, 42, 99, 7], P(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)),
        ([3, 250, 11], P(temperature=0.9, seed=7, max_tokens=n, ignore_eos=True)),
        ([400, 8, 77, 301], P(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=n, ignore_eos=True)),
        ([66, 2, 9], P(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3,
                       max_tokens=n, ignore_eos=True, logprobs=1)),
        ([12, 13, 14], P(temperature=0.7, min_p=0.1, logit_bias={5: 3.0, 6: -50.0}, seed=3, max_tokens=n,
                         ignore_eos=True)),
        ([21, 22], P(temperature=0.0, allowed_token_ids=[3, 9, 14, 27, 40, 41], max_tokens=n, ignore_eos=True)),
        ([31, 32, 33], P(temperature=0.0, min_tokens=4, max_tokens=n, prompt_logprobs=2)),
        ([41, 42, 43, 44], P(temperature=0.0, max_tokens=n, structured_outputs=StructuredOutputsParams(
            regex=r"[0-9]{2}-[a-z]{3}"))),
        ([51, 52], P(temperature=0.0, bad_words=["the"], max_tokens=n, ignore_eos=True)),
    ]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "verify_token_cost": 0.0, "verify_step_overhead": 0.0, "random_row_cost": 0.0}  # always draft


def spec_requests():
    """Prompts with repeats (n-gram drafts find matches): greedy with logprobs, seeded and unseeded sampled rows,
    top-k, a repetition penalty below min_tokens."""
    from tokenfab import SamplingParams
    base = [11, 23, 37, 41, 53, 67, 79, 83, 97, 101, 113, 127]
    prompts = [(base[: 3 + i] * 8)[: 7 + 9 * i] for i in range(4)]
    P = SamplingParams
    params = [P(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
              P(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
              P(temperature=0.8, top_k=20, max_tokens=12, ignore_eos=True),
              P(temperature=0.0, repetition_penalty=1.2, min_tokens=6, max_tokens=12)]
    return list(zip(prompts, params))


def run(llm, device_draw: bool, reqs=None):
    runner = llm.llm_engine.runner
    runner.device_draw = device_draw
    if runner.device.type == "cpu":  # a dry run: the module forward and the PyTorch sampler, as on a GPU
        runner.cpu_decode_stack = None
        runner.sampler.use_cpu_kernels = False
    reqs = reqs or requests()
    llm.llm_engine.generator.manual_seed(11)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [sorted((t, e.logprob) for t, e in d.items()) for d in (c.logprobs or [])]
        plp = [None if d is None else sorted((t, e.logprob) for t, e in d.items()) for d in (o.prompt_logprobs or [])]
        res.append({"tokens": list(c.token_ids), "logprobs": lps, "prompt_logprobs": plp})
    return res


def max_logprob_diff(a, b) -> float:
    """Largest |difference| between two runs' logprob entries (lists of per-position sorted (token, logprob) or
    None); inf when their shapes or token sets differ."""
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            if (x is None) != (y is None):
                return float("inf")
            continue
        if [t for t, _ in x] != [t for t, _ in y]:
            return float("inf")
        worst = max([worst] + [abs(u - v) for (_, u), (_, v) in zip(x, y)])
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    ap.add_argument("--out", default=None, help="folder for sampling_check.json")
    args = ap.parse_args()
    from tokenfab import LLM
    from tokenfab.default_model import ensure_default_model
    # eager: the sampler is what is checked, and graph capture would cost most of the step's time budget
    llm = LLM(args.model or ensure_default_model(), dtype="float32", device=args.device, max_model_len=128,
              seed=11, progress=False, enforce_eager=True)
    host = run(llm, False)
    dev = run(llm, True)
    reqs = requests()
    del llm
    spec = LLM(args.model or ensure_default_model(), dtype="float32", device=args.device, max_model_len=128,
               seed=11, progress=False, speculative_config=NGRAM, enforce_eager=True)  # verification on the device vs the host
    host += run(spec, False, spec_requests())
    dev += run(spec, True, spec_requests())
    reqs += spec_requests()
    bad, rows = 0, []
    for i, ((_, sp), h, d) in enumerate(zip(reqs, host, dev)):
        greedy = sp.temperature < 1e-5
        same = h["tokens"] == d["tokens"]
        lp = max(max_logprob_diff(h["logprobs"], d["logprobs"]), max_logprob_diff(h["prompt_logprobs"],
                                                                                   d["prompt_logprobs"]))
        ok = (same or not greedy) and (not same or lp <= 1e-4)
        bad += not ok
        rows.append({"request": i, "greedy": greedy, "same_tokens": same, "max_logprob_diff": lp, "ok": ok})
        print(f"request {i}{' (speculative)' if i >= len(requests()) else ''}: {'greedy' if greedy else 'sampled'} tokens {'equal' if same else 'DIFFER'}, "
              f"logprob diff {lp:.2e} {'ok' if ok else 'FAILED'}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sampling_check.json"), "w") as f:
            json.dump({"device": args.device, "rows": rows, "host": host, "device_draw": dev}, f)
    print(f"sampling on the device vs the host sampler: {len(rows) - bad}/{len(rows)} requests ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
