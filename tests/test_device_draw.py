"""GPU engines draw rows where the logits are (ModelRunner.device_draw -> Sampler.draw_on_device) and copy back
only the sampled ids. On CPU the same code runs with ``device_draw`` forced on: every request's tokens must equal
those of the host sampler (greedy, temperature with and without seeds, mixed batches), the RNG streams must stay
in step (later draws equal too); batches with top-k / top-p rows are drawn on the device too (the sorted draw); rows
with logprobs get them on the device, equal to the host's; rows with logits processors (penalties, min_p,
logit_bias, allowed_token_ids, bad words) or below min_tokens take the full sampler on the device
(Sampler.on_device), with the host sampler's tokens and logprobs."""
from __future__ import annotations

import pytest

from spec_helpers import NGRAM, spec_prompts
from tokenfab import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11], [400, 8, 77, 301, 12, 9], [66, 2]]


def gpu_flow_engine(path: str, device_draw: bool, **kw) -> LLM:
    """A float32 CPU engine run as a GPU engine runs (the module forward, the PyTorch sampler, no fused C++ draw),
    its device draw forced on or off."""
    llm = LLM(path, dtype="float32", device="cpu", progress=False, **kw)
    runner = llm.llm_engine.runner
    runner.device_draw = device_draw
    runner.cpu_decode_stack = None
    runner.sampler.use_cpu_kernels = False
    return llm


def run(path: str, params, device_draw: bool, logprobs: list | None = None, full: list | None = None):
    """Greedy/sampled outputs of PROMPTS with ``params`` (one per prompt), the runner's device draw forced
    on or off; returns (token ids per prompt, number of steps the device draw served). ``full``: appended one
    entry per step the full sampler served on the device (Sampler.on_device)."""
    llm = gpu_flow_engine(path, device_draw, max_model_len=64, seed=11)
    runner = llm.llm_engine.runner
    served = []
    real = runner.sampler.draw_on_device

    def spy(*a, **k):
        out = real(*a, **k)
        served.append(out is not None)
        return out
    runner.sampler.draw_on_device = spy
    real_full = runner.sampler.on_device

    def spy_full(*a, **k):
        if full is not None:
            full.append(1)
        return real_full(*a, **k)
    runner.sampler.on_device = spy_full
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


@pytest.mark.parametrize("case", ["penalties", "min_tokens", "mixed_processors"])
def test_rows_with_processors_drawn_on_the_device(tiny_model, case):
    """Rows with logits processors or below min_tokens: every step drawn where the logits are, by the full sampler
    (Sampler.on_device) whenever draw_on_device declines, with the host sampler's tokens (and logprobs)."""
    path = tiny_model("llama")
    n = 6
    if case == "penalties":  # repetition 1 row; min_tokens 3 of 6: three steps below it, then plain on the device
        params = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=n, ignore_eos=True)
    elif case == "min_tokens":
        params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=n, ignore_eos=True)
    else:  # every processor in one batch, beside a plain row, seeded and unseeded, with logprobs
        params = [SamplingParams(temperature=0.9, frequency_penalty=0.7, presence_penalty=0.4, seed=3,
                                 max_tokens=n, ignore_eos=True, logprobs=2),
                  SamplingParams(temperature=0.8, min_p=0.2, logit_bias={7: 5.0, 12: -100.0}, top_k=20,
                                 max_tokens=n, ignore_eos=True),
                  SamplingParams(temperature=0.0, allowed_token_ids=[3, 9, 14, 27, 40], bad_words=None,
                                 min_tokens=2, max_tokens=n, ignore_eos=True),
                  SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True)]
    host_lp, dev_lp, full = [], [], []
    host, host_served = run(path, params, False, host_lp)
    dev, dev_served = run(path, params, True, dev_lp, full)
    assert host_served == 0 and dev == host, params
    flat = lambda lps: [[(t, e.logprob, e.rank) for d in seq for t, e in sorted(d.items())] if seq else seq
                        for seq in lps]
    assert flat(dev_lp) == flat(host_lp)
    want_full = {"penalties": n, "min_tokens": 3, "mixed_processors": n}[case]
    assert len(full) == want_full, (case, len(full))
    if case == "min_tokens":
        assert dev_served == n - 3  # plain again after min_tokens: draw_on_device
    if case == "mixed_processors":
        assert all(t in (3, 9, 14, 27, 40) for t in dev[2]) and 12 not in dev[1]


