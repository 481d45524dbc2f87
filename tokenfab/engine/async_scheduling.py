"""Async scheduling: the next step is scheduled, built and launched before the current step's sampled ids reach the
host (vLLM's ``--async-scheduling``), so the host's scheduling, input building and output processing overlap the
device's work instead of idling it between steps.

How a step goes (``LLMEngine.step`` with this mode on; step k is in flight when step k + 1 begins):

1. :meth:`AsyncScheduling.place` applies step k's progress without its ids: ``num_computed_tokens`` advances and every
   sequence step k sampled gets a *placeholder* token, ``-(j + 1)`` for row j of step k's draw, in its token list and
   in the runner's token array. Rules that need only counts (``max_tokens``, the model length) finish sequences now.
2. The scheduler schedules step k + 1 as usual (the placeholders count as tokens); the runner builds its inputs and
   launches it. Input ids that are placeholders are taken from step k's drawn ids where they were drawn
   (:func:`fill_placeholders` on the device: inside the decode graphs, from a copy of the draw's ids, and before
   the embedding on the module path; the fused CPU decode stack, whose ids are numpy, fills them on the host:
   :func:`fill_placeholders_host`): no host round trip stands between two steps.
3. :meth:`AsyncScheduling.fill` waits for step k's ids, writes them over the placeholders and applies the rules that
   need the ids (EOS, ``stop_token_ids``), then step k's outputs are emitted (detokenization and stop strings, as
   in step: engine/output_processor.py), all while step k + 1 computes.

The cost: a sequence that an end token finishes at step k has already been scheduled in step k + 1; that row's work
is wasted and its token dropped (its output is exactly that of synchronous scheduling). Its blocks and its KDA
state slot are freed at the fill and may go to another sequence in step k + 2: every write of step k + 1 precedes
step k + 2's on the device's one stream, so the stale row never overwrites the new owner's data, and the prefix
cache never hashes the block slot the stale row wrote (it holds no computed token).

Where a placeholder could be read before its id exists, a step is not scheduled ahead: rows whose logits processors need
each id on the host (bad words read the output's last tokens, structured outputs advance a grammar:
``LogitsProcessorState.any_consuming``) and speculative decoding (drafters read the ids). Penalized rows schedule ahead:
while this mode is on their counts live on the logits' device and advance at each draw (engine/draw_time_counts.py);
min_p, logit_bias and allowed_token_ids depend on the request's parameters alone. A step that cannot be placed first
waits for its predecessor and processes it in line, as without this mode. Under tensor parallel rank 0 broadcasts the
drawn ids a step's placeholders stand for on the model's process group right after the step's header (NCCL on GPUs:
device to device, in stream order, no host copy; parallel/worker.py), and every worker fills its placeholders from them
as rank 0 does.

Token ids, text, finish reasons and logprobs equal those of synchronous scheduling for greedy and seeded requests
(tests/test_async_scheduling.py); unseeded sampled requests draw from the engine's generator, so the wasted rows
shift which uniforms later rows receive. ``TOKENFAB_ASYNC_SCHEDULING``: "auto" (default; on for CUDA / ROCm engines),
"1" (always; CPU tests, where the forward is synchronous and nothing overlaps) or "0" (never);
``EngineConfig.async_scheduling`` (``serve --[no-]async-scheduling``) overrides it.
"""
from __future__ import annotations

import numpy as np
import torch

from tokenfab.engine.output_processor import length_reached
from tokenfab.engine.overlap_setting import overlap_setting
from tokenfab.errors import UnsupportedError


def async_scheduling_enabled(device: torch.device) -> bool:
    """``TOKENFAB_ASYNC_SCHEDULING``: "auto" (default: on for CUDA / ROCm engines), "1" (always) or "0" (never)
    (engine/overlap_setting.py).

    Raises:
        EngineConfigError: any other value.
    """
    return overlap_setting("TOKENFAB_ASYNC_SCHEDULING", device)


def refuse_unsupported(speculative: bool) -> None:
    """Refuse async scheduling asked for beside speculative decoding.

    Raises:
        UnsupportedError: speculative decoding is set (the drafters need each step's ids on the host).
    """
    if speculative:
        raise UnsupportedError("async_scheduling=True does not run with speculative decoding: the drafters need each "
                               "step's ids on the host; leave async_scheduling unset or false.")


