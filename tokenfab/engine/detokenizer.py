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
    on the step loop, benchmarks/NOTES.md entry 35); otherwise transformers' ``decode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode
    return tokenizer.decode


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens.

    Args:
        tokenizer: a transformers tokenizer (``decode``).
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

    def update(self, output_ids: list[int]) -> tuple[str, str | None]:
        """Consume the sequence's full generated id list; returns (new text delta, stop string hit or None)."""
        if self.tok is None:
            return "", None
        prefix = self._decode(output_ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = self._decode(output_ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", None
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += delta
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0:
                cut = len(self.text) - i
                self.text = self.text[:i]
                return delta[: max(0, len(delta) - cut)], s
        return delta, None
