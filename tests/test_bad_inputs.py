"""Bad input fails with a clear error naming the problem: unknown architecture, missing weight, too-long prompt."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tokenfab import LLM, SamplingParams
from tokenfab.cli import main
from tokenfab.config import ConfigError
from tokenfab.errors import PromptTooLongError, WeightLoadError


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_unknown_architecture(tiny_model, tmp_path, capsys):
    path = copy_ckpt(tiny_model("llama"), tmp_path / "m")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["architectures"] = ["MambaForCausalLM"]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ConfigError, match="MambaForCausalLM.*architectures.*LlamaForCausalLM"):
        LLM(path, progress=False)
    rc = main(["generate", path, "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "MambaForCausalLM" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
def test_malformed_json_is_one_line_naming_file_and_position(tiny_model, tmp_path, capsys, command, file):
    """A config.json / generation_config.json that is not valid JSON (a trailing comma, line 3): an error naming
    the file, line and column; the CLI prints that one line (exit status 2), no JSONDecodeError traceback."""
    path = copy_ckpt(tiny_model("llama"), tmp_path / "m")
    with open(os.path.join(path, file), "w") as f:
        f.write('{\n  "model_type": "llama",\n}\n')
    where = os.path.join(path, file)
    with pytest.raises(ValueError, match=f"{re.escape(where)}: not valid JSON at line 3, column 1"):
        LLM(path, progress=False)
    rc = main([command, path] + (["--prompt", "hi"] if command == "generate" else ["--port", "0"]))
    err = capsys.readouterr().err
    assert rc == 2 and f"{where}: not valid JSON at line 3, column 1" in err
    assert "Traceback" not in err and "JSONDecodeError" not in err


def test_missing_architectures_lists_every_supported_family(tmp_path):
    """{"model_type": "llama"} without architectures: refused naming the field and the fix for that model_type,
    with every architecture the registry holds (the Kimi families included: models/architectures.py)."""
    from tokenfab.models.architectures import ARCHITECTURES
    from tokenfab.models.registry import get_model_class
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match=r"field 'architectures' is missing.*\[.LlamaForCausalLM.\]") as e:
        LLM(str(tmp_path), progress=False)
    assert all(name in str(e.value) for name in ARCHITECTURES)
    assert {"KimiLinearForCausalLM", "KimiK3ForConditionalGeneration"} <= set(ARCHITECTURES)
    for a in ARCHITECTURES.values():  # every row builds: its class exists under the name it gives
        cls = get_model_class(type("Cfg", (), {"family": a.family})())
        assert cls.__name__ == a.cls


def test_missing_and_unexpected_weight(tiny_model, tmp_path):
    path = copy_ckpt(tiny_model("deepseek_v3"), tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    sd.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    sd["model.layers.0.self_attn.bogus.weight"] = sd["model.norm.weight"].clone()
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError) as e:
        LLM(path, progress=False)
    msg = str(e.value)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in msg and "missing" in msg
    assert "model.layers.0.self_attn.bogus.weight" in msg and "unexpected" in msg


def test_mtp_layer_weights_are_skipped_and_reported(tiny_model, tmp_path):
    path = copy_ckpt(tiny_model("deepseek_v3"), tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    sd["model.layers.2.eh_proj.weight"] = sd["model.norm.weight"].clone()  # num_hidden_layers = 2 -> MTP layer
    save_file(sd, f, metadata={"format": "pt"})
    llm = LLM(path, progress=False, dtype="float32", max_model_len=64)
    assert llm.llm_engine.skipped_weights == ["model.layers.2.eh_proj.weight"]


def test_prompt_longer_than_max_model_len(tiny_model):
    llm = LLM(tiny_model("llama"), dtype="float32", max_model_len=32, progress=False)
    with pytest.raises(PromptTooLongError, match="33 tokens.*max_model_len \\(32\\)"):
        llm.generate([{"prompt_token_ids": [5] * 33}], SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([{"prompt_token_ids": [5] * 10}], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


def test_bad_sampling_params_and_pool():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_pool_too_small_for_max_model_len(tiny_model):
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(tiny_model("llama"), dtype="float32", max_model_len=128, num_kv_blocks=4, block_size=16, progress=False)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_max_model_len_above_the_model_is_one_line(tiny_model, capsys, command):
    """--max-model-len above max_position_embeddings: exit status 2 and one line naming both numbers and the fix
    (for serve the engine is built on its own thread; the error still reaches the CLI as a user error)."""
    argv = [command, tiny_model("llama"), "--max-model-len", "100000"]
    rc = main(argv + (["--prompt", "hi"] if command == "generate" else ["--port", "0"]))
    err = capsys.readouterr().err
    assert rc == 2 and "max_model_len 100000 exceeds" in err and "lower max_model_len" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("kw,param", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"), (dict(top_p=1e-400), "top_p"), (dict(seed=2 ** 64), "seed"),
    (dict(seed=2 ** 64 - 2, n=3), "seed"), (dict(n=True), "n"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=["7"]), "stop_token_ids"),
    (dict(stop=[3]), "stop"), (dict(logprobs=-2), "logprobs"), (dict(top_k=1.5), "top_k"),
])
def test_sampling_params_refuse_bad_fields_by_name(kw, param):
    """SamplingParams checks types, ranges and finiteness (request_validation.py): the error names the field."""
    with pytest.raises(ValueError, match=param) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_add_request_checks_against_the_model(tiny_model):
    """What needs the model is checked when the request enters: stop token ids inside the vocabulary (the issue's
    IndexError / overflow triggers), logprobs and prompt_logprobs at most vocab_size, integer prompt ids, a prompt
    text UTF-8 can encode, and fields changed after SamplingParams was built. Nothing stays queued after."""
    llm = LLM(tiny_model("llama"), dtype="float32", max_model_len=64, max_logprobs=-1, progress=False)
    eng = llm.llm_engine
    cases = [
        ([5, 6], SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=[512]), "stop_token_ids"),
        ([5, 6], SamplingParams(max_tokens=2, stop_token_ids=[2 ** 70]), "stop_token_ids"),
        ([5, 6], SamplingParams(max_tokens=2, logprobs=513), "logprobs"),
        ([5, 6], SamplingParams(max_tokens=2, prompt_logprobs=10 ** 6), "prompt_logprobs"),
        ([True, False], SamplingParams(max_tokens=2), "prompt_token_ids"),
        ([1.0, 2.0], SamplingParams(max_tokens=2), "prompt_token_ids"),
        (["1"], SamplingParams(max_tokens=2), "prompt_token_ids"),
        ([], SamplingParams(max_tokens=2), "prompt_token_ids"),
    ]
    for i, (ids, sp, param) in enumerate(cases):
        with pytest.raises(ValueError) as e:
            eng.add_request(f"bad{i}", None, ids, sp)
        assert e.value.param == param and param in str(e.value), (param, str(e.value))
    changed = SamplingParams(max_tokens=2)
    changed.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        eng.add_request("changed", None, [5], changed)
    with pytest.raises(ValueError, match="surrogate") as e:
        llm.generate("caf\udce9", SamplingParams(max_tokens=2), use_tqdm=False)
    assert e.value.param == "prompt"
    assert not eng.has_unfinished_requests()
    lp = llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2, prompt_logprobs=512,
                                                                       ignore_eos=True), use_tqdm=False)
    assert len(lp[0].prompt_logprobs[1]) == 512  # the whole vocabulary is allowed
