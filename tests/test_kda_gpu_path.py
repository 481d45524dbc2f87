"""The tiny Kimi Linear (KDA with the softplus gate) and Kimi K3 (KDA with the lower-bound sigmoid gate) engines on the
GPU code path (``TOKENFAB_TRITON=interpret-gpu-path``: every GPU-path choice taken, the Triton kernels run by Triton's
interpreter, the KDA layers through kernels/gpu/kda.py) against the same engines on the CPU path: greedy tokens,
logprobs and the state slots, over chunked prefill mixed with decode, the padded decode-graph buffers with their
spare state slot, and preemption in the middle of a prefill with prefix-cache state snapshots restored.
"""
from __future__ import annotations

import pytest
import torch

from tokenfab import LLM, SamplingParams
from tokenfab.kernels.gpu import support as triton_support

pytestmark = pytest.mark.skipif(not triton_support.triton_importable(), reason="triton is not installed")


@pytest.fixture(scope="module")
def hybrid_paths(tmp_path_factory, tokenizer_dir):
    """The tiny Kimi Linear and Kimi K3 (full-rank output gate, MXFP4 experts) checkpoints of
    tests/test_kimi_linear.py and tests/test_kimi_k3.py."""
    from test_kimi_k3 import TEXT, k3_tensors, write_k3
    from test_kimi_linear import make_kimi_linear
    stored, _ = k3_tensors(TEXT, seed=5)
    return {"kimi_linear": make_kimi_linear(str(tmp_path_factory.mktemp("kda_kl")), tokenizer_dir, seed=3),
            "k3": write_k3(str(tmp_path_factory.mktemp("kda_k3")), tokenizer_dir, tensors=stored)}


@pytest.fixture
def no_cpu_kernels(monkeypatch):
    """Both sides without the C++ kernels (a GPU machine has none loaded; the CPU side then runs layers/kda.py)."""
    from tokenfab.kernels.cpu import build as cpu_build

    monkeypatch.setenv("TOKENFAB_CPU_KERNELS", "0")
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "0")
    monkeypatch.setattr(cpu_build, "load", lambda: None)


def gpu_path(monkeypatch) -> list[tuple[int, ...]]:
    """Switch the seam to the GPU path; returns the list the KDA kernels' calls append their group's shape to:
    (B, Q, 3HD) for the recurrence after the conv kernel, (B, 1, "fused") for a decode group in one launch."""
    from tokenfab.kernels.gpu import kda
    calls = []
    orig, orig_fused = kda.kda_recurrent, kda.kda_decode_fused
    monkeypatch.setattr(kda, "kda_recurrent", lambda *a, **k: calls.append(tuple(a[0].shape)) or orig(*a, **k))
    monkeypatch.setattr(kda, "kda_decode_fused",
                        lambda *a, **k: calls.append((a[6].shape[0], 1, "fused")) or orig_fused(*a, **k))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret-gpu-path")
    monkeypatch.setenv("TOKENFAB_CPU_LINEAR", "torch")
    return calls


def generate(path: str, prompts, max_tokens: int, **kw):
    args = dict(dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=16, block_size=8,
                max_num_seqs=4, progress=False)
    args.update(kw)
    llm = LLM(path, **args)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def assert_same(ref, got, label: str) -> None:
    for i, (r, g) in enumerate(zip(ref, got)):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids, f"{label}: request {i}: tokens differ"
        for a, b, t in zip(r.outputs[0].logprobs, g.outputs[0].logprobs, r.outputs[0].token_ids):
            assert abs(a[t].logprob - b[t].logprob) < 1e-4, f"{label}: request {i}: logprob differs"


@pytest.mark.parametrize("model", ["kimi_linear", "k3"])
def test_models_on_gpu_path_match_cpu_path(monkeypatch, no_cpu_kernels, hybrid_paths, model):
    """A 20-token prompt prefilled over two steps while the others decode, then decode steps of 3 sequences in the
    size-4 graph buffers (the padding row in the spare state slot 4): tokens and logprobs equal the CPU path's
    without graphs; every real slot ends with the same conv and recurrent state, the spare slot with the padding
    row's."""
    from test_engine_exact import make_prompts
    prompts = make_prompts(7, [20, 3, 6])
    ref_llm, ref = generate(hybrid_paths[model], prompts, 3)
    calls = gpu_path(monkeypatch)
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", "eager")
    llm, got = generate(hybrid_paths[model], prompts, 3)
    assert (4, 1, "fused") in calls and any(s[1] > 1 for s in calls), calls  # padded decode, prefill
    assert_same(ref, got, model)
    spare = llm.llm_engine.runner.decode_graphs.state_slot
    assert spare == 4
    for c_ref, c in zip(ref_llm.llm_engine.runner.state_caches, llm.llm_engine.runner.state_caches):
        torch.testing.assert_close(c.recurrent[:spare], c_ref.recurrent, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c.conv[:spare], c_ref.conv, rtol=1e-4, atol=1e-4)
        assert c.recurrent[spare].abs().sum() > 0  # the padding row's state went to the spare slot


