"""Request handling shared by the OpenAI endpoints: model and token checks, prompt building (completion and chat),
SamplingParams from a request, logprobs shapes, collecting a non-streamed result. The routes live in api_server.py.

Prompts are tokenized (and chat templates rendered) on one worker thread, never on the event loop, so a long prompt
does not stall other streams; before that, a prompt whose length in characters cannot fit ``max_model_len`` tokens
is refused at once (server/prompt_bound.py), without tokenizing it.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from fastapi import Request

from tokenfab.engine.scheduling_policy import check_priority
from tokenfab.logprobs import Logprob
from tokenfab.outputs import RequestOutput
from tokenfab.request_validation import check_token_ids
from tokenfab.sampling_params import SamplingParams
from tokenfab.server.async_engine import AsyncLLM
from tokenfab.server.prompt_bound import PromptCharBound, prompt_char_bound
from tokenfab.server.protocol import CompletionRequest, OpenAIError
from tokenfab.server.structured_request import request_structured_outputs
from tokenfab.server.tool_calls import message_tool_fields

def bad_request(e: ValueError) -> OpenAIError:
    """A 400 for a refused field: ``param`` from an InvalidRequestError, else the message's first word (the
    checks start their messages with the field name)."""
    msg = str(e)
    return OpenAIError(400, msg, param=getattr(e, "param", None) or msg.split(" ", 1)[0])


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
        # One worker: the tokenizer is used by one thread at a time (vLLM does the same); the bound is its first job.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenfab-tokenize")
        self._bound_future = self._tokenize_pool.submit(prompt_char_bound, self.tokenizer)

    async def _off_loop(self, fn, *args):
        """Run ``fn(*args)`` on the tokenizer's worker thread."""
        return await asyncio.wrap_future(self._tokenize_pool.submit(fn, *args))

    async def char_bound(self) -> PromptCharBound | None:
        """The tokenizer's :class:`PromptCharBound` (computed once on the worker at start-up; None: no safe bound)."""
        try:
            return await asyncio.wrap_future(self._bound_future)
        except Exception:  # an odd tokenizer: tokenize everything
            return None

    async def check_prompt_chars(self, text: str, field: str = "prompt") -> None:
        """400 naming ``field`` when ``text`` certainly needs more than ``max_model_len`` tokens, from its length in
        characters alone (never refuses a prompt that would fit: server/prompt_bound.py)."""
        bound = await self.char_bound()
        if bound is not None and bound.exceeds(text, self.max_model_len):
            raise OpenAIError(400, f"This model's maximum context length is {self.max_model_len} tokens, and the "
                                   f"{field} has {len(text)} characters: more than {bound.char_limit(self.max_model_len)}"
                                   f" (at most {bound.token_chars} characters per token of this tokenizer) cannot fit;"
                                   f" shorten the {field}.", param=field)

    async def tokenize(self, text: str, add_special_tokens: bool = True, field: str | None = "prompt") -> list[int]:
        """Token ids of ``text`` computed on the worker thread; with ``field``, a text that cannot fit
        ``max_model_len`` tokens is refused first (:meth:`check_prompt_chars`)."""
        if field is not None:
            await self.check_prompt_chars(text, field)
        return await self._off_loop(self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

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
    async def completion_prompt(self, req: CompletionRequest) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a request's single prompt; a text is tokenized off the event loop."""
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
            return p, await self.tokenize(p, True)
        ids = [int(t) for t in p]
        self.check_ids(ids)
        return None, ids

    async def completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """Every prompt of a request as (text or None, token ids): a list of texts or of token-id lists is several
        prompts (OpenAI's and vLLM's batch form, which lm-eval sends); each is checked as a single prompt is,
        and a bad one is named by its index (``prompt[2]``)."""
        p = req.prompt
        if not (isinstance(p, list) and p and isinstance(p[0], (str, list))):
            return [await self.completion_prompt(req)]
        out = []
        for i, x in enumerate(p):
            try:
                out.append(await self.completion_prompt(req.model_copy(update={"prompt": [x]})))
            except OpenAIError as e:
                raise OpenAIError(e.status, f"prompt[{i}]: {e.message}", e.type, f"prompt[{i}]") from None
        return out

    async def chat_prompt(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
                          kwargs: dict | None = None, tools: list[dict] | None = None,
                          check_length: bool = True) -> tuple[str, list[int]]:
        """(prompt text, token ids) of a conversation through the chat template; ``tools`` (checked) go to the
        template, and assistant ``tool_calls`` / tool ``tool_call_id`` fields of messages are passed on (JSON-string
        arguments parsed into objects, as templates expect). The template is rendered and the text tokenized on
        the worker thread; with ``check_length``, a rendered text that cannot fit ``max_model_len`` tokens is
        refused before tokenizing (400 naming ``messages``)."""
        text = await self._off_loop(self._render_chat, messages, add_generation_prompt, continue_final_message,
                                    kwargs, tools)
        ids = await self.tokenize(text, False, "messages" if check_length else None)
        if not ids:
            raise OpenAIError(400, "messages: the chat template produced an empty prompt.", param="messages")
        return text, ids

    def _render_chat(self, messages, add_generation_prompt: bool, continue_final_message: bool,
                     kwargs: dict | None, tools: list[dict] | None) -> str:
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
        return text

    # ------------------------------------------------------------------------------------------- logprobs
    def completion_logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]], offset0: int) -> dict:
        """OpenAI completions shape: tokens, token_logprobs, top_logprobs (dict per position, text -> logprob, most
        likely first), text_offset.

        ``top_logprobs`` is keyed by token text, and different ids can decode to the same text (byte-fallback
        pieces of one multi-byte character all decode to U+FFFD): the chosen token's entry is always there with
        its own logprob (= ``token_logprobs``), and among other ids with one text the most likely one is kept."""
        tokens, token_lps, tops, offsets = [], [], [], []
        off = offset0
        for tid, entries in zip(token_ids, lps):
            d = {t: e.logprob for t, e in entries.items()}  # the engine's {token_id: Logprob}
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

    def echo_logprobs(self, prompt_ids: list[int], prompt_lps: list, token_ids: list[int],
                      lps: list[dict[int, Logprob]]) -> dict:
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

    def chat_logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]], k: int) -> dict:
        """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
        content = []
        for tid, entries in zip(token_ids, lps):
            d = {t: e.logprob for t, e in entries.items()}  # the engine's {token_id: Logprob}
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
