"""A scripted stand-in for LLMEngine (no model) with exact control over steps, for the server's streaming tests and
benchmarks/streaming_itl.py: every step each running request gains one token whose text is one "x", so a streamed
chunk's text length is its number of tokens."""
from __future__ import annotations

import time
import types

from tokenfab.outputs import CompletionOutput, RequestMetrics, RequestOutput


class ScriptedEngine:
    """The LLMEngine surface AsyncLLM and the routes use; a step sleeps ``step_s`` (GIL released, like a device)
    and appends one token to every request (finished at its ``max_tokens``).

    Serve it with ``build_app(AsyncLLM(ScriptedEngine()), name)``; send prompts as token ids below ``vocab_size``.
    """

    def __init__(self, step_s: float = 0.0002, vocab_size: int = 64):
        self.step_s = step_s
        self.tokenizer = None
        self.max_model_len = 4096
        self.model_config = types.SimpleNamespace(vocab_size=vocab_size)
        self.scheduler = types.SimpleNamespace(running=[])
        self.reqs: dict = {}
        self.steps = 0

    def get_stats(self) -> dict:
        """No gauges."""
        return {}

    def health_error(self):
        """Always healthy (None)."""
        return None

    def shutdown(self) -> None:
        """Nothing to stop."""
        pass

    def has_unfinished_requests(self) -> bool:
        """True while a request runs."""
        return bool(self.reqs)

    def add_request(self, rid, prompt, ids, params, arrival_time=None, priority=0) -> None:
        """Start request ``rid`` (its ``params.max_tokens`` tokens to come)."""
        self.reqs[rid] = (list(ids), params, [], RequestMetrics(arrival_time=arrival_time or time.monotonic()))

    def abort_request(self, rid):
        """Forget request ``rid``."""
        self.reqs.pop(rid, None)
        return None

    def step(self) -> list[RequestOutput]:
        """Sleep ``step_s``, then one more token for every request; their cumulative outputs."""
        time.sleep(self.step_s)
        self.steps += 1
        outs = []
        for rid, (ids, params, toks, m) in list(self.reqs.items()):
            toks.append(7)
            done = len(toks) >= params.max_tokens
            o = CompletionOutput(index=0, text="x" * len(toks), token_ids=list(toks),
                                 finish_reason="length" if done else None)
            outs.append(RequestOutput(rid, None, ids, [o], finished=done, metrics=m))
            if done:
                del self.reqs[rid]
        return outs
