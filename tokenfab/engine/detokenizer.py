"""Incremental detokenization (text deltas as tokens arrive) and stop-string matching.

Decoding a token alone can split a multi-byte character or drop a leading space, so each step decodes a short
window of recent tokens twice (with and without the new ones) and emits the difference, holding text back while it
ends in an incomplete character (U+FFFD). Same idea as vLLM's / HF TextStreamer's incremental detokenizer.
"""
from __future__ import annotations


def decode_fn(tokenizer):
    """The tokenizer's ``decode(ids, skip_special_tokens=...)``: for a fast (Rust ``tokenizers``) tokenizer that does
    no clean-up of tokenization spaces, the backend's own decode, which is what transformers' ``decode`` returns for
    it without the Python layers around it (~2 µs instead of ~6 µs per call warm, paid twice per token per sequence
    on the step loop, benchmarks/NOTES.md entry 35); otherwise transformers' ``decode``; None without a tokenizer
    (a checkpoint folder with no tokenizer files: token ids only, text stays empty, as vLLM's skip_tokenizer_init)."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode
    return tokenizer.decode


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens.

    Invariant: ``text`` is a prefix of ``decode(output_ids)`` (cut before a stop string once one ended generation),
    and after :meth:`finish` it is the whole ``decode(output_ids)`` (or the part before the stop string).

    Args:
        tokenizer: a transformers tokenizer (``decode``), or None (no text: ``text`` stays "").
        skip_special_tokens: drop special tokens (EOS...) from the text.
        stop: stop strings; the text is cut before the first one found.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None):
        self.tok = tokenizer
        self._decode = decode_fn(tokenizer)
        self.skip = skip_special_tokens
        self.stop = stop or []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def visible_text(self) -> str:
        """Text safe to show while the sequence runs: with stop strings, the last len(longest stop) - 1 characters
        are held back, since they may begin a stop string that later tokens complete (vLLM does the same)."""
        hold = max((len(s) for s in self.stop), default=1) - 1
        return self.text[: len(self.text) - hold] if hold else self.text

    def update(self, output_ids: list[int], check_stop: bool = True, final: bool = False) -> tuple[str, str | None]:
        """Consume the sequence's full generated id list; returns (new text delta, stop string hit or None).

        ``check_stop`` False (the sequence is still below ``min_tokens``): the text grows but no stop string is
        searched, so none is cut; later steps search only for stop strings that end in their new text (vLLM's
        rule). Text is held back while it ends in an incomplete UTF-8 character (U+FFFD) until more tokens
        complete it or the sequence ends (``final``, see :meth:`finish`)."""
        if self._decode is None:
            return "", None
        prefix = self._decode(output_ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = self._decode(output_ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return "", None
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        before = len(self.text)
        self.text += delta
        if not check_stop or not self.stop:
            return delta, None
        hit = None
        for s in self.stop:  # the earliest stop string that ends inside the new text
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is None:
            return delta, None
        i, s = hit
        self.text = self.text[:i]
        return delta[: max(0, i - before)], s

    def finish(self, output_ids: list[int], check_stop: bool = True) -> tuple[str, str | None]:
        """The sequence ended (EOS, stop token, length, abort): append what :meth:`update` held back (the trailing
        bytes of an incomplete UTF-8 character decode to U+FFFD, as ``tokenizer.decode`` shows them), so ``text``
        equals ``decode(output_ids)`` (up to a stop string). Returns (delta, stop string hit or None)."""
        if self.read_offset >= len(output_ids):
            return "", None
        return self.update(output_ids, check_stop, final=True)
