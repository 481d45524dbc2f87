"""How a GGUF vocabulary splits text before its BPE merges, where transformers' GGUF tokenizer conversion does not
know the file's ``tokenizer.ggml.pre``.

llama.cpp names each byte-level BPE vocabulary's pre-tokenizer (``tokenizer.ggml.pre``: ``llama-bpe``, ``qwen2``,
``deepseek-v3``, ``kimi-k2`` ...) and keeps the regular expressions per name in its source (llama-vocab.cpp). The
GGUF file holds only the name. transformers' conversion maps the names it knows to a split
(``GGUF_PRE_TOKENIZER_SPLITS``) and splits every other vocabulary by GPT-2's rule, which for some names cuts text
differently from the model's own tokenizer: DeepSeek-V3 groups digits by three and keeps CJK runs apart, so
"12345" would become other tokens. :func:`fix_pre_tokenizer` therefore

* sets the split for the names listed in :data:`SPLITS` (DeepSeek-V3's three expressions, applied in turn, each
  piece kept: the same expressions llama.cpp applies for ``deepseek-v3``, then byte-level mapping without GPT-2's);
* accepts GPT-2's rule for ``default`` / ``gpt2`` and for ``smollm`` when no token of the vocabulary holds a digit
  beside another character (SmolLM2: its own rule puts each digit apart first, which then yields the same tokens);
* otherwise returns a one-line warning naming the pre-tokenizer and the fix (pass the model's Hugging Face
  tokenizer folder), e.g. for ``kimi-k2``, whose expression uses character-class intersections.
"""
from __future__ import annotations

import re

DEEPSEEK_V3_SPLIT = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
SPLITS = {"deepseek-v3": DEEPSEEK_V3_SPLIT}
GPT2_RULE = ("default", "gpt2")
_DIGIT_BESIDE = re.compile(r"\d.|.\d", re.S)


def transformers_splits() -> set[str]:
    """The ``tokenizer.ggml.pre`` names transformers' GGUF conversion gives a split of their own."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # another transformers layout: trust none of its splits
        return set()
    return set(GGUF_PRE_TOKENIZER_SPLITS)


def pre_tokenizer_warning(meta: dict) -> str | None:
    """None when transformers' conversion of the GGUF vocabulary with metadata ``meta``, after
    :func:`fix_pre_tokenizer`, splits text as the vocabulary's pre-tokenizer does; else a one-line warning naming
    the pre-tokenizer and the fix."""
    if meta.get("tokenizer.ggml.model") != "gpt2":  # sentencepiece / unigram vocabularies: no regex split
        return None
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre in SPLITS or pre in GPT2_RULE or pre in transformers_splits():
        return None
    if pre == "smollm" and not any(_DIGIT_BESIDE.search(t) for t in meta.get("tokenizer.ggml.tokens") or ()):
        return None
    return (f"the GGUF vocabulary's pre-tokenizer '{pre}' (tokenizer.ggml.pre) is not one tokenfab or transformers "
            "knows: text is split by GPT-2's rule, which can give other tokens than the model's own tokenizer; "
            "pass the model's Hugging Face tokenizer folder (LLM(tokenizer=...), tokenfab serve --tokenizer) for "
            "exact tokens")


def fix_pre_tokenizer(tok, meta: dict) -> str | None:
    """Give ``tok`` (transformers' tokenizer converted from a GGUF file with metadata ``meta``) its vocabulary's
    split where transformers lacks it (:data:`SPLITS`), in place; returns :func:`pre_tokenizer_warning`."""
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if meta.get("tokenizer.ggml.model") == "gpt2" and pre in SPLITS:
        from tokenizers import Regex, pre_tokenizers

        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(expr), behavior="isolated") for expr in SPLITS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return pre_tokenizer_warning(meta)
