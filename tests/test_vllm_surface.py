"""The arguments and flags a vLLM user copies: LLM.chat, LLM(...) / EngineConfig keywords (unknown ones named with the
nearest supported one), gpu_memory_utilization sizing, generation_config defaults, max_logprobs, quantization and
prefix-caching refusals, and `tokenfab serve`'s --model, --api-key, --chat-template, request logging and busy-port
check."""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket

import httpx
import pytest

from server_fixtures import *  # noqa: F401,F403
from server_fixtures import serve_subprocess

from tokenfab.errors import EngineConfigError, UnsupportedError

ENGINE_KW = dict(dtype="float32", device="cpu", max_model_len=128, progress=False)
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(llama):
    from tokenfab import LLM
    return LLM(llama, **ENGINE_KW)


def _greedy(n):
    from tokenfab import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


# ------------------------------------------------------------------------------------------------------- LLM.chat
def test_chat_equals_generate_on_the_template_applied_prompt(llm, llama, tmp_path):
    """LLM.chat = generate on the prompt transformers' apply_chat_template renders (tokenized without special
    tokens), for one conversation, a list of them, an inline template and a template file."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(llama)
    conv_a = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    conv_b = [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "2+2"}]}]
    params = _greedy(6)

    def reference(conv, template=None):
        msgs = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                 else "".join(p["text"] for p in m["content"])} for m in conv]
        text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, chat_template=template)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        return text, ids, llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]

    text_a, ids_a, ref_a = reference(conv_a)
    assert text_a.startswith("<|im_start|>system\nbe brief") and text_a.endswith("<|im_start|>assistant\n")
    (one,) = llm.chat(conv_a, params, use_tqdm=False)
    assert one.prompt == text_a and one.prompt_token_ids == ids_a
    assert one.outputs[0].token_ids == ref_a.outputs[0].token_ids and len(ref_a.outputs[0].token_ids) == 6

    text_b, ids_b, ref_b = reference(conv_b)
    both = llm.chat([conv_a, conv_b], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in both] == [ids_a, ids_b]
    assert [o.outputs[0].token_ids for o in both] == [ref_a.outputs[0].token_ids, ref_b.outputs[0].token_ids]

    # a given template replaces the tokenizer's (written out by hand here), inline or as a file
    text_t, ids_t, ref_t = reference(conv_a, TEMPLATE)
    assert text_t == "[system] be brief\n[user] hello there\n[assistant] "
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    for tpl in (TEMPLATE, str(path)):
        (o,) = llm.chat(conv_a, params, use_tqdm=False, chat_template=tpl)
        assert o.prompt == text_t and o.prompt_token_ids == ids_t
        assert o.outputs[0].token_ids == ref_t.outputs[0].token_ids

    # add_generation_prompt=False / continue_final_message=True render as transformers does
    cont = conv_a + [{"role": "assistant", "content": "Sure"}]
    want = hf.apply_chat_template(cont, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    (o,) = llm.chat(cont, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert o.prompt == want and want.endswith("Sure")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(cont, params, continue_final_message=True)
    with pytest.raises(ValueError, match="not an existing file|neither an existing file"):
        llm.chat(conv_a, params, chat_template="no/such/template.jinja")


# ---------------------------------------------------------------------------------------------- unknown keywords
def test_unknown_keyword_names_the_nearest_before_loading(llama, monkeypatch):
    from tokenfab import LLM
    from tokenfab.engine.engine import LLMEngine
    from tokenfab.engine.engine_config import EngineConfig, UnknownArgumentError

    def no_load(*a, **k):
        raise AssertionError("the engine was built")
    monkeypatch.setattr(LLMEngine, "from_config", classmethod(lambda cls, *a, **k: no_load()))
    for wrong, nearest in (("gpu_memory_utilisation", "gpu_memory_utilization"), ("max_num_seq", "max_num_seqs"),
                           ("enable_prefix_cache", "enable_prefix_caching"), ("max_log_probs", "max_logprobs")):
        with pytest.raises(UnknownArgumentError) as e:
            LLM(llama, **{wrong: 1})
        msg = str(e.value)
        assert f"'{wrong}'" in msg and f"did you mean '{nearest}'" in msg, msg
        assert isinstance(e.value, ValueError) and isinstance(e.value, TypeError)
    with pytest.raises(UnknownArgumentError, match="'zzzz'.*supported: .*block_size"):
        EngineConfig.from_kwargs(llama, zzzz=1)


# -------------------------------------------------------------------------------- settings refused / accepted
def test_prefix_caching_accepted_and_quantization_refused_by_name(llama, tmp_path):
    from tokenfab.engine.engine_config import EngineConfig
    assert EngineConfig(model=llama, enable_prefix_caching=True).enable_prefix_caching is True
    assert EngineConfig(model=llama, enable_prefix_caching=False).enable_prefix_caching is False
    for q in (None, "auto", "none"):
        assert EngineConfig(model=llama, quantization=q).quantization is None
    with pytest.raises(UnsupportedError, match="quantization='gptq' is not supported.*not quantized"):
        EngineConfig(model=llama, quantization="gptq")
    with pytest.raises(EngineConfigError, match="quantization='fp8' does not match the checkpoint"):
        EngineConfig(model=llama, quantization="fp8")  # runs FP8 checkpoints; this one is not
    with pytest.raises(EngineConfigError, match="quantization='compressed-tensors' does not match the checkpoint: "
                                                "its config.json has no quantization_config"):
        EngineConfig(model=llama, quantization="compressed-tensors")
    # a checkpoint that declares the method passes the check (config only; nothing is loaded here)
    q_dir = tmp_path / "quantized"
    q_dir.mkdir()
    cfg = json.load(open(os.path.join(llama, "config.json")))
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    (q_dir / "config.json").write_text(json.dumps(cfg))
    assert EngineConfig(model=str(q_dir), quantization="compressed-tensors").quantization == "compressed-tensors"
    with pytest.raises(UnsupportedError, match="quantization='awq'.*compressed-tensors"):
        EngineConfig(model=str(q_dir), quantization="awq")
    # a folder converted from a .gguf file (it holds gguf_source.json) is the 'gguf' method
    g_dir = tmp_path / "from-gguf"
    g_dir.mkdir()
    shutil.copy(os.path.join(llama, "config.json"), g_dir / "config.json")
    (g_dir / "gguf_source.json").write_text(json.dumps({"source": "x.gguf"}))
    assert EngineConfig(model=str(g_dir), quantization="gguf").quantization == "gguf"
    with pytest.raises(EngineConfigError, match="quantization='gguf' does not match"):
        EngineConfig(model=llama, quantization="gguf")
    for bad in (0, 1.5, -0.1):
        with pytest.raises(EngineConfigError, match="gpu_memory_utilization must be in"):
            EngineConfig(model=llama, gpu_memory_utilization=bad)
    with pytest.raises(EngineConfigError, match="max_logprobs"):
        EngineConfig(model=llama, max_logprobs=-2)


def test_tokenizer_and_trust_remote_code_are_accepted(llama, tmp_path):
    """tokenizer= points at another folder (here: the model folder copied without weights)."""
    from tokenfab import LLM
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in os.listdir(llama):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(llama, name), tok_dir / name)
    llm = LLM(llama, tokenizer=str(tok_dir), trust_remote_code=True, **ENGINE_KW)
    assert llm.engine_config.tokenizer == str(tok_dir) and llm.get_tokenizer() is not None
    assert llm.get_tokenizer()("hi")["input_ids"]


# ------------------------------------------------------------------------------------- gpu_memory_utilization
def test_gpu_memory_utilization_sizes_the_pool_from_the_memory_share(llama, monkeypatch):
    """num_kv_blocks = (floor(share x memory) - weight bytes) // (KV bytes per token x block size), every term
    computed here by hand: weights from the safetensors header (float32: 4 bytes per element), KV bytes per token
    = 2 (K and V) x layers x KV heads x head_dim x 4."""
    import tokenfab.engine.engine_config as ec
    from safetensors import safe_open

    from tokenfab import LLM
    memory = 64 << 20
    monkeypatch.setattr(ec, "host_memory_bytes", lambda: memory)
    with safe_open(os.path.join(llama, "model.safetensors"), "pt") as f:
        weights = sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())
    cfg = json.load(open(os.path.join(llama, "config.json")))
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    llm = LLM(llama, gpu_memory_utilization=0.5, **ENGINE_KW)
    assert llm.engine_config.num_kv_blocks == (memory // 2 - weights) // (per_token * 16) == 4033
    # not given: today's default pool, min(max_num_seqs x max_model_len, 2 GiB) tokens
    assert LLM(llama, **ENGINE_KW).engine_config.num_kv_blocks == 16 * 128 // 16
    # kv_cache_memory wins over the share
    assert LLM(llama, gpu_memory_utilization=0.5, kv_cache_memory=per_token * 16 * 40,
               **ENGINE_KW).engine_config.num_kv_blocks == 40
    # a share below the weights, and one that leaves less than one max_model_len sequence, are refused by name
    with pytest.raises(EngineConfigError, match=r"gpu_memory_utilization=0.005 .* not more than the weights"):
        LLM(llama, gpu_memory_utilization=0.005, **ENGINE_KW)
    small = (weights + per_token * 16 * 3) / memory  # 3 blocks: under the 8 one 128-token sequence needs
    with pytest.raises(EngineConfigError, match="raise gpu_memory_utilization to at least 8 blocks"):
        LLM(llama, gpu_memory_utilization=small, **ENGINE_KW)


def test_host_memory_is_physical_memory_or_cgroup_limit():
    from tokenfab.engine.engine_config import host_memory_bytes
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    got = host_memory_bytes()
    assert 0 < got <= phys
    try:
        raw = open("/sys/fs/cgroup/memory.max").read().strip()
    except OSError:
        raw = "max"
    assert got == (min(phys, int(raw)) if raw.isdigit() else phys)


# -------------------------------------------------------------------------------------------- generation_config
GEN = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 7, "repetition_penalty": 1.3,
       "bos_token_id": 0, "eos_token_id": 1, "do_sample": True}


def _expected_defaults():
    """What generation_config='auto' must take from GEN: repetition_penalty only where SamplingParams has it."""
    from dataclasses import fields

    from tokenfab.sampling_params import SamplingParams
    want = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 7}
    if "repetition_penalty" in {f.name for f in fields(SamplingParams)}:
        want["repetition_penalty"] = 1.3
    return want


@pytest.fixture(scope="module")
def gen_model(llama, tmp_path_factory):
    """The tiny Llama with a generation_config.json that sets sampling defaults."""
    dst = str(tmp_path_factory.mktemp("gen") / "llama-gen")
    shutil.copytree(llama, dst)
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump(GEN, f)
    return dst


def test_generation_config_defaults_offline(gen_model, llama):
    from tokenfab import LLM, SamplingParams
    want = _expected_defaults()
    llm = LLM(gen_model, **ENGINE_KW)
    assert llm.engine_config.generation_defaults() == want
    got = llm.get_default_sampling_params()
    assert all(getattr(got, k) == v for k, v in want.items())
    (auto,) = llm.generate(["the same prompt"], use_tqdm=False)
    # the same engine seed and the same request order: explicit SamplingParams with GEN's values draw the same
    ref_llm = LLM(gen_model, generation_config="vllm", **ENGINE_KW)
    assert ref_llm.engine_config.generation_defaults() == {}
    (explicit,) = ref_llm.generate(["the same prompt"], SamplingParams(**want), use_tqdm=False)
    assert auto.outputs[0].token_ids == explicit.outputs[0].token_ids
    assert len(auto.outputs[0].token_ids) == 7 or auto.outputs[0].finish_reason == "stop"
    (plain,) = ref_llm.generate(["the same prompt"], use_tqdm=False)  # 'vllm': SamplingParams() (16 tokens)
    assert len(plain.outputs[0].token_ids) == 16 or plain.outputs[0].finish_reason == "stop"
    # a folder path reads that folder's file; a missing path is refused by name
    assert LLM(llama, generation_config=gen_model, **ENGINE_KW).engine_config.generation_defaults() == want
    with pytest.raises(EngineConfigError, match="generation_config must be 'auto', 'vllm' or a folder"):
        LLM(llama, generation_config="/no/such/folder", **ENGINE_KW)


def test_generation_config_defaults_on_the_server(gen_model):
    """Request fields left unset take generation_config.json's values; a field the client sends wins."""
    srv = start_test_server(gen_model)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            auto = c.post("/v1/completions", json={"prompt": "the same prompt", "seed": 3}).json()
            explicit = c.post("/v1/completions", json={"prompt": "the same prompt", "seed": 3, "temperature": 0.7,
                                                       "top_p": 0.9, "top_k": 5, "max_tokens": 7,
                                                       **({"repetition_penalty": 1.3}
                                                          if "repetition_penalty" in _expected_defaults() else {})}
                              ).json()
            assert auto["choices"][0]["text"] == explicit["choices"][0]["text"]
            assert auto["usage"]["completion_tokens"] == explicit["usage"]["completion_tokens"]
            assert explicit["usage"]["completion_tokens"] == 7 or explicit["choices"][0]["finish_reason"] == "stop"
            own = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "min_tokens": 3}).json()
            assert own["usage"]["completion_tokens"] == 3
            chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "ignore_eos": True}).json()
            assert chat["usage"]["completion_tokens"] == 7
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------------- max_logprobs
def test_max_logprobs_offline(llama):
    from tokenfab import LLM, SamplingParams
    llm = LLM(llama, max_logprobs=3, **ENGINE_KW)
    (ok,) = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=2, logprobs=3), use_tqdm=False)
    assert all(len(d) >= 3 for d in ok.outputs[0].logprobs)
    with pytest.raises(ValueError, match=r"logprobs=4 is more than max_logprobs \(3\)"):
        llm.generate(["hi"], SamplingParams(logprobs=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt_logprobs=5 is more than max_logprobs \(3\)"):
        llm.generate(["hi"], SamplingParams(prompt_logprobs=5), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"logprobs=21 is more than max_logprobs \(20\)"):
        LLM(llama, **ENGINE_KW).generate(["hi"], SamplingParams(logprobs=21), use_tqdm=False)


def test_max_logprobs_on_the_server(server_model_dir):
    srv = start_test_server(server_model_dir, max_logprobs=2)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 3})
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["param"] == "logprobs" and "max_logprobs (2)" in err["message"]
            for stream in (False, True):
                r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2, "logprobs": True, "top_logprobs": 3,
                                                         "stream": stream})
                assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 2})
            assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"]) == 2
    finally:
        srv.stop()


