"""AsyncLLM: the bridge between asyncio request handlers and the (thread-unsafe) LLMEngine.

One background thread owns the :class:`~tokenfab.engine.engine.LLMEngine` (it builds it, see
:meth:`AsyncLLM.from_config`) and runs its step loop. Handlers never
touch the engine: they put commands (add / abort) on a thread-safe queue and read :class:`RequestOutput` objects
from a per-request :class:`_Stream` on the server's event loop.

Delivery (streaming as vLLM does it): after each step the engine thread hands the step's outputs to each event
loop in one ``call_soon_threadsafe`` batch, and a stream yields one output per step (``stream_interval`` N: every
N tokens, the first token and the end at once). Outputs are cumulative, so a handler that has not read the
previous one yet gets them merged. The engine thread does not wait for the handlers, except when the previous
step's batch is still unflushed when the next one is ready: then it waits (the GIL released, at most
``flush_timeout`` seconds) until the loop has run it. Without that, an engine thread that holds the GIL for most
of its step (a GPU engine's host work) leaves the event loop ~one switch interval (5 ms) per socket write (the
"convoy effect", bpo-7946), and 16 streams got ~15 tokens a chunk (issue 33); with it the loop writes every
stream's chunk in one go and the engine stalls only for that.

Failure isolation:

- a request the engine refuses in ``add_request`` (too long, bad token ids ...) fails alone with that error;
- a request the engine fails inside a step (its rows raised: ``RequestOutput.error``, finish_reason "error"; the
  engine finds it by re-running the step's sequences in halves, engine.py) gets an :class:`EngineStepError` on its
  stream only; the step's other requests go on with the tokens they would have had;
- an exception that escapes ``engine.step()`` (one the engine could not pin on a request) fails the requests that
  were running with an :class:`EngineStepError`, frees their KV blocks, and the loop keeps going for the rest;
- after :meth:`AsyncLLM.shutdown` starts, new requests get :class:`EngineShutdownError` (HTTP 503) and in-flight
  ones are failed with it.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from dataclasses import replace
from typing import AsyncIterator, Callable

from tokenfab.outputs import RequestOutput
from tokenfab.sampling_params import SamplingParams

logger = logging.getLogger("tokenfab.server")


class EngineShutdownError(RuntimeError):
    """The server is shutting down: no new requests (HTTP 503)."""


class EngineStepError(RuntimeError):
    """An engine step failed while this request was running (HTTP 500); other requests are unaffected."""


class _Stream:
    """Per-request delivery channel on the server's event loop: the latest cumulative output, not yet read.

    The engine thread fills it through :meth:`put` (one item) or :meth:`AsyncLLM._deliver` (a step's batch, run on
    the loop); the handler reads it with :meth:`get`. An unread output is replaced by a newer one (outputs are
    cumulative, nothing is lost); an exception replaces any output and stays.
    """

    __slots__ = ("loop", "item", "waiter", "sent_tokens")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.item: RequestOutput | BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.sent_tokens = 0  # engine thread: tokens of the last output handed over (stream_interval)

    def push(self, item: RequestOutput | BaseException) -> None:
        """Store ``item`` for the reader (event-loop thread only)."""
        if isinstance(self.item, BaseException):
            return
        self.item = item
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deliver from any thread (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.push, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def get(self) -> RequestOutput | BaseException:
        """The next item (waits for one)."""
        while self.item is None:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item, self.item = self.item, None
        return item


def _snapshot(out: RequestOutput) -> RequestOutput:
    """Copy the lists the engine thread keeps mutating (logprobs) so handlers read a consistent picture."""
    outs = [replace(o, token_ids=list(o.token_ids),
                    logprobs=list(o.logprobs) if o.logprobs is not None else None) for o in out.outputs]
    plp = list(out.prompt_logprobs) if out.prompt_logprobs is not None else None
    return replace(out, outputs=outs, prompt_logprobs=plp, metrics=copy.copy(out.metrics))


class AsyncLLM:
    """Run an LLMEngine on a background thread and serve many concurrent asyncio callers.

    Args:
        engine: a built LLMEngine (this object becomes its only user).
        on_step: optional callback ``(outputs, stats, step_seconds)`` called on the engine thread after every
            step (metrics); exceptions in it are logged and ignored.
        on_finish: optional callback ``(RequestOutput)`` for every finished request (engine thread).
        stream_interval: hand a running request's output to its handler every this many new tokens (the first
            token and the end always at once); 1 (default): after every step, as vLLM's ``--stream-interval``.
        flush_timeout: longest wait (seconds) of the engine thread for the event loop to take the previous step's
            outputs before it hands over the next ones (see the module docstring).

    Use :meth:`start` once, ``async for out in generate(...)`` per request, :meth:`shutdown` at the end.
    """

    def __init__(self, engine, on_step: Callable | None = None, on_finish: Callable | None = None,
                 stream_interval: int = 1, flush_timeout: float = 0.05):
        if int(stream_interval) < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}.")
        self.engine = engine
        self.stream_interval = int(stream_interval)
        self.flush_timeout = float(flush_timeout)
        self.tokenizer = self._private_tokenizer(engine.tokenizer)
        self.max_model_len: int = engine.max_model_len
        self.model_config = engine.model_config
        self.on_step = on_step
        self.on_finish = on_finish
        self._cmds: queue.Queue = queue.Queue()
        self._cmds_lock = threading.Lock()  # add commands vs the engine thread closing (no add left unanswered)
        self._closed = False
        self._flush_cond = threading.Condition()
        self._pending: dict = {}  # event loop -> batches handed to it that it has not run yet
        self._stalled: set = set()  # loops that missed a flush_timeout: not waited for until they catch up
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._thread: threading.Thread | None = None
        self._go: threading.Event | None = None  # set by start() when from_config already made the engine thread
        self._started = False
        self._stopping = threading.Event()
        self._stats: dict = engine.get_stats()
        self._stats_lock = threading.Lock()
        self.dead_error: BaseException | None = None
        self.num_in_flight = 0  # generate() calls not yet returned (event-loop thread writes it; drain reads it)
        self.num_aborted = 0  # requests aborted before finishing (client went away); engine thread writes it
        self.num_step_failures = 0  # engine steps that raised

    @staticmethod
    def _private_tokenizer(tok):
        """Handlers tokenize on the event-loop thread while the engine decodes on its own: give them a copy."""
        if tok is None:
            return None
        try:
            return copy.deepcopy(tok)
        except Exception:
            return tok

    @classmethod
    def from_config(cls, config, progress: bool = False, **kw) -> "AsyncLLM":
        """Build the engine from an EngineConfig and wrap it (not started: call :meth:`start`).

        The engine is built on the engine thread itself, which later runs the step loop. On CPU, OpenMP keeps one
        thread pool per thread that starts parallel regions; loading the model on the caller's thread left a second
        pool behind and every decode step ran ~1.4x slower (measured; the likely cause, libgomp's barrier throttling
        once it manages more threads than cores, is not pinned down: benchmarks/NOTES.md, entry 18). The caller's
        thread starts no parallel region.

        Raises:
            whatever building the engine raised (bad model folder, unknown architecture, out of memory ...).
        """
        from tokenfab.engine.engine import LLMEngine

        built: dict = {}
        ready, go = threading.Event(), threading.Event()

        def engine_thread() -> None:
            try:
                built["engine"] = LLMEngine.from_config(config, progress=progress)
            except BaseException as e:  # re-raised on the caller's thread
                built["error"] = e
                return
            finally:
                ready.set()
            go.wait()
            owner = built.get("owner")
            if owner is not None:
                if owner._stopping.is_set():
                    owner._close(EngineShutdownError("the server is shutting down; the request was not finished."))
                else:
                    owner._loop()

        thread = threading.Thread(target=engine_thread, name="tokenfab-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in built:
            raise built["error"]
        obj = cls(built["engine"], **kw)
        built["owner"] = obj
        obj._thread, obj._go = thread, go
        return obj

    # ------------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the step loop on the engine thread (idempotent)."""
        if self._go is not None:
            self._go.set()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tokenfab-engine", daemon=True)
            self._thread.start()
        self._started = True

    @property
    def is_stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def is_running(self) -> bool:
        return (self._started and self._thread is not None and self._thread.is_alive()
                and not self._stopping.is_set())

    def request_stop(self) -> None:
        """Stop without waiting (any thread): new requests are refused and in-flight ones end with
        EngineShutdownError after the current step (a stream gets an error event and ``[DONE]``)."""
        self._stopping.set()
        self._cmds.put(("wake",))
        if self._go is not None:
            self._go.set()  # a never-started engine thread exits

    def shutdown(self, timeout: float = 10.0) -> None:
        """Refuse new requests, fail in-flight ones with EngineShutdownError, stop and join the engine thread."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()  # stops tensor-parallel workers (no-op on one device)

    def health_error(self) -> str | None:
        """Why this server can no longer serve, or None: the engine's own reason (a tensor-parallel rank failed in
        a step), a tensor-parallel worker process that has exited (seen before any step needs it), or an engine
        thread that died. Any thread may call it."""
        reason = self.engine.health_error()
        if reason:
            return reason
        group = getattr(self.engine, "tp_group", None)
        for p in getattr(group, "procs", None) or []:
            code = p.exitcode
            if code is not None:
                return (f"tensor-parallel rank {getattr(p, 'rank', '?')} exited with code {code}; restart the "
                        "server")
        if self._started and self._thread is not None and not self._thread.is_alive() and not self.is_stopping:
            return "the engine thread stopped" + (f" ({type(self.dead_error).__name__}: {self.dead_error})"
                                                  if self.dead_error is not None else "")
        return None

    def get_stats(self) -> dict:
        """The engine's latest gauges/counters (copied from the engine thread after each step)."""
        with self._stats_lock:
            return dict(self._stats)

    # -------------------------------------------------------------------------------------------------- requests
    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                       params: SamplingParams, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its cumulative RequestOutputs until it finishes (``priority``: the
        engine's add_request's, lower runs earlier under scheduling_policy "priority").

        One output per engine step that gave the request tokens (every ``stream_interval`` tokens); several
        steps are merged into one yielded output only when the consumer is slower than the engine (outputs are
        cumulative, so nothing is lost). If the consumer stops early (client disconnect, cancellation)
        the request is aborted and its KV blocks freed.

        Raises:
            EngineShutdownError: the server is shutting down.
            PromptTooLongError, ValueError: refused by the engine's ``add_request``.
            EngineStepError: an engine step failed while the request was running.
        """
        if not self.is_running:
            raise EngineShutdownError("the server is shutting down; no new requests are accepted.")
        stream = _Stream(asyncio.get_running_loop())
        with self._cmds_lock:
            if self._closed:
                raise EngineShutdownError("the server is shutting down; no new requests are accepted.")
            self._cmds.put(("add", request_id, prompt, prompt_token_ids, params, time.monotonic(), stream, priority))
        finished = False
        self.num_in_flight += 1
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self.num_in_flight -= 1
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown / finished ids are ignored)."""
        self._cmds.put(("abort", request_id))

    # ------------------------------------------------------------------------------------------- engine thread
    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, ids, params, arrival, stream, priority = cmd
            if self._stopping.is_set():
                stream.put(EngineShutdownError("the server is shutting down; no new requests are accepted."))
                return
            try:
                self.engine.add_request(rid, prompt, ids, params, arrival_time=arrival, priority=priority)
            except Exception as e:  # refused: fails this request only
                stream.put(e)
                return
            self._streams[rid] = stream
        elif kind == "abort":
            rid = cmd[1]
            if self._streams.pop(rid, None) is not None:
                self.num_aborted += 1
                try:
                    out = self.engine.abort_request(rid)
                except Exception:
                    logger.exception("abort of request %s failed", rid)
                    return
                if out is not None and self.on_finish is not None:  # counted as finished_reason "abort"
                    try:
                        self.on_finish(_snapshot(out))
                    except Exception:
                        logger.exception("on_finish callback failed")

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        self._handle(cmd)
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            self._handle(cmd)

    def _fail_running(self, exc: BaseException) -> None:
        """After a failed step: fail and abort every request with a running sequence; waiting ones stay."""
        self.num_step_failures += 1
        sched = self.engine.scheduler
        victims = {s.request_id for s in list(sched.running)}
        for rid in victims:
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("could not abort request %s after a failed step", rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                first = (str(exc).strip().splitlines() or [""])[0][:300]  # tracebacks stay in the server log
                stream.put(EngineStepError(f"the engine failed while running this request: "
                                           f"{type(exc).__name__}: {first}"))

    def _publish_stats(self) -> None:
        st = self.engine.get_stats()
        st["num_aborted"] = self.num_aborted
        st["num_step_failures"] = self.num_step_failures + st.get("step_failures_total", 0)
        with self._stats_lock:
            self._stats = st

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stopping.is_set():
                self._drain(block=not eng.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                if not eng.has_unfinished_requests():
                    self._publish_stats()
                    continue
                t0 = time.perf_counter()
                try:
                    outputs = eng.step()
                except Exception as e:
                    logger.exception("engine step failed; failing the running requests")
                    self._fail_running(e)
                    self._publish_stats()
                    continue
                dt = time.perf_counter() - t0
                self._publish_stats()
                self._hand_over(outputs)
                if self.on_step is not None:
                    try:
                        self.on_step([o for o in outputs if o.request_id in self._streams or o.finished],
                                     self.get_stats(), dt)
                    except Exception:
                        logger.exception("on_step callback failed")
        except BaseException as e:  # pragma: no cover - a bug in the loop itself
            self.dead_error = e
            logger.exception("engine loop died")
        finally:
            self._close(EngineShutdownError("the server is shutting down; the request was not finished."))

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        """Give a step's outputs to their streams: one batch per event loop (one wake-up per step, not one per
        request), after waiting (bounded by ``flush_timeout``) for the previous batch to be taken."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        interval = self.stream_interval
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if interval > 1 and not out.finished and out.error is None and stream.sent_tokens:
                ntok = sum(len(o.token_ids) for o in out.outputs)
                if ntok - stream.sent_tokens < interval:
                    continue
            snap = _snapshot(out)
            if interval > 1:
                stream.sent_tokens = sum(len(o.token_ids) for o in snap.outputs) or stream.sent_tokens
            if out.finished:
                self._streams.pop(out.request_id, None)
                if self.on_finish is not None:
                    try:
                        self.on_finish(snap)
                    except Exception:
                        logger.exception("on_finish callback failed")
            item = snap if out.error is None else EngineStepError(  # the engine failed this request alone
                f"the engine failed while running this request: {out.error}")
            batches.setdefault(stream.loop, []).append((stream, item))
        if not batches:
            return
        with self._flush_cond:
            pending, stalled = self._pending, self._stalled
            if pending:
                deadline = time.monotonic() + self.flush_timeout
                while any(n > 0 and lp not in stalled for lp, n in pending.items()):
                    left = deadline - time.monotonic()  # waiting releases the GIL: the loop writes its chunks now
                    if left <= 0 or not self._flush_cond.wait(left):
                        stalled.update(lp for lp, n in pending.items() if n > 0)  # busy elsewhere: merge, go on
                        break
            for loop, items in batches.items():
                try:
                    loop.call_soon_threadsafe(self._deliver, loop, items)
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    continue
                pending[loop] = pending.get(loop, 0) + 1

    def _deliver(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        """On the event loop: store a step's outputs in their streams; once the woken handlers have run (the
        callback queued after theirs), mark the batch taken."""
        for stream, item in items:
            stream.push(item)
        loop.call_soon(self._mark_flushed, loop)

    def _mark_flushed(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._flush_cond:
            n = self._pending.get(loop, 0) - 1
            if n > 0:
                self._pending[loop] = n
            else:
                self._pending.pop(loop, None)
                self._stalled.discard(loop)
            self._flush_cond.notify_all()

    def _close(self, err: BaseException) -> None:
        """The engine thread is ending: fail every in-flight and queued request with ``err``; later adds raise."""
        with self._cmds_lock:
            self._closed = True
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                pass
            stream.put(err)
        self._streams.clear()
        while True:  # requests queued but never added
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                cmd[6].put(err)
        with self._flush_cond:
            self._pending.clear()
            self._flush_cond.notify_all()
        self._publish_stats()
