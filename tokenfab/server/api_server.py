"""The OpenAI-compatible HTTP server (FastAPI): completions, chat, models, tokenize, health, metrics.

``build_app(async_llm, served_model_name)`` makes the app around a started :class:`AsyncLLM` (request handling
shared by the routes: :class:`tokenfab.server.serving.OpenAIServing`);
``run_server(args)`` (launch.py) builds the engine from ``tokenfab serve`` flags and runs uvicorn until interrupted.

Shapes follow OpenAI's API and vLLM's extensions (``ignore_eos``, ``min_tokens``, ``top_k``, ``stop_token_ids``,
``/tokenize``, ``/detokenize``, ``vllm:`` metric names). Errors are OpenAI's error JSON with the matching status:
400 (bad field, malformed JSON, prompt too long, no chat template), 404 (unknown model or path), 500 (engine
failure of this request only), 503 (shutting down).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenfab.errors import PromptTooLongError
from tokenfab.sampling_params import SamplingParams
from tokenfab.server.async_engine import AsyncLLM, EngineShutdownError, EngineStepError
from tokenfab.server.auth import add_api_key
from tokenfab.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from tokenfab.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeRequest,
    error_body,
)
from tokenfab.server.request_policy import RequestPolicy
from tokenfab.server.serving import OpenAIServing, bad_request
from tokenfab.server.tool_calls import (ToolCallStream, check_tools, output_tool_calls,
                                        resolve_tool_choice, tool_constraint)

logger = logging.getLogger("tokenfab.server")


def _version() -> str:
    try:
        from tokenfab import __version__
        return str(__version__)
    except ImportError:
        return "unknown"


def _err(e: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.type, e.param), status_code=e.status)


def _map_exception(e: BaseException) -> OpenAIError:
    """Engine / validation exceptions -> OpenAIError with the right status."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineShutdownError):
        return OpenAIError(503, str(e))
    if isinstance(e, PromptTooLongError):
        return OpenAIError(400, str(e), param="prompt")
    if isinstance(e, EngineStepError):
        return OpenAIError(500, str(e))
    if isinstance(e, ValueError):
        return OpenAIError(400, str(e), param=getattr(e, "param", None))
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}")