# --------------------------------------------------------------------------------------------- server: api key
def _start(model_dir, **app_kw):
    from tokenfab.engine.engine_config import EngineConfig
    from tokenfab.server.api_server import build_app
    from tokenfab.server.async_engine import AsyncLLM
    from tokenfab.server.launch import ServerHandle
    llm = AsyncLLM.from_config(EngineConfig(model=model_dir, dtype="float32", device="cpu", max_model_len=128))
    llm.start()
    return ServerHandle(build_app(llm, SERVED_NAME, model_dir, **app_kw), llm)


def test_api_key_401_without_200_with(server_model_dir):
    srv = _start(server_model_dir, api_key="sekret")
    body = {"prompt": "hi", "max_tokens": 2}
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
                    r = c.request(method, path, headers=headers, json=body if method == "POST" else None)
                    assert r.status_code == 401, (path, headers)
                    err = r.json()["error"]
                    assert err["type"] == "AuthenticationError" and err["code"] == 401
                    assert "API key" in err["message"]
            good = {"Authorization": "Bearer sekret"}
            assert c.get("/v1/models", headers=good).status_code == 200
            r = c.post("/v1/completions", headers=good, json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            for open_path in ("/health", "/metrics", "/version"):
                assert c.get(open_path).status_code == 200, open_path
    finally:
        srv.stop()


def test_api_key_from_flag_or_env(monkeypatch):
    from tokenfab.server.auth import resolve_api_key
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("TOKENFAB_API_KEY", raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("flag") == "flag"


# ---------------------------------------------------------------------------- server: chat template and logging
def test_server_chat_template_and_request_log(server_model_dir, caplog):
    """--chat-template's text is what /tokenize and /v1/chat/completions render; with request logging on, each
    request logs one INFO line without its prompt (id, lengths, parameters) and one DEBUG line with it."""
    from transformers import AutoTokenizer

    from tokenfab.server.request_policy import RequestPolicy
    hf = AutoTokenizer.from_pretrained(server_model_dir)
    msgs = [{"role": "user", "content": "hello"}]
    want = hf(hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, chat_template=TEMPLATE),
              add_special_tokens=False)["input_ids"]
    srv = _start(server_model_dir, chat_template=TEMPLATE, policy=RequestPolicy(max_model_len=128, log_requests=True))
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c, caplog.at_level(logging.DEBUG, "tokenfab.requests"):
            assert c.post("/tokenize", json={"messages": msgs}).json()["tokens"] == want
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)
            c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        recs = [r for r in caplog.records if r.name == "tokenfab.requests"]
        info = [r.getMessage() for r in recs if r.levelno == logging.INFO]
        debug = [r.getMessage() for r in recs if r.levelno == logging.DEBUG]
        assert len(info) == 2 and len(debug) == 2
        assert info[0].startswith("Received request chatcmpl-") and f"prompt_tokens {len(want)}," in info[0]
        assert info[1].startswith("Received request cmpl-") and "prompt_chars 3," in info[1]
        assert not any("hello" in x or "'abc'" in x for x in info), info
        assert "'[user] hello\\n[assistant] '" in debug[0] and "prompt: 'abc'" in debug[1]
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------------ serve flags
def test_serve_flags_parse(llama):
    from tokenfab.cli import build_parser
    from tokenfab.server.launch import engine_config_from_args, model_arg
    args = build_parser().parse_args([
        "serve", "--model", llama, "--device", "cpu", "--gpu-memory-utilization", "0.4", "--tokenizer", llama,
        "--trust-remote-code", "-q", "auto", "--no-enable-prefix-caching", "--generation-config", "vllm",
        "--max-logprobs", "7", "--uvicorn-log-level", "info", "--disable-log-requests", "--api-key", "k",
        "--chat-template", TEMPLATE])
    assert model_arg(args) == llama and args.log_level == "info" and args.disable_log_requests
    cfg = engine_config_from_args(args)
    assert (cfg.model, cfg.gpu_memory_utilization, cfg.tokenizer, cfg.trust_remote_code, cfg.quantization,
            cfg.enable_prefix_caching, cfg.generation_config, cfg.max_logprobs) == (
        llama, 0.4, llama, True, None, False, "vllm", 7)
    assert build_parser().parse_args(["serve", llama, "--log-level", "debug"]).log_level == "debug"
    with pytest.raises(EngineConfigError, match="given twice"):
        model_arg(build_parser().parse_args(["serve", llama, "--model", llama + "x"]))
    assert engine_config_from_args(build_parser().parse_args(
        ["serve", llama, "--enable-prefix-caching"])).enable_prefix_caching is True


