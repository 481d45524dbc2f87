"""Incremental detokenization (text deltas as tokens arrive) and stop-string matching.

Decoding a token alone can split a multi-byte character or drop a leading space, so each step decodes a short
window of recent tokens twice (with and without the new ones) and emits the difference, holding text back while it
ends in an incomplete character (U+FFFD). Same idea as vLLM's / HF TextStreamer's incremental detokenizer.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens.

    Args:
        tokenizer: a transformers tokenizer (``decode``).
        skip_special_tokens: drop special tokens (EOS...) from the text.
        stop: stop strings; the text is cut before the first one found.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None):
        self.tok = tokenizer
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
        prefix = self.tok.decode(output_ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = self.tok.decode(output_ids[self.prefix_offset:], skip_special_tokens=self.skip)
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
