"""Running the server: ``tokenfab serve`` flags -> engine + FastAPI app under uvicorn, an in-thread handle for tests
and the demo, and the serving thread policy."""
from __future__ import annotations

import argparse
import sys
import time

from fastapi import FastAPI

from tokenfab.server.api_server import build_app
from tokenfab.server.async_engine import AsyncLLM
from tokenfab.server.auth import resolve_api_key
from tokenfab.server.request_policy import RequestPolicy, request_logger


SERVE_CPU_MAX_NUM_BATCHED_TOKENS = 2048  # tokens per step for `tokenfab serve` on CPU (vLLM's CPU server default)


def model_arg(args: argparse.Namespace) -> str | None:
    """The MODEL of ``tokenfab serve``: the positional one or ``--model`` (as vLLM allows either).

    Raises:
        EngineConfigError: both are given and differ.
    """
    from tokenfab.errors import EngineConfigError
    pos, flag = getattr(args, "model", None), getattr(args, "model_flag", None)
    if pos and flag and pos != flag:
        raise EngineConfigError(f"the model is given twice ('{pos}' as MODEL and '{flag}' as --model); give one.")
    return pos or flag


def engine_config_from_args(args: argparse.Namespace):
    """``tokenfab serve`` flags -> EngineConfig (model defaults to the embedded default model)."""
    from tokenfab.engine.engine_config import EngineConfig, resolve_device

    from tokenfab.default_model import default_describe, resolve_model
    given = model_arg(args)
    model = resolve_model(given or None)  # None -> the default model; *.gguf -> served packed
    if not given:
        print(f"[tokenfab] model: {default_describe()}", flush=True)
    budget = args.max_num_batched_tokens
    if budget is None:  # CPU: vLLM's CPU server default; shorter steps let new prompts in sooner (NOTES.md)
        on_cpu = resolve_device(args.device).type == "cpu"
        budget = SERVE_CPU_MAX_NUM_BATCHED_TOKENS if on_cpu else EngineConfig.max_num_batched_tokens
    return EngineConfig(model=model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        kv_cache_memory=args.kv_cache_memory,
                        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"), seed=args.seed,
                        tensor_parallel_size=args.tensor_parallel_size,
                        enforce_eager=getattr(args, "enforce_eager", False),
                        async_scheduling=getattr(args, "async_scheduling", None),
                        tokenizer=getattr(args, "tokenizer", None),
                        trust_remote_code=getattr(args, "trust_remote_code", False),
                        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
                        quantization=getattr(args, "quantization", None),
                        enable_prefix_caching=bool(getattr(args, "enable_prefix_caching", False)),
                        generation_config=getattr(args, "generation_config", "auto"),
                        max_logprobs=getattr(args, "max_logprobs", 20),
                        speculative_config=getattr(args, "speculative_config", None),
                        host_experts=getattr(args, "host_experts", None),
                        num_device_experts=getattr(args, "num_device_experts", None),
                        expert_popularity=getattr(args, "expert_popularity", None),
                        host_expert_threads=getattr(args, "host_expert_threads", None),
                        record_expert_popularity=getattr(args, "record_expert_popularity", None),
                        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
                        batch_invariant=bool(getattr(args, "batch_invariant", False)),
                        load_format=getattr(args, "load_format", "auto"))


class PortInUseError(OSError):
    """``tokenfab serve``'s host:port cannot be bound (checked before the model loads)."""


def bind_listen_socket(host: str, port: int):
    """Bind ``host:port`` now, before any weight is read, and return the socket (uvicorn serves on it later).

    Raises:
        PortInUseError: the address is taken or cannot be bound (the message names --port / --host).
    """
    import socket

    from tokenfab.errors import EngineConfigError
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise EngineConfigError(f"--host {host}: cannot resolve the address ({e}).") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT leftovers are fine
    try:
        sock.bind(addr)
        sock.listen(2048)  # with SO_REUSEADDR two binds can both succeed: a held port only shows at listen()
    except OSError as e:
        import errno
        sock.close()
        why = ("another process holds the port; stop it or choose another with --port" if e.errno == errno.EADDRINUSE
               else "choose another --port or --host")
        raise PortInUseError(f"cannot listen on {host}:{port} ({e.strerror or e}): {why} (the model was not "
                             "loaded).") from None
    return sock


class ServerHandle:
    """A uvicorn server running ``app`` on a background thread (tests, ``tokenfab demo``).

    ``port`` is the bound port (pass 0 to pick a free one). :meth:`stop` shuts uvicorn and the engine down.
    """

    def __init__(self, app: FastAPI, async_llm: AsyncLLM, host: str = "127.0.0.1", port: int = 0):
        import socket
        import threading

        import uvicorn

        self.app, self.async_llm, self.host = app, async_llm, host
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="tokenfab-http", daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.app.state.shutting_down = True
        self.async_llm.shutdown()
        self.server.should_exit = True
        self.thread.join(15)
        try:
            self.sock.close()
        except OSError:
            pass


