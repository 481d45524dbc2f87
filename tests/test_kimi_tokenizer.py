"""Kimi-K2 checkpoints as published: ``model_type: kimi_k2`` with a tiktoken tokenizer (``tiktoken.model``,
``tokenizer_config.json`` with ``added_tokens_decoder`` and ``auto_map`` to ``tokenization_kimi.py``).

transformers' AutoTokenizer cannot load such a folder without running the folder's Python code; tokenfab reads it
itself. The folder here is written by the test: a BPE rank file learned on a small corpus, Kimi's special-token
layout, a Kimi-shaped chat template and a ``tokenization_kimi.py`` that would leave a marker file if it ever ran.
References: ``tiktoken.Encoding`` built from the same ranks and Kimi's published regex, a hand-worked BPE case,
Jinja rendering of the template, and transformers' DeepSeek-V3 model on the same weights.
"""
from __future__ import annotations

import base64
import json
import os
import re
from collections import Counter

import httpx
import pytest
import tiktoken

from tokenfab.tokenizers.tiktoken_tokenizer import KIMI_PAT_STR, TiktokenTokenizer

# Kimi's pre-tokenizer regex as published in tokenization_kimi.py (Kimi-K2-Instruct), alternative by alternative.
PUBLISHED_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Kimi-K2's added tokens, as offsets from the first special id (163584 in the published file).
KIMI_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                 6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>{%- elif m['role'] == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>{%- endif -%}"
    "{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
CORPUS = [
    "the thinking engine serves the tokens of the request; then it returns them.",
    "Hello world, don't stop: they're serving 12345 tokens at 678 tok/s!",
    "中文分词 中文 模型",
    "def serve(request):\n    return request.tokens + 42\n",
    "HTTPServer NASA the THE The\n\n  indented   spaces",
] * 3
TEXTS = [
    "Hello world",
    "the thinking engine serves the tokens",
    "They're here; don't go. I'LL BE BACK",
    "中文分词测试 and English 混合",
    "numbers 1234567 and 3.14159",
    "def f(x):\n    return x + 1\n\n\n  trailing  \t",
    "emoji 🙂 café naïve",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "text[EOS]more [BOS]x <|im_end",
    "",
]


def train_bpe(corpus: list[str], n_merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks learned on ``corpus``: bytes 0-255 are ranks 0-255, then each round merges the most
    frequent adjacent pair (ties: the smallest pair) inside words split off by a simple regex."""
    words = Counter(tuple(bytes([b]) for b in w.encode())
                    for line in corpus for w in re.findall(r" ?[^\W\d_]+| ?\d+| ?[^\w\s]+|\s+", line))
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        a, b = min(pairs, key=lambda p: (-pairs[p], p))
        ranks[a + b] = len(ranks)
        merged = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    return ranks


def write_tiktoken_model(path: str, ranks: dict[bytes, int]) -> None:
    with open(path, "w") as f:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")


def write_kimi_tokenizer(folder: str, ranks: dict[bytes, int]) -> dict[str, int]:
    """tiktoken.model, tokenizer_config.json (Kimi's fields), chat_template.jinja and a remote-code file that must
    never run. Returns the special tokens by name -> id as Kimi lays them out (base count + offset)."""
    n = len(ranks)
    write_tiktoken_model(os.path.join(folder, "tiktoken.model"), ranks)
    added = {str(n + off): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True} for off, s in KIMI_SPECIALS.items()}
    cfg = {"added_tokens_decoder": added, "additional_special_tokens": ["<|im_end|>", "<|im_user|>",
           "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
           "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
           "clean_up_tokenization_spaces": False, "model_max_length": 1000000000000000019884624838656,
           "tokenizer_class": "TikTokenTokenizer",
           "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    with open(os.path.join(folder, "tokenization_kimi.py"), "w") as f:
        f.write("import pathlib\npathlib.Path(__file__).with_name('REMOTE_CODE_RAN').touch()\n"
                "raise RuntimeError('the checkpoint tokenizer code must not run')\n")
    return {s: n + off for off, s in KIMI_SPECIALS.items()}


@pytest.fixture(scope="module")
def ranks():
    return train_bpe(CORPUS, 60)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, ranks):
    """A tiny kimi_k2 checkpoint: DeepSeek-V3 weights, config.json rewritten as Kimi-K2's, the tiktoken files."""
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("kimi_k2")
    empty = root / "no-tokenizer"
    empty.mkdir()
    vocab = len(ranks) + 258
    path = make_tiny_checkpoint(str(root / "ckpt"), "deepseek_v3", vocab_size=vocab, tokenizer_dir=str(empty))
    specials = write_kimi_tokenizer(path, ranks)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(model_type="kimi_k2", bos_token_id=specials["[BOS]"], eos_token_id=specials["<|im_end|>"],
               pad_token_id=specials["[PAD]"],
               auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                         "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    os.remove(os.path.join(path, "generation_config.json"))  # eos must come from config.json
    return path


def reference_encoding(ranks: dict[bytes, int], specials: dict[str, int]) -> tiktoken.Encoding:
    """tiktoken's own encoder on the same ranks and regex, with every Kimi special slot named."""
    n = len(ranks)
    named = {i: s for s, i in specials.items()}
    slots = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 258)}
    return tiktoken.Encoding("ref", pat_str=PUBLISHED_PAT, mergeable_ranks=dict(ranks), special_tokens=slots)


def test_pre_tokenizer_regex_is_kimis():
    assert KIMI_PAT_STR == PUBLISHED_PAT


def test_hand_worked_bpe_merges_lowest_rank_first():
    # "the the": pre-split into "the" and " the". In "the", th (256) beats he (257), then th+e = the (258).
    # In " the": " t" (259) loses to th (256); then "the" (258) forms; " " + "the" is not a token.
    r = {bytes([b]): b for b in range(256)} | {b"th": 256, b"he": 257, b"the": 258, b" t": 259}
    tok = TiktokenTokenizer(r, added_tokens={260: ("[BOS]", True), 261: ("[EOS]", True)},
                            bos_token="[BOS]", eos_token="[EOS]")
    assert tok.encode("the the") == [258, 32, 258]
    assert tok.encode("he") == [257] and tok.encode(" to") == [259, ord("o")]
    assert tok.vocab_size == 260 + 258 and tok.eos_token_id == 261
    assert tok.encode("[EOS]") == [261] and tok.encode("<|reserved_token_262|>") == [262]


def test_encode_decode_match_tiktoken(kimi_dir, ranks):
    from tokenfab.engine.model_loader import load_tokenizer
    tok = load_tokenizer(kimi_dir)
    assert isinstance(tok, TiktokenTokenizer)
    assert not os.path.exists(os.path.join(kimi_dir, "REMOTE_CODE_RAN"))
    specials = {s: len(ranks) + off for off, s in KIMI_SPECIALS.items()}
    ref = reference_encoding(ranks, specials)
    merged = 0
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, allowed_special="all"), text
        assert tok(text, add_special_tokens=True)["input_ids"] == ids  # Kimi adds no BOS
        assert tok.decode(ids) == ref.decode(ids) == text
        plain = tok.encode(text, split_special_tokens=True)
        assert plain == ref.encode_ordinary(text) and tok.decode(plain) == text
        merged += len(text.encode()) - len(plain)
    assert merged > 40  # the learned merges are used, not only single bytes
    # whitespace / non-whitespace runs over 25,000 characters are cut every 25,000 characters (Kimi's rule)
    run = "xy" + "the" * 10000  # the cut at 25,000 falls inside "he"
    assert tok.encode(run) == ref.encode_ordinary(run[:25000]) + ref.encode_ordinary(run[25000:]) \
        != ref.encode_ordinary(run)
    assert tok.decode(tok.encode(run)) == run
    # cut points counted from each run's start: "xythe..." starts at 3, the 26,003 spaces at 30,005
    mixed = "hi " + run + " " * 26003 + "z"
    want = [x for piece in (mixed[:25003], mixed[25003:55005], mixed[55005:]) for x in ref.encode_ordinary(piece)]
    assert tok.encode(mixed) == want != ref.encode_ordinary(mixed) and tok.decode(want) == mixed


def test_special_tokens_are_single_ids(kimi_dir, ranks):
    tok = TiktokenTokenizer.from_pretrained(kimi_dir)
    n = len(ranks)
    assert tok.vocab_size == len(tok) == n + 258
    for off, s in KIMI_SPECIALS.items():
        assert tok.encode(s) == [n + off], s
        assert tok.convert_ids_to_tokens(n + off) == s and tok.convert_tokens_to_ids(s) == n + off
    assert tok.encode(f"<|reserved_token_{n + 5}|>") == [n + 5]
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (n, n + 1, n + 254, n + 255)
    assert set(tok.all_special_ids) == set(range(n, n + 258))
    ids = tok.encode("<|im_user|>user<|im_middle|>hi there<|im_end|>")
    assert ids[0] == n + 3 and ids.count(n + 17) == 1 and ids[-1] == n + 2
    assert tok.decode(ids, skip_special_tokens=True) == "userhi there"
    # token strings are GPT-2 byte-level (space -> U+0120), and the two byte halves of "é" differ
    the = ranks.get(b" the")
    assert the is not None and tok.convert_ids_to_tokens([the]) == ["\u0120the"]
    halves = tok.encode("é", split_special_tokens=True)
    assert len(halves) == 2 and tok.decode(halves[:1]) == "\ufffd" and len(set(tok.convert_ids_to_tokens(halves))) == 2
    assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens(tok.encode("café 中文"))) == "café 中文"
    with pytest.raises(ValueError, match="vocabulary"):
        tok.decode([n + 258])


