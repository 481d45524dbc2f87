"""AsyncLLM: the bridge between asyncio request handlers and the (thread-unsafe) LLMEngine.

One background thread owns the :class:`~tokenfab.engine.engine.LLMEngine` (it builds it, see
:meth:`AsyncLLM.from_config`) and runs its step loop. Handlers never
touch the engine: they put commands (add / abort) on a thread-safe queue and read :class:`RequestOutput` objects
from a per-request :class:`asyncio.Queue`, filled from the engine thread with ``loop.call_soon_threadsafe``.

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
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

from tokenfab.outputs import RequestOutput
from tokenfab.sampling_params import SamplingParams

logger = logging.getLogger("tokenfab.server")


class EngineShutdownError(RuntimeError):
    """The server is shutting down: no new requests (HTTP 503)."""


class EngineStepError(RuntimeError):
    """An engine step failed while this request was running (HTTP 500); other requests are unaffected."""


@dataclass
class _Stream:
    """Per-request delivery channel: an asyncio queue on the server's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    finished: bool = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deliver from any thread (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


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

    Use :meth:`start` once, ``async for out in generate(...)`` per request, :meth:`shutdown` at the end.
    """

    def __init__(self, engine, on_step: Callable | None = None, on_finish: Callable | None = None):
        self.engine = engine
        self.tokenizer = self._private_tokenizer(engine.tokenizer)
        self.max_model_len: int = engine.max_model_len
        self.model_config = engine.model_config
        self.on_step = on_step
        self.on_finish = on_finish
        self._cmds: queue.Queue = queue.Queue()
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
            if owner is not None and not owner._stopping.is_set():
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

        Several engine steps may be merged into one yielded output when the consumer is slower than the engine
        (outputs are cumulative, so nothing is lost). If the consumer stops early (client disconnect, cancellation)
        the request is aborted and its KV blocks freed.

        Raises:
            EngineShutdownError: the server is shutting down.
            PromptTooLongError, ValueError: refused by the engine's ``add_request``.
            EngineStepError: an engine step failed while the request was running.
        """
        if not self.is_running:
            raise EngineShutdownError("the server is shutting down; no new requests are accepted.")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._cmds.put(("add", request_id, prompt, prompt_token_ids, params, time.monotonic(), stream, priority))
        finished = False
        self.num_in_flight += 1
        try:
            while True:
                try:
                    item = await asyncio.wait_for(stream.queue.get(), timeout=2.0)
                except asyncio.TimeoutError:
                    if self._thread is None or not self._thread.is_alive():  # added after the loop's last drain
                        finished = True
                        raise EngineShutdownError("the server is shutting down; the request was not finished.")
                    continue
                while not stream.queue.empty():  # coalesce: only the latest cumulative output matters
                    nxt = stream.queue.get_nowait()
                    if isinstance(item, BaseException):
                        break
                    item = nxt
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
                delivered = []
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    snap = _snapshot(out)
                    delivered.append(snap)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                        if self.on_finish is not None:
                            try:
                                self.on_finish(snap)
                            except Exception:
                                logger.exception("on_finish callback failed")
                    if out.error is not None:  # the engine failed this request alone
                        stream.put(EngineStepError(f"the engine failed while running this request: {out.error}"))
                        continue
                    stream.put(snap)
                self._publish_stats()
                if self.on_step is not None:
                    try:
                        self.on_step(delivered, self.get_stats(), dt)
                    except Exception:
                        logger.exception("on_step callback failed")
        except BaseException as e:  # pragma: no cover - a bug in the loop itself
            self.dead_error = e
            logger.exception("engine loop died")
        finally:
            err = EngineShutdownError("the server is shutting down; the request was not finished.")
            for rid, stream in list(self._streams.items()):
                try:
                    eng.abort_request(rid)
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
                    cmd[-1].put(err)
            self._publish_stats()
