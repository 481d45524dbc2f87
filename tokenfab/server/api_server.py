"""The OpenAI-compatible HTTP server (FastAPI): completions, chat, models, tokenize, health, metrics.

``build_app(async_llm, served_model_name)`` makes the app around a started :class:`AsyncLLM`;
``run_server(args)`` builds the engine from ``tokenfab serve`` flags and runs uvicorn until interrupted.

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
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenfab.engine.scheduling_policy import check_priority
from tokenfab.errors import PromptTooLongError
from tokenfab.outputs import RequestOutput
from tokenfab.request_validation import check_token_ids
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
from tokenfab.server.structured_request import request_structured_outputs
from tokenfab.server.tool_calls import (ToolCallStream, check_tools, message_tool_fields, output_tool_calls,
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


def bad_request(e: ValueError) -> OpenAIError:
    """A 400 for a refused field: ``param`` from an InvalidRequestError, else the message's first word (the
    checks start their messages with the field name)."""
    msg = str(e)
    return OpenAIError(400, msg, param=getattr(e, "param", None) or msg.split(" ", 1)[0])


def _hold(params: SamplingParams) -> int:
    """Characters to keep unsent while streaming: a stop string may be forming in the last len(stop)-1 of them."""
    return max((len(x) for x in params.stop or []), default=1) - 1


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServing:
    """Request handling shared by the endpoints: validation, prompt building, sampling params, response shapes.

    Args:
        async_llm: a started AsyncLLM.
        served_model_name: the name clients send in ``model`` (the model path is accepted too).
        model_path: the checkpoint folder (``root`` in /v1/models).
    """

    def __init__(self, async_llm: AsyncLLM, served_model_name: str, model_path: str | None = None):
        self.llm = async_llm
        self.name = served_model_name
        self.model_path = model_path
        self.tokenizer = async_llm.tokenizer
        self.max_model_len = async_llm.max_model_len
        self.vocab_size = int(async_llm.model_config.vocab_size)
        engine = getattr(async_llm, "engine", None)
        self.scheduling_policy = getattr(getattr(engine, "config", None), "scheduling_policy", "fcfs")
        self._tok_text: dict[int, str] = {}
        self.engine = engine
        if engine is not None and hasattr(engine, "use_grammar_tokenizer"):
            engine.use_grammar_tokenizer(self.tokenizer)  # structured outputs compile on the handlers' copy

    # ------------------------------------------------------------------------------------------------- checks
    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is None, the served name or the model path."""
        if model is None or model == self.name or (self.model_path and model == self.model_path):
            return
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{self.name}`.",
                          "NotFoundError", "model")

    def check_ids(self, ids: list[int], field: str = "prompt") -> None:
        """400 naming ``field`` unless ``ids`` are integer token ids in [0, vocab_size) (request_validation)."""
        try:
            check_token_ids(field, ids, self.vocab_size)
        except ValueError as e:
            raise bad_request(e) from None

    def check_length(self, prompt_len: int, max_tokens: int | None, field: str = "max_tokens") -> int:
        """Return max_tokens (filled to the rest of the context when None); 400 when the request cannot fit."""
        L = self.max_model_len
        if prompt_len > L:
            raise OpenAIError(400, f"This model's maximum context length is {L} tokens, but the prompt has "
                                   f"{prompt_len} tokens; shorten the prompt.", param="prompt")
        if max_tokens is None:
            return max(1, L - prompt_len)
        if prompt_len + max_tokens > L:
            raise OpenAIError(400, f"This model's maximum context length is {L} tokens, but {prompt_len + max_tokens}"
                                   f" were requested ({prompt_len} in the prompt, {max_tokens} in {field}); "
                                   f"reduce the prompt or {field}.", param=field)
        return max_tokens

    def sampling_params(self, req, max_tokens: int, logprobs: int | None, constraint=None) -> SamplingParams:
        """Request fields -> SamplingParams; 400 naming the field for unsupported or out-of-range values.

        The output constraint is ``constraint`` (a StructuredOutputsParams, from tool_choice) or the request's
        response_format / structured_outputs / guided_* fields (server/structured_request.py); it is compiled here,
        so a schema, regex or grammar that does not compile is a 400 before anything streams."""
        bias = getattr(req, "logit_bias", None)
        if bias is not None:  # JSON keys are strings: "50256" -> 50256
            try:
                bias = {int(k): v for k, v in bias.items()}
            except ValueError:
                raise OpenAIError(400, f"logit_bias keys must be token ids (integers as strings), got "
                                       f"{list(bias)[:5]}.", param="logit_bias") from None
        try:
            so = request_structured_outputs(req)
            if constraint is not None:
                if so is not None:
                    raise OpenAIError(400, f"{so.source} cannot be combined with tool_choice \"required\" or a named "
                                           "function (the tool's schema already constrains the output).",
                                      param=so.source)
                so = constraint
            params = SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k in (None, 0) else req.top_k, max_tokens=max_tokens,
                min_tokens=req.min_tokens, seed=req.seed, stop=req.stop, stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, min_p=req.min_p, logit_bias=bias,
                allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words, structured_outputs=so)
            params.validate(self.vocab_size)  # the checks add_request runs (request_validation.py), before streaming
            if so is not None:  # compiled here (cached), so the engine's add_request finds it compiled
                self.engine.compile_grammar(params)
        except ValueError as e:
            raise bad_request(e) from None
        return params

    def priority(self, req) -> int:
        """The request's ``priority`` checked against the engine's scheduling policy before anything streams;
        400 naming ``priority`` when it is not 0 and the policy is not "priority" (as vLLM)."""
        try:
            return check_priority(req.priority, self.scheduling_policy)
        except ValueError as e:
            raise bad_request(e) from None

    def token_text(self, tid: int) -> str:
        """The text of one token id (cached)."""
        s = self._tok_text.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else str(tid)
            if len(self._tok_text) < 1 << 17:
                self._tok_text[tid] = s
        return s

    # ---------------------------------------------------------------------------------------------- prompts
    def completion_prompt(self, req: CompletionRequest) -> tuple[str | None, list[int]]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise OpenAIError(400, f"prompt: a list of {len(p)} prompts is not supported; send one prompt per "
                                       "request.", param="prompt")
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise OpenAIError(400, "prompt is empty.", param="prompt")
            if self.tokenizer is None:
                raise OpenAIError(400, "this model has no tokenizer: send prompt as token ids.", param="prompt")
            ids = list(self.tokenizer(p, add_special_tokens=True)["input_ids"])
            return p, ids
        ids = [int(t) for t in p]
        self.check_ids(ids)
        return None, ids

    def completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """Every prompt of a request as (text or None, token ids): a list of texts or of token-id lists is several
        prompts (OpenAI's and vLLM's batch form, which lm-eval sends); each is checked as a single prompt is,
        and a bad one is named by its index (``prompt[2]``)."""
        p = req.prompt
        if not (isinstance(p, list) and p and isinstance(p[0], (str, list))):
            return [self.completion_prompt(req)]
        out = []
        for i, x in enumerate(p):
            try:
                out.append(self.completion_prompt(req.model_copy(update={"prompt": [x]})))
            except OpenAIError as e:
                raise OpenAIError(e.status, f"prompt[{i}]: {e.message}", e.type, f"prompt[{i}]") from None
        return out

    def chat_prompt(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
                    kwargs: dict | None = None, tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """(prompt text, token ids) of a conversation through the chat template; ``tools`` (checked) go to the
        template, and assistant ``tool_calls`` / tool ``tool_call_id`` fields of messages are passed on (JSON-string
        arguments parsed into objects, as templates expect)."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise OpenAIError(400, "this model has no chat template (tokenizer_config.json chat_template); use "
                                   "/v1/completions with a plain prompt instead.", param="messages")
        msgs = []
        for m in messages:
            c = m.content
            if isinstance(c, list):
                c = "".join(str(part.get("text", "")) for part in c if part.get("type", "text") == "text")
            msgs.append({"role": m.role, "content": c or ""})
            msgs[-1].update(message_tool_fields(m))
        kw = dict(kwargs or {})
        if tools:
            kw["tools"] = tools
        try:
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt
                                           and not continue_final_message,
                                           continue_final_message=continue_final_message, **kw)
        except Exception as e:
            raise OpenAIError(400, f"messages: the chat template failed: {type(e).__name__}: {e}",
                              param="messages") from None
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise OpenAIError(400, "messages: the chat template produced an empty prompt.", param="messages")
        return text, ids

    # ------------------------------------------------------------------------------------------- logprobs
    def completion_logprobs(self, token_ids: list[int], lps: list[dict], offset0: int) -> dict:
        """OpenAI completions shape: tokens, token_logprobs, top_logprobs (dict per position, text -> logprob, most
        likely first), text_offset.

        ``top_logprobs`` is keyed by token text, and different ids can decode to the same text (byte-fallback
        pieces of one multi-byte character all decode to U+FFFD): the chosen token's entry is always there with
        its own logprob (= ``token_logprobs``), and among other ids with one text the most likely one is kept."""
        tokens, token_lps, tops, offsets = [], [], [], []
        off = offset0
        for tid, d in zip(token_ids, lps):
            s = self.token_text(tid)
            tokens.append(s)
            lp = d.get(tid)
            token_lps.append(lp)
            top = {s: lp}
            for t, v in sorted(d.items(), key=lambda kv: -kv[1]):
                top.setdefault(self.token_text(t), v)
            tops.append(dict(sorted(top.items(), key=lambda kv: -kv[1] if kv[1] is not None else float("inf"))))
            offsets.append(off)
            off += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def echo_logprobs(self, prompt_ids: list[int], prompt_lps: list, token_ids: list[int], lps: list[dict]) -> dict:
        """Completions logprobs of echo + logprobs: the prompt's positions (from the engine's prompt_logprobs)
        followed by the generated ones, as OpenAI's legacy API and vLLM return them. Position 0 has nothing that
        predicts it: its ``token_logprobs`` and ``top_logprobs`` entries are None. Logprobs are natural-log
        probabilities of the model's distribution at each position (float)."""
        first = self.token_text(prompt_ids[0])
        head = self.completion_logprobs(prompt_ids[1:], prompt_lps[1:], len(first))
        tail = self.completion_logprobs(token_ids, lps, len(first) + sum(len(s) for s in head["tokens"]))
        return {"tokens": [first] + head["tokens"] + tail["tokens"],
                "token_logprobs": [None] + head["token_logprobs"] + tail["token_logprobs"],
                "top_logprobs": [None] + head["top_logprobs"] + tail["top_logprobs"],
                "text_offset": [0] + head["text_offset"] + tail["text_offset"]}

    def chat_logprobs(self, token_ids: list[int], lps: list[dict], k: int) -> dict:
        """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
        content = []
        for tid, d in zip(token_ids, lps):
            s = self.token_text(tid)
            top = sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else []
            content.append({"token": s, "logprob": d.get(tid), "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": self.token_text(t), "logprob": v,
                                              "bytes": list(self.token_text(t).encode("utf-8"))} for t, v in top]})
        return {"content": content}

    # -------------------------------------------------------------------------------------------- running
    async def collect(self, gen: AsyncIterator[RequestOutput], raw: Request) -> RequestOutput:
        """Run a request to the end; abort it if the client goes away meanwhile."""
        async def last() -> RequestOutput:
            final = None
            async for out in gen:
                final = out
            return final

        task = asyncio.ensure_future(last())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return task.result()
                if await raw.is_disconnected():
                    task.cancel()
                    try:
                        await task
                    except BaseException:
                        pass
                    raise OpenAIError(499, "client disconnected")
        finally:
            if not task.done():
                task.cancel()

    @staticmethod
    def usage(out: RequestOutput) -> dict:
        p = len(out.prompt_token_ids)
        c = sum(len(o.token_ids) for o in out.outputs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


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
        if app.state.shutting_down or not async_llm.is_running:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        reason = async_llm.health_error()
        if reason:
            return JSONResponse(error_body(503, f"the engine cannot serve: {reason}"), status_code=503)
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
            _, ids = serving.chat_prompt(req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = list(serving.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
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
        prompts = serving.completion_prompts(req)
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
        echo_text = ""
        if req.echo:
            echo_text = prompt if prompt is not None else (  # no tokenizer: token ids only, the text stays empty
                serving.tokenizer.decode(ids) if serving.tokenizer is not None else "")
        gen = async_llm.generate(rid, prompt, ids, params, priority)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream_completion(gen, rid, created, model, req.n, echo_text, include_usage,
                                                        req.logprobs is not None, _hold(params)),
                                     media_type="text/event-stream")
        try:
            out = await serving.collect(gen, raw)
        except OpenAIError:
            raise
        except Exception as e:
            raise _map_exception(e) from None
        choices = []
        for o in out.outputs:
            lp = serving.completion_logprobs(o.token_ids, o.logprobs, 0) if req.logprobs is not None else None
            choices.append({"index": o.index, "text": echo_text + o.text, "logprobs": lp,
                            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": serving.usage(out)}

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
            echo_text = ""
            if req.echo:
                echo_text = prompt if prompt is not None else (
                    serving.tokenizer.decode(ids) if serving.tokenizer is not None else "")
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
        chat_text, ids = serving.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                             req.chat_template_kwargs, tools)
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
        try:
            out = await serving.collect(gen, raw)
        except OpenAIError:
            raise
        except Exception as e:
            raise _map_exception(e) from None
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
