"""The proposer seam: what every drafter returns for a batch of running sequences."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tokenfab.spec_decode.drafting_cost import DraftingCost


@dataclass
class Proposal:
    """Draft tokens for N sequences.

    Attributes:
        draft_ids: [N, k] int64; row i's drafts are ``draft_ids[i, :draft_lens[i]]`` (the rest is padding).
        draft_lens: [N] int64 in [0, k]; 0 = no draft for that row this step.
        draft_probs: [N, k, V] float32, the distribution q each draft token was drawn from (after the request's
            temperature / top-k / top-p), or None when every proposal is deterministic (one-hot q: n-gram lookup,
            greedy draft rows), on any device (the verifier moves it to the target's logits; drafters that draw on
            the device leave it there). Rows at temperature 0 are verified greedily and ignore it.
    """

    draft_ids: np.ndarray
    draft_lens: np.ndarray
    draft_probs: torch.Tensor | None = None

    @staticmethod
    def empty(n: int, k: int) -> "Proposal":
        return Proposal(np.zeros((n, k), dtype=np.int64), np.zeros(n, dtype=np.int64), None)


@dataclass(frozen=True)
class HiddenRequest:
    """What target hidden states a drafter needs from every target forward (:meth:`Proposer.hidden_request`).

    Attributes:
        final: the final hidden states (after the target's last norm, the LM head's input) of every token.
        layer_ids: decoder layers (0-based) whose output (the residual stream after the layer) is tapped for every
            token, in this order; () = none. Taps are forward hooks: the decode-graph buffers return them
            (recorded with rank 0's graphs), other steps run the module path (the fused CPU decode stack does not
            expose a layer's output).
        tap_stream: which hidden state a tap is where a layer's output is not one tensor (Kimi K3's attention
            residuals: ``model.tap_hidden``): ``"partial_sum"`` (the raw partial-block sum after the layer) or
            ``"attn_res_mixture"`` (the attention-residual mix the next layer computes from it); other models
            ignore it.
    """

    final: bool = True
    layer_ids: tuple[int, ...] = ()
    tap_stream: str = "partial_sum"


@dataclass
class CapturedHidden:
    """The target hidden states of one target forward (a plain step, a prefill chunk, a verification step).

    Tokens are the forward's flat batch: T tokens of the B sequences ``seqs``, token t of ``seqs[req_idx[t]]`` at
    ``positions[t]``. Tensors are on the target's device in its dtype and valid until the target's next forward.

    Attributes:
        seqs: the B sequences of the step (``Sequence`` objects; ``seq.row``, ``seq.num_tokens`` are current).
        rows: [B] int64 their rows in the runner's token array.
        req_idx: [T] int64 index into ``seqs`` of each token.
        positions: [T] int64 position of each token in its sequence.
        hidden: [T, H] final post-norm hidden states, or None when not asked for.
        taps: [T, len(layer_ids), H] the tapped layer outputs, or None when none asked for.

    Which tokens are final context: when :meth:`Proposer.observe` runs, the step's sampled / accepted tokens are
    already appended, so token t belongs to its sequence's context iff ``positions[t] <= seq.num_tokens - 2``
    (its next token, the one its hidden state predicts, is known: ``token_ids[row, positions[t] + 1]``). Later
    positions were drafts rejected in this step. Positions a step did not compute (prefix-cache hits, a failed step
    rerun in parts) are never observed.
    """

    seqs: list
    rows: np.ndarray
    req_idx: np.ndarray
    positions: np.ndarray
    hidden: torch.Tensor | None
    taps: torch.Tensor | None = None


class Proposer:
    """Interface of a drafter.

    ``propose(seqs, rows, token_ids, lengths, max_lens)``: ``seqs`` the N running sequences to draft for (each
    with its last sampled token not yet in the KV cache), ``rows`` [N] their rows in ``token_ids`` (the model
    runner's persistent [rows, max_model_len + 1] int64 token array, prompt and output), ``lengths`` [N] their
    token counts, ``max_lens`` [N] the most drafts each may get (what max_tokens and max_model_len leave).
    Returns a :class:`Proposal` with ``draft_lens <= max_lens``.

    ``on_verified(seqs, num_accepted)``: after verification, how many drafts of each proposed row were accepted
    (int64 [N]; rows not verified this step count 0), so stateful drafters roll back.

    The target-hidden-state seam (drafters that run on the target's hidden states: MTP, DSpark): a drafter whose
    :meth:`hidden_request` returns a :class:`HiddenRequest` gets :meth:`observe` called with a
    :class:`CapturedHidden` after every target forward of the engine: plain steps (prefill chunks, decode steps,
    also while the policy keeps speculation off) and verification steps, each once its outputs are processed
    (tokens appended, rejected drafts rolled back) and before the next step's :meth:`propose`. It writes its own
    KV for those positions there, so it keeps up with the context as vLLM runs its drafter after each forward.
    A failed step rerun in parts (failure isolation) is not observed. None (n-gram, draft model): nothing is
    captured and plain decode steps keep the fused draw (``CpuDecodeStack.run_sample``).
    """

    num_speculative_tokens: int

    def propose(self, seqs, rows: np.ndarray, token_ids: np.ndarray, lengths: np.ndarray,
                max_lens: np.ndarray) -> Proposal:
        raise NotImplementedError

    def on_verified(self, seqs, num_accepted: np.ndarray) -> None:
        return None

    def hidden_request(self) -> HiddenRequest | None:
        """The target hidden states :meth:`observe` needs from every target forward, or None (not called)."""
        return None

    def observe(self, captured: CapturedHidden) -> None:
        """After every target forward (see the class docstring); only when :meth:`hidden_request` is not None."""
        return None

    def preallocates_kv(self) -> bool:
        """True when proposing writes KV rows (a draft model): the caller reserves the verification blocks first."""
        return False

    def drafting_cost(self, seqs, lengths: np.ndarray, batch_size: int,
                      plain_step_s: float | None) -> DraftingCost | None:
        """This proposer's own cost of drafting for ``seqs`` (token counts ``lengths`` [N] int64) in a step of
        ``batch_size`` running rows, in units of the target's plain step there
        (:class:`~tokenfab.spec_decode.drafting_cost.DraftingCost`), for the cost rule (policy.py, rule 3);
        ``plain_step_s``: the target's measured seconds per plain step at this batch size, or None (no
        measurement, or ``timed_switch_off`` false: use a prior). None (the default): free or not modelled
        (n-gram lookup; MTP and DSpark, whose work the clock of step_timing.py covers)."""
        return None

    def last_catch_up_s(self) -> float:
        """Seconds the last :meth:`propose` spent on catch-ups beyond the steady 1-2 tokens per row (a draft model
        prefilling a prompt): a one-time cost the cost rule charges (``DraftingCost.catch_up``), so the clock
        (step_timing.py) leaves it out of the speculative step's time per row-token. 0 by default."""
        return 0.0