def test_unknown_serve_flag_names_the_nearest(capsys):
    from tokenfab.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "--gpu-memory-utilisation", "0.5", "--max-logprobs", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "unrecognized arguments: --gpu-memory-utilisation (did you mean --gpu-memory-utilization?)" in err


def test_busy_port_is_reported_before_the_weights_load(llama, monkeypatch, capsys):
    """A port another socket listens on: exit status 1, a message naming --port, and the loader never ran (the
    control run on a free port reaches the loader)."""
    import tokenfab.engine.model_loader as model_loader
    from tokenfab.cli import main
    from tokenfab.engine.engine import LLMEngine
    calls = []

    class Reached(Exception):
        pass

    def fake_build(cls, config, progress=True):
        calls.append("engine")
        raise Reached()

    monkeypatch.setattr(LLMEngine, "from_config", classmethod(fake_build))
    monkeypatch.setattr(model_loader, "iterate_weights", lambda *a, **k: calls.append("weights") or iter(()))
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        rc = main(["serve", llama, "--device", "cpu", "--port", str(port)])
        err = capsys.readouterr().err
        assert rc == 1 and calls == []
        assert f"127.0.0.1:{port}" in err and "--port" in err and "the model was not loaded" in err
    finally:
        busy.close()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    with pytest.raises(Reached):
        main(["serve", llama, "--device", "cpu", "--port", str(port)])
    assert calls == ["engine"]
    probe = socket.socket()  # the port was released after the failed start
    probe.bind(("127.0.0.1", port))
    probe.close()


