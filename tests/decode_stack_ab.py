"""One model's greedy decode with and without the fused C++ decode stack, for the tests that assert the two agree.

Import with ``from decode_stack_ab import generate_through``.
"""
from __future__ import annotations

from tokenfab.engine.cpu_decode_stack import CpuDecodeStack


def generate_through(llm, prompts, use_stack: bool, monkeypatch, max_tokens: int = 12):
    """Greedy generation (``max_tokens`` tokens, 2 logprobs, EOS ignored) of ``prompts`` (lists of token ids)
    through the fused decode stack (``use_stack``) or the module path.

    Returns ``(outputs, sizes)``: per prompt (token_ids, logprobs), and the batch size of every
    ``CpuDecodeStack.run`` call made (empty when the module path ran every step).

    Raises:
        AssertionError: the loaded model has no decode stack.
    """
    from tokenfab import SamplingParams
    runner = llm.llm_engine.runner
    stack = runner.cpu_decode_stack
    assert stack is not None  # the stack covers this model
    sizes = []
    real_run = CpuDecodeStack.run

    def counted(self, input_ids, *a):
        sizes.append(len(input_ids))
        return real_run(self, input_ids, *a)

    monkeypatch.setattr(CpuDecodeStack, "run", counted)
    runner.cpu_decode_stack = stack if use_stack else None
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        runner.cpu_decode_stack = stack
        monkeypatch.setattr(CpuDecodeStack, "run", real_run)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], sizes