def test_preemption_and_prefix_snapshots_on_gpu_path(monkeypatch, no_cpu_kernels, hybrid_paths,
                                                     mid_prefill_preemptions):
    """Kimi Linear on the GPU path with prefix caching and a pool of 7 blocks x 8 for three 23-28-token prompts sharing
    16 tokens: sequences are preempted in the middle of their prefill (their slots restart from zero) while others
    restore a KDA state snapshot at the shared prefix into their slot, which the kernel then reads in place; tokens
    equal the CPU path's without prefix caching."""
    from test_prefix_caching import rand_tokens
    pre = rand_tokens(11, 16)
    prompts = [pre + rand_tokens(12 + i, n) for i, n in enumerate((10, 7, 12))]
    kw = dict(num_kv_blocks=7, max_model_len=40)
    _, ref = generate(hybrid_paths["kimi_linear"], prompts, 4, **kw)
    calls = gpu_path(monkeypatch)
    llm, _ = generate(hybrid_paths["kimi_linear"], [pre + [5]], 1, enable_prefix_caching=True, **kw)
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert calls
    assert_same(ref, got, "preemption + prefix snapshots")
    assert eng.scheduler.num_preemptions > 0 and any(mid_prefill_preemptions)
    assert eng.block_manager.prefix_cache.snapshots.num_restored > 0


@pytest.mark.parametrize("graphs", ["0", "eager"])
def test_speculative_rows_on_gpu_path(monkeypatch, no_cpu_kernels, hybrid_paths, graphs):
    """n-gram speculation on Kimi Linear on the GPU path: verification rows through the short-conv and recurrence
    kernels with their states held, then committed to the accepted prefix by the same kernels (engine/
    state_commit.py): greedy tokens equal the CPU path's without speculation, with drafts rejected. ``eager``: the
    verification steps from the padded decode-graph buffers (attention rows flat, the KDA layers over [bs, 4]) and
    their commit over every row, neither reading the device from the host (CUDA captures both)."""
    from spec_helpers import NGRAM, spec_prompts, token_ids
    from tokenfab.kernels.gpu import short_conv
    path = hybrid_paths["kimi_linear"]
    n = 2  # with the buffers (eager), padding sequences too: tests/test_decode_graphs.py (PyTorch path)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = token_ids(LLM(path, dtype="float32", device="cpu", max_model_len=128, progress=False)
                     .generate(spec_prompts(n), sp, use_tqdm=False))
    gpu_path(monkeypatch)
    widths = []
    orig = short_conv.short_conv
    monkeypatch.setattr(short_conv, "short_conv",
                        lambda *a, **k: widths.append(a[1].shape[1]) or orig(*a, **k))
    monkeypatch.setenv("TOKENFAB_DECODE_GRAPHS", graphs)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, max_num_seqs=16, progress=False,
              speculative_config=NGRAM)
    syncs = []
    if graphs == "eager":  # the buffers' forward and commit, which CUDA would capture: no host read of the device
        from tokenfab.testing.kernel_count import KernelCounter
        g = llm.llm_engine.runner.decode_graphs

        def counted(fn, verify_only):
            calls = [0]

            def run(*a):
                if verify_only and a[-1].state_group is None or calls[0] >= 2:  # two verification steps and two
                    return fn(*a)  # commits are enough (counting is slow in the interpreter)
                calls[0] += 1
                kc = KernelCounter()
                with kc, kc.scope("captured"):
                    out = fn(*a)
                syncs.extend(kc.syncs)
                return out
            return run
        g.forward, g._commit = counted(g.forward, True), counted(g._commit, False)
    assert token_ids(llm.generate(spec_prompts(n), sp, use_tqdm=False)) == base
    if graphs == "eager":
        assert llm.llm_engine.runner.decode_graphs.verify_replays > 0 and not syncs, syncs
    st = llm.llm_engine.get_stats()
    # drafts rejected: their rows committed fewer tokens than they ran (a wrong commit changes later tokens)
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_num_accepted_tokens"] < st[
        "spec_decode_num_draft_tokens"], st
    assert max(widths) > 1  # verification rows (1 + k tokens a sequence) went through the conv kernel
