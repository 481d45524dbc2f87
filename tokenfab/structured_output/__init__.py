"""Structured outputs: constrain generation to a JSON schema, any JSON, a regex, a choice or an EBNF grammar.

``params.py``: the request-side description (vLLM's ``StructuredOutputsParams``); ``compiler.py``: grammars compiled
with xgrammar against the model's tokenizer. The per-step token mask lives behind the logits-processor seam
(``tokenfab/engine/grammar_state.py``).
"""
