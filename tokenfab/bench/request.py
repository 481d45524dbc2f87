"""One streamed request to an OpenAI-compatible server -> one :class:`RequestRecord`.

Works against vLLM, llama.cpp's llama-server, tokenfab and any server speaking the OpenAI streaming protocol
(server-sent events, ``data: {json}`` lines, ``data: [DONE]`` at the end). The payload follows vLLM's benchmark
client (vllm/benchmarks/lib/endpoint_request_func.py): ``stream: true``, ``stream_options.include_usage``,
``max_tokens`` and vLLM's extension fields (``ignore_eos``, ``top_k``) in the JSON body. Backends take vLLM's names:
``vllm`` and ``openai`` stream ``/v1/completions`` (``prompt``), ``openai-chat`` streams ``/v1/chat/completions``
(one user message; the text is read from each chunk's ``delta.content``, so TTFT / ITL / TPOT are timed on the chat
deltas exactly as on completion chunks).

Timing (all ``time.perf_counter()`` seconds):

- ``send_time``: just before the request is written;
- ``first_token_time``: arrival of the first chunk carrying non-empty generated text  -> ``ttft``;
- each later non-empty text chunk appends ``arrival - previous arrival`` to ``itl``;
- ``last_token_time``: arrival of the last non-empty text chunk -> ``latency`` (E2EL) = last - send;
- ``end_time``: the stream closed (the request stops occupying a concurrency slot).

A request never raises: HTTP errors, bad JSON, timeouts and refused connections give ``success=False`` and a
one-line ``error``.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

BACKENDS = ("vllm", "openai", "openai-chat")
DEFAULT_ENDPOINTS = {"vllm": "/v1/completions", "openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
# The URL suffix each backend's API needs (vLLM's check in vllm/benchmarks/lib/endpoint_request_func.py).
ENDPOINT_SUFFIXES = {"vllm": "completions", "openai": "completions", "openai-chat": "chat/completions"}


@dataclass
class RequestInput:
    """What to send.

    Attributes:
        api_url: full URL, e.g. ``http://127.0.0.1:8000/v1/completions``.
        model: the ``model`` field of the request (``--served-model-name`` or ``--model``).
        prompt: prompt text (sent as ``prompt``, or as one user message for chat).
        prompt_len: prompt length in tokens by the benchmark tokenizer.
        output_len: ``max_tokens`` (tokens).
        ignore_eos: ask the server to keep generating past EOS (vLLM / llama-server extension).
        sampling: extra body fields (temperature, top_p, top_k, penalties, ``--extra-body``), None-valued ones
            left out.
        headers: extra HTTP headers (``--header KEY=VALUE``).
        request_id: sent as the ``x-request-id`` header when set (vLLM's ``--request-id-prefix`` + index).
        logprobs: the completions ``logprobs`` field (``--logprobs``), left out when None.
    """

    api_url: str
    model: str
    prompt: str
    prompt_len: int
    output_len: int
    ignore_eos: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    request_id: str | None = None
    logprobs: int | None = None


@dataclass
class RequestRecord:
    """The outcome of one request. Times are ``time.perf_counter()`` seconds; durations are seconds.

    Attributes:
        success: the stream finished and carried at least one non-empty text chunk.
        prompt_len: prompt tokens (the server's ``usage.prompt_tokens`` when reported, else the dataset's count).
        output_tokens: ``usage.completion_tokens`` from the server, or None when it sent no usage
            (the metrics then count tokens of ``generated_text`` with the tokenizer).
        ttft: first_token_time - send_time (s).
        itl: gaps between consecutive non-empty text chunks (s); ``len(itl) == chunks - 1``.
        latency: E2EL = last_token_time - send_time (s).
        generated_text: concatenated text of all chunks.
        error: one-line error ("" on success).
        send_time, first_token_time, last_token_time, end_time: perf_counter timestamps (s); 0.0 when unknown.
        chunk_times: arrival time of each non-empty text chunk, relative to send_time (s).
        expected_output_len: the requested ``max_tokens``.
        dataset_prompt_len: the dataset's prompt length (tokens), kept even when the server reports its own.
    """

    success: bool = False
    prompt_len: int = 0
    output_tokens: int | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""
    error: str = ""
    send_time: float = 0.0
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    end_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    expected_output_len: int = 0
    dataset_prompt_len: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serializable)."""
        return asdict(self)


def build_payload(backend: str, inp: RequestInput) -> dict[str, Any]:
    """The JSON body for ``backend`` ("vllm" / "openai" -> /v1/completions, "openai-chat" -> /v1/chat/completions).

    Both carry ``stream``, ``stream_options.include_usage``, ``max_tokens`` and, when asked, ``ignore_eos``; chat
    also sends ``max_completion_tokens`` (the newer OpenAI name; servers accept one or the other), completions
    ``logprobs`` when set.

    Raises:
        ValueError: an unknown backend.
    """
    body: dict[str, Any] = {"model": inp.model}
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": inp.prompt}]
        body["max_completion_tokens"] = inp.output_len
    elif backend in ("vllm", "openai"):
        body["prompt"] = inp.prompt
        if inp.logprobs is not None:
            body["logprobs"] = inp.logprobs
    else:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    body["max_tokens"] = inp.output_len
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if inp.ignore_eos:
        body["ignore_eos"] = True
    body.update({k: v for k, v in inp.sampling.items() if v is not None})
    return body


def _chunk_text(backend: str, choice: dict[str, Any]) -> str:
    if backend == "openai-chat":
        delta = choice.get("delta") or {}
        return delta.get("content") or ""
    return choice.get("text") or ""


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_text(exc: BaseException) -> str:
    msg = str(exc) or repr(exc)
    return _one_line(f"{type(exc).__name__}: {msg}")


async def send_request(client: Any, backend: str, inp: RequestInput, pbar: Any = None) -> RequestRecord:
    """Send one streamed request with ``client`` (an ``httpx.AsyncClient``) and time every chunk.

    Returns a :class:`RequestRecord`; never raises for server or network failures. ``pbar`` (tqdm) is advanced
    by one when the request ends, successful or not.
    """
    payload = build_payload(backend, inp)
    headers = {"Content-Type": "application/json", **inp.headers}
    if inp.request_id:
        headers["x-request-id"] = inp.request_id
    rec = RequestRecord(prompt_len=inp.prompt_len, dataset_prompt_len=inp.prompt_len,
                        expected_output_len=inp.output_len)
    text_parts: list[str] = []
    first: float | None = None
    last = 0.0
    send = time.perf_counter()
    rec.send_time = send
    try:
        async with client.stream("POST", inp.api_url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.error = _one_line(f"HTTP {resp.status_code} {resp.reason_phrase}: {body}")
            else:
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    line = line.strip()
                    if not line or line.startswith(":"):  # keep-alive / SSE comment
                        continue
                    if line.startswith("data:"):
                        data_str = line[5:].strip()
                    elif line.startswith("error:"):  # some servers send an SSE "error:" field
                        rec.error = _one_line(line)
                        break
                    else:
                        continue  # "event:", "id:" ... fields carry no payload we use
                    if data_str == "[DONE]":
                        break
                    data = json.loads(data_str)
                    if data.get("error"):
                        rec.error = _one_line(f"server error: {json.dumps(data['error'])}")
                        break
                    for choice in data.get("choices") or []:
                        text = _chunk_text(backend, choice)
                        if not text:
                            continue
                        if first is None:
                            first = now
                        else:
                            rec.itl.append(now - last)
                        last = now
                        rec.chunk_times.append(now - send)
                        text_parts.append(text)
                    usage = data.get("usage")
                    if usage:
                        if usage.get("completion_tokens") is not None:
                            rec.output_tokens = int(usage["completion_tokens"])
                        if usage.get("prompt_tokens"):
                            rec.prompt_len = int(usage["prompt_tokens"])
    except Exception as e:  # network errors, timeouts, bad JSON: record, never crash the run
        rec.error = _error_text(e)
    rec.end_time = time.perf_counter()
    rec.generated_text = "".join(text_parts)
    if first is not None:
        rec.first_token_time = first
        rec.last_token_time = last
        rec.ttft = first - send
        rec.latency = last - send
    if not rec.error and first is None:
        rec.error = "the stream ended without any generated text (no chunk to time TTFT from)"
    rec.success = not rec.error
    if pbar is not None:
        pbar.update(1)
    return rec