def test_bad_words_drawn_on_the_device(tiny_model):
    """Single-token bad words beside a repetition penalty, masked on the device path as on the host's: equal
    tokens, none of them banned."""
    from transformers import AutoTokenizer
    path = tiny_model("llama")
    tok = AutoTokenizer.from_pretrained(path)
    words = [w for w in (" the", " a", " of", " and") if len(tok(w, add_special_tokens=False)["input_ids"]) == 1]
    params = SamplingParams(temperature=0.0, bad_words=words[:2], max_tokens=6, ignore_eos=True,
                            repetition_penalty=1.1)
    full = []
    host, _ = run(path, params, False)
    dev, _ = run(path, params, True, None, full)
    assert dev == host and len(full) == 6
    banned = {tok(w, add_special_tokens=False)["input_ids"][0] for w in words[:2]}
    assert not banned & {t for seq in dev for t in seq}


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


def test_structured_output_rows_drawn_on_the_device(tiny_model):
    """Rows with a grammar (regex, choice; sampled and greedy) beside a plain row: the full sampler on the device,
    the host sampler's tokens."""
    from tokenfab import StructuredOutputsParams
    path = tiny_model("llama")
    params = [SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
                  choice=["alpha", "zebra"])),
              SamplingParams(temperature=0.9, seed=4, max_tokens=8, structured_outputs=StructuredOutputsParams(
                  regex=r"[0-9]{3}-[a-z]{2}")),
              SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    full = []
    host, _ = run(path, params, False)
    dev, _ = run(path, params, True, None, full)
    assert dev == host and full


def test_prompt_logprobs_steps_drawn_on_the_device(tiny_model):
    """Steps holding prompt-logprob rows (prompt_logprobs=2, prefill chunked over several steps) score them on the
    logits' device and still draw their samples there: every entry equal to the host path's."""
    path = tiny_model("llama")
    outs = {}
    for device_draw in (False, True):
        llm = gpu_flow_engine(path, device_draw, max_model_len=64, seed=5, max_num_batched_tokens=8)
        runner = llm.llm_engine.runner
        served = []
        real = runner.sampler.draw_on_device
        runner.sampler.draw_on_device = lambda *a, **k: served.append(1) or real(*a, **k)
        params = [SamplingParams(temperature=0.8, seed=9, max_tokens=4, prompt_logprobs=2, ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)]
        prompts = [list(range(30, 50)), PROMPTS[3]]  # 20 + 2 tokens over an 8-token step budget: 3 prefill steps
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[device_draw] = [(o.outputs[0].token_ids,
                              [None if d is None else sorted((t, e.logprob, e.rank) for t, e in d.items())
                               for d in o.prompt_logprobs or []]) for o in res]
        assert bool(served) == device_draw
    assert outs[True] == outs[False] and len(outs[True][0][1]) == 20 and outs[True][0][1][1]


def test_speculative_verification_with_the_device_draw(tiny_model):
    """n-gram speculation with the logits kept where they are (a GPU engine's flow: verification on the logits'
    device, the other rows by the device draw): greedy with logprobs, seeded and unseeded sampled rows, top-k,
    a repetition penalty below min_tokens; the tokens and logprobs of the host path, drafts verified."""
    import tokenfab.spec_decode.spec_decoder as sd
    path = tiny_model("llama")
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.2, min_tokens=6, max_tokens=12)]
    outs, verified = {}, {}
    real = sd.rejection_sample
    for device_draw in (False, True):
        llm = gpu_flow_engine(path, device_draw, seed=3, speculative_config=NGRAM)
        count = []
        sd.rejection_sample = lambda *a, **k: count.append(1) or real(*a, **k)
        try:
            res = llm.generate(spec_prompts(), params, use_tqdm=False)
        finally:
            sd.rejection_sample = real
        verified[device_draw] = len(count)
        outs[device_draw] = [(o.outputs[0].token_ids,
                              [sorted((t, e.logprob, e.rank) for t, e in d.items()) for d in o.outputs[0].logprobs or []])
                             for o in res]
    assert verified[True] > 0 and verified[True] == verified[False]
    assert outs[True] == outs[False]