def test_bad_tiktoken_files_name_the_problem(tmp_path, ranks):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "tiktoken.model").write_text("not-base64!! 0\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:1"):
        TiktokenTokenizer.from_pretrained(str(d))
    write_tiktoken_model(str(d / "tiktoken.model"), {bytes([b]): b for b in range(1, 256)} | {b"\x00x": 255})
    with pytest.raises(ValueError, match="ranks must be exactly|single-byte"):
        TiktokenTokenizer.from_pretrained(str(d))
    write_tiktoken_model(str(d / "tiktoken.model"), ranks)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match="eos_token '<\\|nope\\|>'"):
        TiktokenTokenizer.from_pretrained(str(d))


def test_chat_template_renders_like_jinja(kimi_dir):
    import jinja2
    tok = TiktokenTokenizer.from_pretrained(kimi_dir)
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "中文?"}]
    want = jinja2.Environment().from_string(CHAT_TEMPLATE).render(messages=msgs, add_generation_prompt=True)
    assert want.startswith("<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|><|im_user|>")
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == want
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert ids == tok.encode(want) and ids[-1] == tok.convert_tokens_to_ids("<|im_middle|>")


def _kimi_reference(path: str):
    from tokenfab.eval.reference import TransformersReference
    return TransformersReference(path).model  # kimi_k2 built as a DeepseekV3Config


