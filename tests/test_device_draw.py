"""GPU engines draw plain rows where the logits are (ModelRunner.device_draw -> Sampler.draw_on_device) and copy back
only the sampled ids. On CPU the same code runs with ``device_draw`` forced on: every request's tokens must equal
those of the host sampler (greedy, temperature with and without seeds, mixed batches), the RNG streams must stay
in step (later draws equal too); batches with top-k / top-p rows are drawn on the device too (the sorted draw); rows
with logprobs get them on the device, equal to the host's; rows with penalties or below min_tokens must fall back to
the host sampler."""
from __future__ import annotations

import pytest

from tokenfab import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11], [400, 8, 77, 301, 12, 9], [66, 2]]


def run(path: str, params, device_draw: bool, logprobs: list | None = None):
    """Greedy/sampled outputs of PROMPTS with ``params`` (one per prompt), the runner's device draw forced
    on or off; returns (token ids per prompt, number of steps the device draw served)."""
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64, seed=11, progress=False)
    runner = llm.llm_engine.runner
    runner.device_draw = device_draw
    runner.cpu_decode_stack = None  # the module forward and the sampler, as on a GPU (no fused C++ draw)
    runner.sampler.use_cpu_kernels = False  # a GPU engine's host sampler runs in PyTorch
    served = []
    real = runner.sampler.draw_on_device

    def spy(*a, **k):
        out = real(*a, **k)
        served.append(out is not None)
        return out
    runner.sampler.draw_on_device = spy
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    if logprobs is not None:
        logprobs.extend(o.outputs[0].logprobs for o in outs)
    return [o.outputs[0].token_ids for o in outs], sum(served)


@pytest.mark.parametrize("case", ["greedy", "temperature", "seeded_mixed"])
def test_device_draw_equals_the_host_sampler(tiny_model, case):
    path = tiny_model("llama")
    n = 8
    if case == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    elif case == "temperature":
        params = SamplingParams(temperature=0.9, max_tokens=n, ignore_eos=True)
    else:  # greedy beside seeded and unseeded temperature rows in one batch
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                  SamplingParams(temperature=1.3, seed=7, max_tokens=n, ignore_eos=True),
                  SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True),
                  SamplingParams(temperature=1.0, seed=123, max_tokens=n, ignore_eos=True)]
    host, host_served = run(path, params, False)
    dev, dev_served = run(path, params, True)
    assert host_served == 0 and dev_served >= n  # every decode step (and the prefill step's draw) served
    assert dev == host
    assert all(len(t) == n for t in dev)


def test_rows_that_are_not_plain_fall_back(tiny_model):
    """repetition penalty rows are drawn by the host sampler: draw_on_device serves no step,
    and the tokens equal the host-only run's. min_tokens=3 of 5: the three draws below it (EOS masked) on the host,
    the last two (plain again) on the device."""
    path = tiny_model("llama")
    for p, want in ((SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=5, ignore_eos=True), 0),
                    (SamplingParams(temperature=0.0, min_tokens=3, max_tokens=5, ignore_eos=True), 2)):
        host, _ = run(path, p, False)
        dev, served = run(path, p, True)
        assert served == want and dev == host, p


def test_top_k_top_p_rows_drawn_on_the_device(tiny_model):
    """top-k and top-p rows (seeded and not) beside plain and greedy ones: every step on the device, the tokens the
    host sampler's sorted draw gives."""
    path = tiny_model("llama")
    n = 6
    for params in (SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=n, ignore_eos=True),
                   [SamplingParams(temperature=0.9, top_p=0.7, max_tokens=n, ignore_eos=True),
                    SamplingParams(temperature=1.2, top_k=3, top_p=0.9, seed=5, max_tokens=n, ignore_eos=True),
                    SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True),
                    SamplingParams(temperature=0.0, top_k=4, max_tokens=n, ignore_eos=True)]):
        host, host_served = run(path, params, False)
        dev, dev_served = run(path, params, True)
        assert host_served == 0 and dev_served == n and dev == host, params


def test_logprobs_rows_drawn_on_the_device(tiny_model):
    """Rows asking for logprobs (top 3, and 0: the chosen token's only) beside top-p and greedy rows: drawn on the
    device, tokens and every logprob / rank entry equal to the host sampler's."""
    path = tiny_model("llama")
    n = 5
    params = [SamplingParams(temperature=0.0, logprobs=3, max_tokens=n, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.8, logprobs=0, seed=2, max_tokens=n, ignore_eos=True),
              SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True),
              SamplingParams(temperature=1.1, logprobs=1, max_tokens=n, ignore_eos=True)]
    host_lp, dev_lp = [], []
    host, host_served = run(path, params, False, host_lp)
    dev, dev_served = run(path, params, True, dev_lp)
    assert host_served == 0 and dev_served == n and dev == host
    flat = lambda lps: [[(t, e.logprob, e.rank) for d in seq for t, e in sorted(d.items())] if seq else seq
                        for seq in lps]
    assert flat(dev_lp) == flat(host_lp) and host_lp[0] and len(host_lp[0][0]) >= 3
