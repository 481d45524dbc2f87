"""A proposer's own cost per speculative step, in units of the target's plain decode step (policy.py, rule 3).

:class:`DraftingCost` is what a proposer tells the cost rule (``Proposer.drafting_cost``; None: free, as n-gram
lookup): ``forward``, one drafting forward over the N rows drafting this step (one token per row, plus the one or
two tokens each row catches up after a verification), so a step drafting up to kk tokens per row costs kk of them;
and ``catch_up`` [N], each row's longer catch-up (its tokens beyond those 2: the prompt at the row's first proposal,
the tokens of the plain steps since its last one), a one-time cost the rule spreads over the row's remaining steps.
Both are fractions of one plain decode step of the target at the step's batch size B.

:class:`DraftCostModel` is a draft model's estimate of them:

* prior (before a measurement, and always when ``plain_step_s`` is None, i.e. ``timed_switch_off`` is false): the
  draft's costs scale with its weight bytes. With rho = draft weight bytes / target weight bytes (their checkpoints'
  weight files, :func:`checkpoint_bytes`) and r =
  ``verify_token_cost`` (the target's cost per token over its fixed cost, policy.py), a draft forward over n tokens
  costs rho (1 + r n) in units of the target's fixed cost, and a plain step 1 + r B: so ``forward`` =
  rho (1 + r N) / (1 + r B) and one catch-up token rho r / (1 + r B). SmolLM2-135M as target (bf16, 269 MB)
  with its own Q4_1 GGUF as draft (98 MB): rho = 0.37.
* measured: exponential moving averages (step_timing.ema: weight ``EMA_DECAY`` on the old value) of the draft's seconds per forward
  (per bucket of N, a power of two as step_timing.bucket, and whether every row is greedy: the greedy draft draws
  inside the fused stack's call) and of its seconds per catch-up token (from catch-up forwards over more than 2N
  tokens), divided by the target's measured seconds per plain step at B (``StepTiming.plain``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from tokenfab.spec_decode.step_timing import bucket, ema


@dataclass
class DraftingCost:
    """A proposer's cost this step, in target plain steps at the step's batch size (module docstring).

    Attributes:
        forward: one drafting forward over the N drafting rows (>= 0; a step drafting up to kk tokens pays kk).
        catch_up: [N] float64 >= 0, each row's one-time catch-up cost (0 for rows already caught up).
    """

    forward: float
    catch_up: np.ndarray


WEIGHT_FILE_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


def checkpoint_bytes(path: str) -> int:
    """Weight bytes of a checkpoint as stored: a weight file's size, or the summed sizes of a folder's weight files
    (``WEIGHT_FILE_SUFFIXES``). The loaded model's tensors do not tell (the fused CPU decode stack holds the
    target's layer weights outside the module). 0 when there are none."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    if not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(WEIGHT_FILE_SUFFIXES) and os.path.isfile(os.path.join(path, f)))


class DraftCostModel:
    """Prior and measured cost of a draft model's forwards (module docstring).

    Args:
        ratio: rho, the draft's weight bytes over the target's (> 0).
        token_cost: r, ``verify_token_cost`` (>= 0).
    """

    def __init__(self, ratio: float, token_cost: float):
        if not ratio > 0:
            raise ValueError(f"DraftCostModel: ratio must be > 0 (draft weight bytes / target weight bytes), got "
                             f"{ratio!r}.")
        self.ratio, self.r = float(ratio), float(token_cost)
        self.forward_s: dict[tuple[int, bool], float] = {}
        self.token_s: float | None = None
        self.last_catch_up_s = 0.0  # the last recorded proposal's catch-up seconds beyond its forwards

    def record(self, n_rows: int, greedy: bool, catch_up_tokens: int, first_s: float, rest_s: float,
               forwards: int) -> None:
        """One proposal: ``n_rows`` rows, ``forwards`` drafting forwards, the first over ``catch_up_tokens`` tokens
        in ``first_s`` seconds, the other ``forwards - 1`` (with every forward's draw) in ``rest_s`` seconds.
        Sets ``last_catch_up_s``: the first forward's seconds beyond a steady one (0 for a steady catch-up)."""
        key = (bucket(n_rows), bool(greedy))
        self.last_catch_up_s = 0.0
        if catch_up_tokens <= 2 * n_rows:
            self.forward_s[key] = ema(self.forward_s.get(key), (first_s + rest_s) / max(forwards, 1))
            return
        if forwards > 1:
            self.forward_s[key] = ema(self.forward_s.get(key), rest_s / (forwards - 1))
        f = self.forward_s.get(key)
        extra = catch_up_tokens - n_rows
        per_tok = max(first_s - f, 0.0) / extra if f is not None else first_s / catch_up_tokens
        self.token_s = ema(self.token_s, per_tok)
        self.last_catch_up_s = per_tok * extra

    def estimate(self, n_rows: int, batch_size: int, greedy: bool, catch_up_tokens: np.ndarray,
                 plain_step_s: float | None) -> DraftingCost:
        """The :class:`DraftingCost` of drafting for ``n_rows`` rows in a step of ``batch_size`` running rows;
        ``catch_up_tokens`` [N] int64 the rows' tokens to catch up beyond 2; ``plain_step_s`` the target's seconds
        per plain step at this batch size (None: the prior only)."""
        rb = 1.0 + self.r * max(batch_size, 1)
        f_s = self.forward_s.get((bucket(n_rows), bool(greedy)))
        if plain_step_s is not None and plain_step_s > 0 and f_s is not None:
            forward = f_s / plain_step_s
        else:
            forward = self.ratio * (1.0 + self.r * n_rows) / rb
        if plain_step_s is not None and plain_step_s > 0 and self.token_s is not None:
            tok = self.token_s / plain_step_s
        else:
            tok = self.ratio * self.r / rb
        return DraftingCost(float(forward), np.asarray(catch_up_tokens, dtype=np.float64) * tok)