def test_llm_loads_kimi_k2_and_generates(kimi_dir):
    from conftest import reference_greedy

    from tokenfab import LLM, SamplingParams
    from tokenfab.config import load_config
    mc = load_config(kimi_dir)
    assert (mc.model_type, mc.family) == ("kimi_k2", "deepseek_v3")
    llm = LLM(model=kimi_dir, dtype="float32", max_model_len=256, progress=False)
    tok = llm.get_tokenizer()
    assert isinstance(tok, TiktokenTokenizer)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert llm.llm_engine.eos_token_ids == [im_end] != [tok.eos_token_id]  # config.json's, not the tokenizer's
    prompt = "Hello world, the engine serves 中文"
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                              skip_special_tokens=False), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(prompt)
    want = reference_greedy(_kimi_reference(kimi_dir), tok.encode(prompt), 8)
    assert out.outputs[0].token_ids == want
    assert out.outputs[0].text == tok.decode(want)


def test_server_chat_uses_the_template(kimi_dir):
    import jinja2
    from conftest import reference_greedy
    from server_fixtures import start_test_server

    tok = TiktokenTokenizer.from_pretrained(kimi_dir)
    msgs = [{"role": "user", "content": "Say hello"}]
    rendered = jinja2.Environment().from_string(CHAT_TEMPLATE).render(messages=msgs, add_generation_prompt=True)
    prompt_ids = tok.encode(rendered)
    want = reference_greedy(_kimi_reference(kimi_dir), prompt_ids, 6)
    h = start_test_server(kimi_dir, name="kimi-tiny")
    try:
        with httpx.Client(base_url=h.base_url, trust_env=False, timeout=60) as c:
            r = c.post("/v1/chat/completions", json={"model": "kimi-tiny", "messages": msgs, "max_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["prompt_tokens"] == len(prompt_ids)
            assert body["usage"]["completion_tokens"] == 6
            assert body["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True)
            t = c.post("/tokenize", json={"model": "kimi-tiny", "prompt": rendered}).json()
            assert t["tokens"] == prompt_ids
    finally:
        h.stop()


def test_bench_client_reads_the_kimi_folder(kimi_dir):
    from tokenfab.bench.datasets import sample_random_requests
    from tokenfab.bench.serve import load_tokenizer
    tok = load_tokenizer(kimi_dir)
    assert isinstance(tok, TiktokenTokenizer)
    reqs = sample_random_requests(tok, num_requests=3, input_len=48, output_len=4, seed=1)
    special = set(tok.all_special_ids)
    for r in reqs:
        ids = tok.encode(r.prompt)
        assert r.prompt_len == len(ids) == 48 and not special & set(ids)


def write_kimi_json_dir(root: str, tokenizer_dir: str, remote_tokenizer: bool) -> str:
    """A tiny kimi_k2 checkpoint with a ``tokenizer.json`` (no tiktoken.model) and config.json as Kimi-K2 publishes
    it: transformers 4.x ``rope_scaling`` (YaRN) with ``rope_theta`` at top level, ``auto_map`` to the checkpoint's
    own configuration / modeling code. With ``remote_tokenizer`` tokenizer_config.json's ``auto_map`` also points at
    a tokenization_kimi.py (which must never run)."""
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
    path = make_tiny_checkpoint(os.path.join(root, "ckpt"), "deepseek_v3", vocab_size=512, tokenizer_dir=tokenizer_dir)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    rp = dict(cfg.pop("rope_parameters"))
    theta = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    cfg.update(model_type="kimi_k2", rope_scaling=rp, rope_theta=theta,
               auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                         "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if remote_tokenizer:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            tc = json.load(f)
        tc.update(tokenizer_class="TikTokenTokenizer",
                  auto_map={"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]})
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(tc, f)
    with open(os.path.join(path, "tokenization_kimi.py"), "w") as f:
        f.write("import pathlib\npathlib.Path(__file__).with_name('REMOTE_CODE_RAN').touch()\n"
                "raise RuntimeError('the checkpoint tokenizer code must not run')\n")
    return path


@pytest.mark.parametrize("remote_tokenizer", [False, True], ids=["plain", "auto_map"])
def test_kimi_k2_with_tokenizer_json_loads_it_without_remote_code(tmp_path, tokenizer_dir, remote_tokenizer):
    """The engine, the bench client and the model loader read the folder's tokenizer.json (the same ids as the
    tokenizer it was written from, its chat template and special tokens) without transformers' AutoConfig, which
    cannot build a kimi_k2 config (before: AttributeError 'PreTrainedConfig' object has no attribute
    'max_position_embeddings'), and without running the folder's code (tokenizer_config.json's auto_map: before,
    a request for trust_remote_code); a text prompt generates."""
    from transformers import AutoTokenizer

    from tokenfab import LLM, SamplingParams
    from tokenfab.bench.serve import load_tokenizer as bench_tokenizer
    from tokenfab.engine.model_loader import load_tokenizer
    kimi_json_dir = write_kimi_json_dir(str(tmp_path), tokenizer_dir, remote_tokenizer)
    ref = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "Hello world, the engine serves"
    for tok in (load_tokenizer(kimi_json_dir), bench_tokenizer(kimi_json_dir)):
        assert not isinstance(tok, TiktokenTokenizer)
        assert tok.encode(text) == ref.encode(text) and tok.get_vocab() == ref.get_vocab()
        assert (tok.eos_token, tok.bos_token) == (ref.eos_token, ref.bos_token) and tok.chat_template
    llm = LLM(model=kimi_json_dir, dtype="float32", max_model_len=128, progress=False)
    out = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == ref.encode(text) and len(out.outputs[0].token_ids) == 4
    assert not os.path.exists(os.path.join(kimi_json_dir, "REMOTE_CODE_RAN"))
