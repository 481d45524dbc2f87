"""Generation backends for ``tokenfab eval tasks``: greedy completions of many prompts.

* :class:`EngineClient` — the offline engine in-process (``tokenfab.LLM``): all prompts of a task go to one
  ``LLM.generate`` call, so the engine batches them (continuous batching). Chat mode renders the model's chat
  template with the tokenizer (as the server's /v1/chat/completions does) and sends token ids.
* :class:`HttpClient` — an OpenAI-compatible server: completion mode posts lists of prompts to
  ``/v1/completions`` (``batch_size`` per request); chat mode posts ``/v1/chat/completions`` from
  ``concurrency`` threads.

A request is a dict: ``{"prompt": str}`` (completion mode) or ``{"messages": [...]}`` (chat mode), with
``max_tokens`` (int) and ``stop`` (list of strings). Both return the generated text, stop strings removed.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable


def _user_error(message: str) -> RuntimeError:
    e = RuntimeError(message)
    e.user_error = True
    return e


class EngineClient:
    """The offline engine on ``model`` (a checkpoint folder, a ``*.gguf`` file or None for the default model).

    Args:
        model: passed to :func:`tokenfab.default_model.resolve_model`.
        dtype, max_model_len, tensor_parallel_size: engine settings (``LLM`` keywords).
        llm: an existing ``LLM`` (tests); then the other arguments are ignored.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", max_model_len: int | None = None,
                 tensor_parallel_size: int = 1, llm=None):
        if llm is None:
            from tokenfab.default_model import resolve_model
            from tokenfab.entrypoints.llm import LLM
            kw = dict(dtype=dtype, tensor_parallel_size=tensor_parallel_size)
            if max_model_len is not None:
                kw["max_model_len"] = max_model_len
            llm = LLM(resolve_model(model), progress=False, **kw)
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len = llm.llm_engine.max_model_len
        self.name = llm.engine_config.model
        self.base_url = None

    def _ids(self, req: dict) -> list[int]:
        tok = self.tokenizer
        if "messages" in req:
            if not getattr(tok, "chat_template", None):
                raise _user_error(f"--mode chat: {self.name} has no chat template; use --mode completion.")
            text = tok.apply_chat_template(req["messages"], tokenize=False, add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return list(tok(req["prompt"], add_special_tokens=True)["input_ids"])

    def generate(self, reqs: list[dict], progress: Callable[[int], None] | None = None) -> list[str]:
        """Greedy completions of ``reqs`` in one batched ``LLM.generate`` call; prompts longer than the context
        keep their last tokens (left truncation, as lm-eval does), leaving room for ``max_tokens``."""
        from tokenfab.sampling_params import SamplingParams
        prompts, params = [], []
        for r in reqs:
            ids = self._ids(r)
            max_tokens = min(r["max_tokens"], self.max_model_len - 1)
            keep = self.max_model_len - max_tokens
            prompts.append({"prompt_token_ids": ids[-keep:]})
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=list(r.get("stop") or [])))
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        if progress:
            progress(len(reqs))
        return [o.outputs[0].text for o in outs]


class HttpClient:
    """An OpenAI-compatible server at ``base_url`` (``http://127.0.0.1:8000``, with or without ``/v1``).

    Args:
        model: the ``model`` field sent (default: the first id of ``GET /v1/models``).
        api_key: bearer token, if the server needs one.
        batch_size: prompts per /v1/completions request (completion mode).
        concurrency: requests in flight (both modes).
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, batch_size: int = 8,
                 concurrency: int = 8, timeout: float = 3600.0):
        import httpx
        url = base_url.rstrip("/")
        self.base_url = url[:-3] if url.endswith("/v1") else url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers, trust_env=False,
                                   limits=httpx.Limits(max_connections=max(concurrency, 1) + 2))
        self.batch_size, self.concurrency = max(1, batch_size), max(1, concurrency)
        info = {}
        try:
            r = self.client.get(f"{self.base_url}/v1/models")
            r.raise_for_status()
            info = (r.json().get("data") or [{}])[0]
        except Exception as e:  # noqa: BLE001 - reported as one line
            if model is None:
                raise _user_error(f"--base-url {base_url}: GET /v1/models failed ({e}); is the server up? "
                                  "(or pass --served-model-name)") from e
        self.name = model or info.get("id")
        self.max_model_len = info.get("max_model_len")

    def _post(self, path: str, body: dict) -> dict:
        r = self.client.post(f"{self.base_url}{path}", json=body)
        if r.status_code != 200:
            raise _user_error(f"--base-url: POST {path} returned {r.status_code}: {r.text[:300]}")
        return r.json()

    def _complete_batch(self, batch: list[dict]) -> list[str]:
        body = {"model": self.name, "prompt": [r["prompt"] for r in batch], "temperature": 0.0,
                "max_tokens": batch[0]["max_tokens"], "stop": list(batch[0].get("stop") or []) or None}
        choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        return [c["text"] for c in choices]

    def _chat_one(self, r: dict) -> str:
        body = {"model": self.name, "messages": r["messages"], "temperature": 0.0, "max_tokens": r["max_tokens"],
                "stop": list(r.get("stop") or []) or None}
        return self._post("/v1/chat/completions", body)["choices"][0]["message"]["content"] or ""

    def generate(self, reqs: list[dict], progress: Callable[[int], None] | None = None) -> list[str]:
        """Greedy completions of ``reqs`` (requests with equal ``max_tokens`` and ``stop`` share a batch)."""
        if not reqs:
            return []
        if "messages" in reqs[0]:
            jobs = [([i], (lambda r=r: [self._chat_one(r)])) for i, r in enumerate(reqs)]
        else:
            groups: dict[tuple, list[int]] = {}
            for i, r in enumerate(reqs):
                groups.setdefault((r["max_tokens"], tuple(r.get("stop") or [])), []).append(i)
            jobs = []
            for idx in groups.values():
                for k in range(0, len(idx), self.batch_size):
                    part = idx[k:k + self.batch_size]
                    jobs.append((part, (lambda part=part: self._complete_batch([reqs[i] for i in part]))))
        out: list[str | None] = [None] * len(reqs)
        with ThreadPoolExecutor(self.concurrency) as pool:
            futs = [(idx, pool.submit(fn)) for idx, fn in jobs]
            for idx, f in futs:
                for i, text in zip(idx, f.result()):
                    out[i] = text
                if progress:
                    progress(len(idx))
        return out