def test_serve_end_to_end_with_api_key_and_template(server_model_dir, tmp_path):
    """`tokenfab serve --model ... --api-key ... --chat-template FILE` in its own process: 401/200, the template
    applied, and no request log line by default (vLLM's: --enable-log-requests turns it on)."""
    tpl = tmp_path / "t.jinja"
    tpl.write_text(TEMPLATE)
    # PyTorch paths (no fused-kernel build inside this process when the cache is cold): wiring, not speed
    env = dict(os.environ, VLLM_API_KEY="", TOKENFAB_API_KEY="", TOKENFAB_CPU_KERNELS="0")
    with serve_subprocess(["--model", server_model_dir, "--device", "cpu", "--dtype", "float32", "--max-model-len",
                           "128", "--api-key", "k1", "--chat-template", str(tpl), "--num-threads", "1"],
                          tmp_path / "serve.log", env) as base:
        msgs = [{"role": "user", "content": "hello"}]
        assert httpx.post(base + "/v1/chat/completions", json={"messages": msgs}).status_code == 401
        r = httpx.post(base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2},
                       headers={"Authorization": "Bearer k1"}, timeout=60)
        assert r.status_code == 200
        toks = httpx.post(base + "/tokenize", json={"messages": msgs}).json()["tokens"]
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(server_model_dir)
        assert hf.decode(toks) == "[user] hello\n[assistant] " and len(toks) == r.json()["usage"]["prompt_tokens"]
    out = open(tmp_path / "serve.log").read()
    assert "Received request" not in out and "hello" not in out, out
    assert "API key required" in out


def test_second_bind_of_a_listening_port_is_refused():
    """Two servers starting together: both binds succeed with SO_REUSEADDR, so the check must also listen()."""
    from tokenfab.server.launch import PortInUseError, bind_listen_socket
    first = bind_listen_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    try:
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{port}.*--port"):
            bind_listen_socket("127.0.0.1", port)
    finally:
        first.close()
