"""Fidelity evaluation: KL divergence / top-1 agreement against transformers (:mod:`tokenfab.eval.kl`, reference in
:mod:`tokenfab.eval.reference`) and planted-code recall (:mod:`tokenfab.eval.needle`).

Kept import-light: the submodules import torch / transformers when used.
"""


def usage_error(message: str) -> ValueError:
    """A ValueError the CLI reports as one line (``tokenfab eval ...: error: ...``); the message names the flag."""
    e = ValueError(message)
    e.user_error = True
    return e