def _hold(params: SamplingParams) -> int:
    """Characters to keep unsent while streaming: a stop string may be forming in the last len(stop)-1 of them."""
    return max((len(x) for x in params.stop or []), default=1) - 1


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def build_app(async_llm: AsyncLLM, served_model_name: str, model_path: str | None = None,
              metrics: ServerMetrics | None = None, chat_template: str | None = None, api_key: str | None = None,
              policy: RequestPolicy | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving ``async_llm`` (already started) as ``served_model_name``.

    ``chat_template`` (template text) replaces the tokenizer's for /v1/chat/completions and /tokenize;
    ``api_key`` makes /v1/* need ``Authorization: Bearer KEY`` (server/auth.py); ``policy`` (default: from the
    engine's config) fills generation-config defaults, enforces max_logprobs and logs requests;
    ``tool_call_parser`` (``--enable-auto-tool-choice --tool-call-parser``: "hermes") enables tool_choice "auto".

    Hooks a :class:`ServerMetrics` into the engine thread's callbacks unless they are already set.
    ``app.state.shutting_down = True`` makes new requests fail with 503.
    """
    app = FastAPI(title="tokenfab OpenAI-compatible server", version=_version())
    serving = OpenAIServing(async_llm, served_model_name, model_path)
    if chat_template is not None and serving.tokenizer is not None:
        serving.tokenizer.chat_template = chat_template  # the handlers' own tokenizer copy (AsyncLLM)
    policy = policy or RequestPolicy.from_async_llm(async_llm)
    add_api_key(app, api_key)
    metrics = metrics or ServerMetrics(served_model_name)
    if async_llm.on_step is None:
        async_llm.on_step = metrics.on_step
    if async_llm.on_finish is None:
        async_llm.on_finish = metrics.on_finish
    app.state.async_llm = async_llm
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.shutting_down = False

    # ------------------------------------------------------------------------------------------- errors
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        parts, param = [], None
        for e in errs[:5]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            field = ".".join(loc) or "body"
            if e.get("type") == "json_invalid":
                parts.append(f"malformed JSON body: {e.get('msg')} ({e.get('ctx', {}).get('error', '')})".strip())
            else:
                param = param or (loc[0] if loc else None)
                parts.append(f"{field}: {e.get('msg')}")
        ctype = request.headers.get("content-type", "")
        if "json" not in ctype.lower():  # e.g. curl -d without -H: FastAPI then sees a string, not an object
            parts.append(f"send the body as JSON with the header Content-Type: application/json "
                         f"(got {ctype or 'no Content-Type'})")
        return JSONResponse(error_body(400, "; ".join(parts) or "invalid request", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            msg = f"{request.url.path}: not found"
        return JSONResponse(error_body(exc.status_code, msg), status_code=exc.status_code)

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError):
        return _err(exc)

    def _check_live() -> None:
        if app.state.shutting_down or not async_llm.is_running:
            raise OpenAIError(503, "the server is shutting down; no new requests are accepted.")

    # ------------------------------------------------------------------------------------------- plain
    @app.get("/health")
    async def health():
        # the reason first: a server exiting because a rank died keeps naming it until it is gone (launch.py)
        reason = async_llm.health_error()
        if reason:
            return JSONResponse(error_body(503, f"the engine cannot serve: {reason}"), status_code=503)
        if app.state.shutting_down or not async_llm.is_running:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/v1/models")
    async def models():
        root = os.path.abspath(model_path) if model_path and os.path.exists(model_path) else model_path
        card = ModelCard(id=served_model_name, root=root or served_model_name,  # absolute: clients elsewhere read it
                         max_model_len=async_llm.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(async_llm.get_stats()), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if serving.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer (no tokenizer files in its folder).", param="prompt")
        if req.messages is not None:
            _, ids = await serving.chat_prompt(req.messages, req.add_generation_prompt, check_length=False)
        elif req.prompt is not None:
            ids = await serving.tokenize(req.prompt, req.add_special_tokens, field=None)
        else:
            raise OpenAIError(400, "give either prompt or messages.", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": async_llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        if serving.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer.")
        if req.tokens:
            serving.check_ids(req.tokens, "tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens)}

    # ------------------------------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        _check_live()
        serving.check_model(req.model)
        if req.suffix:
            raise OpenAIError(400, "suffix is not supported.", param="suffix")
        if req.best_of not in (None, req.n):
            raise OpenAIError(400, "best_of other than n is not supported.", param="best_of")
        prompts = await serving.completion_prompts(req)
        if len(prompts) > 1 or (req.echo and req.logprobs is not None):
            return await _completions_all(req, raw, prompts)
        prompt, ids = prompts[0]
        policy.fill_defaults(req, len(ids))
        max_tokens = serving.check_length(len(ids), req.max_tokens)
        params = serving.sampling_params(req, max_tokens, req.logprobs)
        priority = serving.priority(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        policy.admit(rid, prompt, ids, params)
        created = int(time.time())
        model = req.model or served_model_name
        echo_text = _echo_text(prompt, ids) if req.echo else ""
        gen = async_llm.generate(rid, prompt, ids, params, priority)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream_completion(gen, rid, created, model, req.n, echo_text, include_usage,
                                                        req.logprobs is not None, _hold(params)),
                                     media_type="text/event-stream")
        out = await _collect(gen, raw)
        choices = []
        for o in out.outputs:
            lp = serving.completion_logprobs(o.token_ids, o.logprobs, 0) if req.logprobs is not None else None
            choices.append({"index": o.index, "text": echo_text + o.text, "logprobs": lp,
                            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": serving.usage(out)}

    def _echo_text(prompt, ids) -> str:
        """The prompt text an echo request gets back (no tokenizer: token ids only, the text stays empty)."""
        if prompt is not None:
            return prompt
        return serving.tokenizer.decode(ids) if serving.tokenizer is not None else ""

    async def _collect(gen, raw: Request):
        """Run a non-streamed request to its end; engine exceptions become the matching OpenAIError."""
        try:
            return await serving.collect(gen, raw)
        except OpenAIError:
            raise
        except Exception as e:
            raise _map_exception(e) from None

    async def _completions_all(req: CompletionRequest, raw: Request, prompts: list) -> dict:
        """A non-streamed completion of several prompts, or of one with echo + logprobs (lm-eval's
        log-likelihood request: the prompt positions' logprobs come from the engine's prompt_logprobs, with top
        ``logprobs`` alternatives each). All prompts run concurrently in the engine's batch; choice ``index`` is
        prompt index x n + sample index (OpenAI's order); usage sums over the prompts."""
        if req.stream:
            raise OpenAIError(400, "stream=true is not supported with a list of prompts or with echo and logprobs; "
                                   "send stream=false, or one prompt per request.", param="stream")
        scoring = req.echo and req.logprobs is not None
        priority = serving.priority(req)
        policy.fill_defaults(req, max(len(ids) for _, ids in prompts))
        runs = []
        for prompt, ids in prompts:
            params = serving.sampling_params(req, serving.check_length(len(ids), req.max_tokens), req.logprobs)
            if scoring:
                params.prompt_logprobs = req.logprobs
            rid = f"cmpl-{uuid.uuid4().hex}"
            policy.admit(rid, prompt, ids, params)
            runs.append((rid, prompt, ids, params))
        results = await asyncio.gather(*(serving.collect(async_llm.generate(rid, prompt, ids, params, priority),
                                                         raw) for rid, prompt, ids, params in runs),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, OpenAIError):
                raise r
            if isinstance(r, BaseException):
                raise _map_exception(r) from None
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for pi, ((rid, prompt, ids, params), out) in enumerate(zip(runs, results)):
            echo_text = _echo_text(prompt, ids) if req.echo else ""
            for o in out.outputs:
                lp = None
                if scoring:
                    lp = serving.echo_logprobs(ids, out.prompt_logprobs, o.token_ids, o.logprobs)
                elif req.logprobs is not None:
                    lp = serving.completion_logprobs(o.token_ids, o.logprobs, len(echo_text))
                choices.append({"index": pi * req.n + o.index, "text": echo_text + o.text, "logprobs": lp,
                                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
            for k, v in serving.usage(out).items():
                usage[k] += v
        return {"id": runs[0][0], "object": "text_completion", "created": int(time.time()),
                "model": req.model or served_model_name, "choices": choices, "usage": usage}

    async def _stream_completion(gen, rid, created, model, n, echo_text, include_usage, want_lp, hold):
        """SSE chunks of a completion; ``hold`` characters stay unsent until the end (a stop string may be
        forming there and would be cut from the final text)."""
        sent_text = [""] * n
        sent_tok = [0] * n
        done = [False] * n
        echoed = [not echo_text] * n
        last = None
        try:
            async for out in gen:
                last = out
                for o in out.outputs:
                    i = o.index
                    if done[i]:
                        continue
                    delta, end = _text_delta(o, sent_text[i], hold)
                    if not delta and o.finish_reason is None:
                        continue
                    new_ids = o.token_ids[sent_tok[i]:]
                    lp = None
                    if want_lp:
                        lp = serving.completion_logprobs(new_ids, o.logprobs[sent_tok[i]:],
                                                         len(sent_text[i]) + len(echo_text))
                    text = delta
                    if not echoed[i]:
                        text, echoed[i] = echo_text + delta, True
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": i, "text": text, "logprobs": lp,
                                          "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}]}
                    sent_text[i], sent_tok[i] = o.text[:end], len(o.token_ids)
                    done[i] = o.finish_reason is not None
                    yield _sse(chunk)
            if include_usage and last is not None:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": serving.usage(last)})
        except Exception as e:
            err = _map_exception(e)
            yield _sse(error_body(err.status, err.message, err.type, err.param))
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        _check_live()
        serving.check_model(req.model)
        try:  # tools go to the template; tool_choice named / "required" becomes the output constraint
            tools = check_tools(req.tools) if req.tools is not None else None
            tool_choice = resolve_tool_choice(tools, req.tool_choice, tool_call_parser)
            constraint = tool_constraint(tools, tool_choice)
        except ValueError as e:
            raise bad_request(e) from None
        chat_text, ids = await serving.chat_prompt(req.messages, req.add_generation_prompt,
                                                   req.continue_final_message, req.chat_template_kwargs, tools)
        policy.fill_defaults(req, len(ids))
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        want = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = serving.check_length(len(ids), want, field)
        k = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        params = serving.sampling_params(req, max_tokens, k, constraint)
        priority = serving.priority(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        policy.admit(rid, chat_text, ids, params, "top_logprobs")
        created = int(time.time())
        model = req.model or served_model_name
        gen = async_llm.generate(rid, None, ids, params, priority)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream_chat(gen, rid, created, model, req.n, include_usage, k, _hold(params),
                                                  tool_choice), media_type="text/event-stream")
        out = await _collect(gen, raw)
        choices = []
        for o in out.outputs:
            lp = serving.chat_logprobs(o.token_ids, o.logprobs, k) if k is not None else None
            message, finish = {"role": "assistant", "content": o.text}, o.finish_reason
            if tool_choice.mode != "none":
                content, calls = output_tool_calls(o.text, tool_choice, o.finish_reason)
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if calls else finish
            choices.append({"index": o.index, "message": message, "logprobs": lp, "finish_reason": finish,
                            "stop_reason": o.stop_reason})
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": serving.usage(out)}

    async def _stream_chat(gen, rid, created, model, n, include_usage, k, hold, tool_choice=None):
        """SSE chunks of a chat completion (the role chunk first, sent with the first output); ``hold`` as in
        _stream_completion; with a ``tool_choice`` other than "none" the text goes out as tool-call deltas
        (server/tool_calls.py ToolCallStream)."""
        tools_on = tool_choice is not None and tool_choice.mode != "none"
        streams = [ToolCallStream(tool_choice) for _ in range(n)] if tools_on else None
        sent_text = [""] * n
        sent_tok = [0] * n
        done = [False] * n

        def chunk(choices):
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": choices})

        last = None
        try:
            async for out in gen:
                if last is None:  # the role chunk goes out with the first output, as vLLM's (so clients time TTFT)
                    for i in range(n):
                        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}])
                last = out
                for o in out.outputs:
                    i = o.index
                    if done[i]:
                        continue
                    delta, end = _text_delta(o, sent_text[i], hold)
                    if not delta and o.finish_reason is None:
                        continue
                    lp = None
                    if k is not None:
                        lp = serving.chat_logprobs(o.token_ids[sent_tok[i]:], o.logprobs[sent_tok[i]:], k)
                    d = {"content": delta} if delta else {}
                    finish = o.finish_reason
                    if streams is not None:
                        d, finish = streams[i].delta(delta, o.finish_reason)
                        if not d and finish is None:
                            sent_text[i], sent_tok[i] = o.text[:end], len(o.token_ids)
                            continue
                    sent_text[i], sent_tok[i] = o.text[:end], len(o.token_ids)
                    done[i] = o.finish_reason is not None
                    yield chunk([{"index": i, "delta": d, "logprobs": lp, "finish_reason": finish,
                                  "stop_reason": o.stop_reason}])
            if include_usage and last is not None:
                yield chunk_usage(rid, created, model, serving.usage(last))
        except Exception as e:
            err = _map_exception(e)
            yield _sse(error_body(err.status, err.message, err.type, err.param))
        yield "data: [DONE]\n\n"

    def chunk_usage(rid, created, model, usage):
        return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [], "usage": usage})

    return app


def _text_delta(o, sent: str, hold: int) -> tuple[str, int]:
    """Text of CompletionOutput ``o`` not yet streamed (``sent`` went out already) and the new end offset.

    While the sequence runs, the last ``hold`` characters stay back (they may begin a stop string)."""
    end = len(o.text) if o.finish_reason is not None else max(len(sent), len(o.text) - hold)
    return o.text[len(sent):end], end