def set_server_threads(num_threads: int | None, config) -> tuple[int, int] | None:
    """Choose torch's intra-op threads for a serving process on one CPU rank; returns (prefill, decode) threads
    for :meth:`ModelRunner.set_thread_policy`, or None under tensor parallel (the launcher splits the cores).

    ``num_threads`` given: that many for every step. Default: every core for every step. (Until the engine was
    built on its own thread, decode steps lost to a second OpenMP pool and cores - 1 threads looked better for MoE
    decode; with one pool, 2 decode threads beat 1 on both models: DeepSeek-V3 256 in / 64 out, concurrency 4 / 16,
    1.2x / 1.15x the total tok/s, benchmarks/NOTES.md entry 18.)

    Raises:
        ValueError: ``num_threads`` < 1.
    """
    import os

    import torch
    if num_threads is None:
        if config.tensor_parallel_size > 1:
            return None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        policy = (cores, cores)
    elif num_threads < 1:
        raise ValueError(f"--num-threads must be >= 1, got {num_threads}.")
    else:
        policy = (num_threads, num_threads)
    torch.set_num_threads(policy[0])  # read by the engine thread when it starts (it builds the engine)
    return policy


def _log_requests_to_stdout() -> None:
    """Send the ``tokenfab.requests`` lines to stdout, once: INFO (id, lengths, parameters), or DEBUG as well (the
    prompts) when ``TOKENFAB_LOGGING_LEVEL=DEBUG``.

    Raises:
        EngineConfigError: TOKENFAB_LOGGING_LEVEL is not a logging level name.
    """
    import logging
    import os

    from tokenfab.errors import EngineConfigError
    name = os.environ.get("TOKENFAB_LOGGING_LEVEL", "INFO").upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise EngineConfigError(f"TOKENFAB_LOGGING_LEVEL must be DEBUG, INFO, WARNING or ERROR, got {name!r}.")
    if not any(getattr(h, "_tokenfab_requests", False) for h in request_logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [requests] %(message)s", "%m-%d %H:%M:%S"))
        handler._tokenfab_requests = True
        request_logger.addHandler(handler)
    request_logger.setLevel(level)
    request_logger.propagate = False


def drain_seconds() -> float:
    """Seconds in-flight requests may keep running after SIGTERM / Ctrl-C before they are ended with an error
    (``TOKENFAB_DRAIN_SECONDS``, default 5)."""
    import os

    from tokenfab.errors import EngineConfigError
    raw = os.environ.get("TOKENFAB_DRAIN_SECONDS", "5")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise EngineConfigError(f"TOKENFAB_DRAIN_SECONDS must be a number of seconds >= 0, got {raw!r}.")
    return value


def run_server(args: argparse.Namespace) -> int:
    """Build the engine from ``tokenfab serve`` flags and serve until Ctrl-C / SIGTERM; shuts down cleanly."""
    import uvicorn

    drain = drain_seconds()  # bad settings fail before the model loads: this, the flags below, a busy port
    args.model = model_arg(args)
    api_key = resolve_api_key(getattr(args, "api_key", None))
    chat_template = None
    if getattr(args, "chat_template", None) is not None:
        from tokenfab.entrypoints.chat_template import load_chat_template
        from tokenfab.errors import EngineConfigError
        try:
            chat_template = load_chat_template(args.chat_template)
        except ValueError as e:
            raise EngineConfigError(f"--chat-template: {e}") from None
    log_requests = bool(getattr(args, "enable_log_requests", False))  # --disable-log-requests: accepted, no-op
    if log_requests:
        _log_requests_to_stdout()
    stream_interval = getattr(args, "stream_interval", 1)
    if stream_interval < 1:
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError(f"--stream-interval must be >= 1 (tokens per streamed chunk), got {stream_interval}.")
    parser = getattr(args, "tool_call_parser", None)
    if getattr(args, "enable_auto_tool_choice", False) and parser is None:
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError("--enable-auto-tool-choice needs --tool-call-parser (hermes).")
    tool_call_parser = parser if getattr(args, "enable_auto_tool_choice", False) else None
    try:
        sock = bind_listen_socket(args.host, args.port)
    except PortInUseError as e:
        print(f"tokenfab serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        config = engine_config_from_args(args)
        threads = set_server_threads(getattr(args, "num_threads", None), config)
        t0 = time.perf_counter()
        async_llm = AsyncLLM.from_config(config, progress=True, stream_interval=stream_interval)
    except BaseException:
        sock.close()
        raise
    if chat_template is not None and async_llm.tokenizer is None:
        sock.close()
        async_llm.shutdown()
        from tokenfab.errors import EngineConfigError
        raise EngineConfigError("--chat-template: this model folder has no tokenizer (give one with --tokenizer).")
    if threads is not None:
        async_llm.engine.runner.set_thread_policy(*threads)
    async_llm.start()
    name = args.served_model_name or args.model  # vLLM's default: the model path as given
    if not name:  # the default model: its short name, not a cache path
        from tokenfab.default_model import default_model_name
        name = default_model_name()
    policy = RequestPolicy.from_async_llm(async_llm, log_requests, getattr(args, "max_log_len", None))
    app = build_app(async_llm, name, config.model, chat_template=chat_template, api_key=api_key, policy=policy,
                    tool_call_parser=tool_call_parser)
    # the first constrained request skips the import; joined before exit (below)
    warm_up = async_llm.engine.grammar_compiler.warm_up_in_background()
    if policy.defaults:
        print(f"[tokenfab] default sampling settings from generation_config ({config.generation_config}): "
              f"{policy.defaults} (for fields a request leaves unset; --generation-config vllm ignores them)",
              flush=True)

    dtype = str(async_llm.engine.dtype).replace("torch.", "")
    kv_dtype = str(async_llm.engine.kv_dtype).replace("torch.", "")
    print(f"[tokenfab] engine ready in {time.perf_counter() - t0:.1f} s: model {config.model} as '{name}', "
          f"dtype {dtype}{' (auto)' if config.dtype == 'auto' else ''}, max_model_len {config.max_model_len}, "
          f"{config.num_kv_blocks} KV blocks of {config.block_size} tokens ({kv_dtype}), "
          f"max_num_seqs {config.max_num_seqs}, tensor_parallel_size {config.tensor_parallel_size}, "
          f"CPU threads {'per rank: launcher' if threads is None else f'prefill {threads[0]} / decode {threads[1]}'}",
          flush=True)
    print(f"[tokenfab] serving on http://{args.host}:{args.port} (OpenAI API under /v1"
          + (", API key required" if api_key else "") + ")", flush=True)
    import signal
    import threading

    exit_code = [0]

    class _Server(uvicorn.Server):
        """uvicorn with a drain: the first SIGTERM / Ctrl-C makes new requests get 503 (OpenAI error JSON) while the
        listener stays open and in-flight requests run on; once none is left, or after ``drain`` seconds (then the
        rest end with an error event and ``[DONE]``), uvicorn shuts down. A second signal stops at once."""

        draining = False

        def handle_exit(self, sig, frame):
            app.state.shutting_down = True
            if self.draining or self.should_exit:
                async_llm.request_stop()
                super().handle_exit(sig, frame)
                return
            self.draining = True
            n = async_llm.num_in_flight
            print("[tokenfab] stopping" + (f": {n} in-flight request(s) may finish within {drain:g} s, new ones get "
                                           "503" if n else ""), flush=True)
            threading.Thread(target=self.drain_then_exit, name="tokenfab-drain", daemon=True).start()

        def drain_then_exit(self):
            deadline = time.monotonic() + drain
            while async_llm.num_in_flight > 0 and time.monotonic() < deadline and not self.should_exit:
                time.sleep(0.05)
            left = async_llm.num_in_flight
            if left:
                print(f"[tokenfab] {left} request(s) still running after {drain:g} s: ending them with an error",
                      flush=True)
                async_llm.request_stop()
                end = time.monotonic() + 5
                while async_llm.num_in_flight > 0 and time.monotonic() < end:
                    time.sleep(0.05)
            self.should_exit = True

    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=drain + 10,
                                    log_level=getattr(args, "log_level", None) or "warning"))

    def watch_health():
        # A tensor-parallel worker that died (or an engine thread that stopped) cannot be recovered: /health
        # already answers 503 with the reason; the process exits with status 1 instead of hanging on.
        while not server.should_exit and not server.draining:
            reason = async_llm.health_error()
            if reason:
                print(f"[tokenfab] the engine cannot serve: {reason}; exiting", file=sys.stderr, flush=True)
                exit_code[0] = 1
                app.state.shutting_down = True
                time.sleep(1.0)  # /health keeps answering 503 with the reason meanwhile
                async_llm.request_stop()
                server.should_exit = True
                return
            time.sleep(0.5)

    threading.Thread(target=watch_health, name="tokenfab-health", daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises SIGTERM after its graceful shutdown; with the default handler that kills the process
        # before the engine (and tensor-parallel workers) are shut down below. Make it a normal exit instead.
        def _exit_cleanly(signum, frame):
            raise SystemExit(exit_code[0])

        signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        app.state.shutting_down = True
        async_llm.shutdown()
        # A process that exits while the (low-priority) warm-up thread is still inside xgrammar's C++ aborts with
        # "terminate called without an active exception" (seen when SIGTERM came right after start on a loaded
        # machine): wait for it.
        warm_up.join(60)
        print("[tokenfab] server stopped", flush=True)
    app.state.shutting_down = True
    return exit_code[0]