def fill_placeholders(ids: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``ids`` [T] int64 with every placeholder ``-(j + 1)`` replaced by ``source[j]`` (``source`` [N] int64: the
    previous step's drawn ids, on the same device); other entries kept. A new tensor; no host sync."""
    j = (-1 - ids).clamp_(0, max(source.shape[0] - 1, 0))
    return torch.where(ids < 0, source[j], ids)


def fill_placeholders_host(ids: np.ndarray, source: torch.Tensor | None) -> np.ndarray:
    """:func:`fill_placeholders` for host arrays (paths that take numpy ids: the fused CPU decode stack); ``ids`` is
    returned as it is when it holds no placeholder. ``source`` must be a host tensor (CPU engines)."""
    if source is None or not (ids < 0).any():
        return ids
    src = source.numpy()
    return np.where(ids < 0, src[np.clip(-1 - ids, 0, max(len(src) - 1, 0))], ids)


class AsyncScheduling:
    """The in-flight step of an engine that schedules ahead, and the two halves of its output processing that
    bracket the next step's launch (see the module docstring).

    Args:
        engine: the :class:`~tokenfab.engine.engine.LLMEngine` (its scheduler, runner, output processor and limits).
    """

    def __init__(self, engine):
        self.eng = engine
        self.inflight = None  # (ScheduledBatch, StepOutput) launched, not yet placed
        # (StepOutput, [(row j of its draw, sequence, finished by length, its row then)]) awaiting its ids
        self._placed = None
        self.steps_ahead = 0  # steps launched before their predecessor's ids were on the host (tests, stats)

    def can_place(self, batch, out) -> bool:
        """Whether the step after (``batch``, ``out``) may be scheduled before ``out``'s ids arrive: no sequence it
        sampled uses logits processors that need each id on the host before the next draw (bad words, grammars)."""
        if out.sampler_output is None:
            return True
        rows = batch.rows[out.sampled_index]
        proc = self.eng.runner.sampler.processors if self.eng.runner.sampler is not None else None
        return proc is None or not proc.any_consuming(rows)

    def place(self, batch, out) -> torch.Tensor | None:
        """Step 1 for the in-flight step (``batch``, ``out``): its progress, placeholders for its sampled ids and the
        count-based stop rules. Returns the device tensor the placeholders index (its drawn ids), or None when it
        sampled nothing."""
        eng = self.eng
        eng.outputs.progress(batch, out)
        so = out.sampler_output
        if so is None:
            return None
        seqs, idx = batch.seqs, out.sampled_index
        max_len = eng.max_model_len
        entries, rows, pos, ph = [], [], [], []
        for j, i in enumerate(idx.tolist()):
            seq = seqs[i]
            if seq.is_finished:  # aborted, or finished by an end token found at the last fill: its id is dropped
                continue
            seq.token_ids.append(-1 - j)
            rows.append(seq.row)
            pos.append(seq.num_tokens - 1)
            ph.append(-1 - j)
            by_length = length_reached(seq, max_len)
            entries.append((j, seq, by_length, seq.row))
            if by_length:
                eng.scheduler.finish(seq, "length")  # frees its row and blocks now: the next schedule may use them
        if rows:
            eng.runner.token_ids[np.asarray(rows), np.asarray(pos)] = ph
        self._placed = (out, entries)
        return so.device_ids if so.device_ids is not None else so.token_ids

    def fill(self) -> list[tuple[object, object]]:
        """Step 3: wait for the placed step's ids, write them over its placeholders (in the runner's token array
        only for sequences that still hold their row) and apply the rules that need them. Returns the (Request,
        Sequence) pairs to emit."""
        if self._placed is None:
            return []
        out, entries = self._placed
        self._placed = None
        so = out.sampler_output
        so.wait()
        held = [(j, s, r) for j, s, _, r in entries if s.row == r and r >= 0]
        if held:
            toks = so.token_ids.numpy()
            rows = np.fromiter((r for _, _, r in held), dtype=np.int64, count=len(held))
            pos = np.fromiter((s.num_tokens - 1 for _, s, _ in held), dtype=np.int64, count=len(held))
            self.eng.runner.write_tokens(rows, pos, toks[np.fromiter((j for j, _, _ in held), dtype=np.int64,
                                                                   count=len(held))])
        return self.eng.outputs.take_tokens([(j, s, by_length) for j, s, by_length, _ in entries], so)
