"""A prompt too long to fit, found from its length in characters before it is tokenized.

Tokenizing a 5 MB prompt takes seconds and hundreds of MB only to learn that it cannot fit ``max_model_len`` tokens
(issue 33). A token stands for at most ``max_token_chars`` characters of the text it was made from, so a text of more
than ``max_model_len * max_token_chars`` characters needs more than ``max_model_len`` tokens. That holds when the
tokenizer drops no character of its input: byte-level BPE (every byte is in the vocabulary: GPT-2 / Llama 3 / Qwen /
SmolLM2 and tiktoken tokenizers) and BPE with byte fallback (SentencePiece-style Llama / Mistral), with normalizers
that never delete characters (Unicode composition, NFC / NFKC, is allowed for by a factor of 4, the longest canonical
decomposition). A byte-level vocabulary may lack a few byte symbols (SmolLM2's has no token for 6 control
characters nor for lead bytes 0xF1 / 0xF2, and drops them: 1,000 x "\x16" is 0 tokens): characters made of those are
not counted. For any other tokenizer (WordPiece, Unigram, a normalizer or pre-tokenizer that removes characters, an
unknown-token model that fuses runs) :func:`prompt_char_bound` returns None and no prompt is refused before
tokenizing.

Why a token's decoded text bounds what it covers: a byte-level token is a run of bytes; a character whose bytes lie
in one token is one character of that token's decoding, and a character split over tokens shows as at least one
U+FFFD in each of them. So ``len(text) <= sum(len(decode([t])))`` over the tokens; the raw vocabulary string
(``Ġhello``, ``▁hello``, ``<0x0A>``) is never shorter than what the token covers either, and a decoder that strips a
leading space from a lone token is covered by taking the larger of the two plus one.
"""
from __future__ import annotations

import json
import re

NFC_FACTOR = 4  # NFC / NFKC compose at most 4 characters (the longest canonical decomposition) into one


def _normalizer_factor(spec: dict | None) -> int | None:
    """How many input characters one normalized character can stand for; None when the normalizer can delete."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for sub in spec.get("normalizers") or []:
            f = _normalizer_factor(sub)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend"):
        return 1
    if kind in ("NFC", "NFKC"):
        return NFC_FACTOR
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        content = spec.get("content")
        if isinstance(pattern, str) and isinstance(content, str) and len(content) >= len(pattern) > 0:
            return 1
    return None  # Strip, StripAccents, BertNormalizer, Precompiled (drops control characters), regex Replace ...


def _pre_tokenizer_keeps_all(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_all(s) for s in spec.get("pretokenizers") or [])
    if kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts"):
        return True
    if kind in ("Split", "Punctuation"):
        return str(spec.get("behavior", "")).lower() != "removed"
    return False  # Whitespace, WhitespaceSplit, BertPreTokenizer drop whitespace


class PromptCharBound:
    """What one tokenizer's characters say about token counts.

    Args:
        token_chars: most characters of (kept) prompt text one token stands for.
        droppable: characters the tokenizer may drop without a token (their UTF-8 holds a byte the vocabulary
            lacks), as single characters and code-point ranges.
    """

    def __init__(self, token_chars: int, droppable_chars: str = "", droppable_ranges: tuple = ()):
        self.token_chars = int(token_chars)
        self.droppable_chars = droppable_chars
        self._ranges = (re.compile("[" + "".join(f"{re.escape(chr(a))}-{re.escape(chr(b))}"
                                                 for a, b in droppable_ranges) + "]")
                        if droppable_ranges else None)

    def char_limit(self, max_tokens: int) -> int:
        """Most kept characters a text of at most ``max_tokens`` tokens can have."""
        return max_tokens * self.token_chars

    def kept_chars(self, text: str) -> int:
        """Characters of ``text`` that need tokens (all but the droppable ones; O(len) in C, called only on texts
        already over the limit)."""
        n = len(text) - sum(text.count(c) for c in self.droppable_chars)
        if self._ranges is not None and not text.isascii():
            n -= self._ranges.subn("", text)[1]
        return n

    def exceeds(self, text: str, max_tokens: int) -> bool:
        """True when ``text`` certainly tokenizes to more than ``max_tokens`` tokens (False: it may fit)."""
        limit = self.char_limit(max_tokens)
        return len(text) > limit and self.kept_chars(text) > limit


def _droppable(missing: list[int]) -> tuple[str, tuple] | None:
    """Characters whose UTF-8 holds one of the ``missing`` byte values; None when a continuation byte (0x80-0xBF)
    is missing (too many characters to list)."""
    chars, ranges = [], []
    for b in missing:
        if b < 0x80:
            chars.append(chr(b))
        elif b < 0xC0:
            return None
        elif b in (0xC0, 0xC1) or b >= 0xF5:
            continue  # never in UTF-8
        elif b < 0xE0:
            ranges.append(((b & 0x1F) << 6, ((b & 0x1F) << 6) | 0x3F))
        elif b < 0xF0:
            ranges.append(((b & 0x0F) << 12, ((b & 0x0F) << 12) | 0xFFF))
        else:
            ranges.append(((b & 0x07) << 18, ((b & 0x07) << 18) | 0x3FFFF))
    return "".join(chars), tuple(ranges)


def _hf_droppable(backend) -> tuple[int, str, tuple] | None:
    """(normalizer factor, droppable characters, droppable ranges) of a ``tokenizers`` backend whose model and
    pre-tokenizer keep every character but those; None when no bound is safe."""
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _pre_tokenizer_keeps_all(spec.get("pre_tokenizer")):
        return None
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    if model.get("byte_fallback"):
        return (factor, "", ()) if all(f"<0x{b:02X}>" in vocab for b in range(256)) else None
    if "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        return None
    from tokenfab.tokenizers.tiktoken_tokenizer import _byte_to_unicode
    missing = [b for b, c in _byte_to_unicode().items() if c not in vocab]
    drop = _droppable(missing)
    return None if drop is None else (factor, *drop)


def prompt_char_bound(tokenizer) -> PromptCharBound | None:
    """The :class:`PromptCharBound` of ``tokenizer`` (module docstring): a token stands for at most the longest token
    of the vocabulary, decoded alone or as stored, plus one, times the normalizer's factor; None when the tokenizer
    may drop characters it does not say (no bound is safe). Decodes the whole vocabulary once (under a second for
    150K tokens): compute it once per tokenizer, off the event loop."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    size = len(tokenizer)
    if backend is not None:
        found = _hf_droppable(backend)
        if found is None:
            return None
        factor, chars, ranges = found
        texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        raw = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=0)
        return PromptCharBound((max(max((len(t) for t in texts), default=0), raw) + 1) * factor, chars, ranges)
    from tokenfab.tokenizers.tiktoken_tokenizer import TiktokenTokenizer
    if not isinstance(tokenizer, TiktokenTokenizer):  # a slow transformers tokenizer: nothing known
        return None
    longest = 0
    for i in range(size):  # byte-level BPE over every byte: no character dropped
        try:
            longest = max(longest, len(tokenizer.decode([i])))
        except Exception:  # an id with no token (gaps in the ranks)
            continue
    return PromptCharBound(longest + 1)
