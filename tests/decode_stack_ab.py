"""One model's greedy decode with and without the fused C++ decode stack, for the tests that assert the two agree.

Import with ``from decode_stack_ab import generate_through`` (or ``stack_switched`` for a run of one's own).
"""
from __future__ import annotations

import contextlib

from tokenfab.engine.cpu_decode_stack import CpuDecodeStack


@contextlib.contextmanager
def stack_switched(llm, use_stack: bool, monkeypatch, method: str = "run"):
    """Within the block ``llm`` decodes through the fused decode stack (``use_stack``) or the module path; yields
    the list that gets the batch size of every ``CpuDecodeStack.<method>`` call made meanwhile. The stack and the
    method are restored afterwards."""
    runner = llm.llm_engine.runner
    stack = runner.cpu_decode_stack
    sizes = []
    real = getattr(CpuDecodeStack, method)

    def counted(self, input_ids, *a):
        sizes.append(len(input_ids))
        return real(self, input_ids, *a)

    monkeypatch.setattr(CpuDecodeStack, method, counted)
    runner.cpu_decode_stack = stack if use_stack else None
    try:
        yield sizes
    finally:
        runner.cpu_decode_stack = stack
        monkeypatch.setattr(CpuDecodeStack, method, real)


def generate_through(llm, prompts, use_stack: bool, monkeypatch, max_tokens: int = 12):
    """Greedy generation (``max_tokens`` tokens, 2 logprobs, EOS ignored) of ``prompts`` (lists of token ids)
    through the fused decode stack (``use_stack``) or the module path.

    Returns ``(outputs, sizes)``: per prompt (token_ids, logprobs), and the batch size of every
    ``CpuDecodeStack.run`` call made (empty when the module path ran every step).

    Raises:
        AssertionError: the loaded model has no decode stack.
    """
    from tokenfab import SamplingParams
    assert llm.llm_engine.runner.cpu_decode_stack is not None  # the stack covers this model
    with stack_switched(llm, use_stack, monkeypatch) as sizes:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], sizes
