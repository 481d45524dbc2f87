"""The offline API in vLLM's shape: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

from typing import Sequence as Seq

from tokenfab.engine.engine import LLMEngine
from tokenfab.engine.engine_config import EngineConfig
from tokenfab.outputs import RequestOutput
from tokenfab.sampling_params import SamplingParams


class LLM:
    """Load a checkpoint folder and generate offline with continuous batching.

    Args: see :class:`tokenfab.engine.engine_config.EngineConfig` (model, dtype, max_model_len, max_num_seqs,
    max_num_batched_tokens, block_size, num_kv_blocks or kv_cache_memory, seed, device, tensor_parallel_size).
    """

    def __init__(self, model: str | None = None, progress: bool = True, **kwargs):
        from tokenfab.default_model import resolve_model
        model = resolve_model(model)  # None -> the default model; *.gguf -> its cached bf16 folder
        self.engine_config = EngineConfig(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_config(self.engine_config, progress=progress)
        self._counter = 0
        self.progress = progress

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: str | list | dict, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns RequestOutputs in prompt order.

        ``prompts``: a string, a list of strings, or dicts ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``.
        ``sampling_params``: one for all prompts or a list aligned with them (default: SamplingParams()).

        Raises:
            PromptTooLongError, ValueError: for a bad prompt (nothing is generated then).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts.")
        eng = self.llm_engine
        ids = []
        try:
            for p, sp in zip(prompts, params_list):
                rid = str(self._counter)
                self._counter += 1
                if isinstance(p, dict):
                    eng.add_request(rid, p.get("prompt"), p.get("prompt_token_ids"), sp)
                else:
                    eng.add_request(rid, p, None, sp)
                ids.append(rid)
        except Exception:
            for rid in ids:
                eng.abort_request(rid)
            raise
        from tqdm import tqdm
        show = self.progress if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not show, leave=False)
        done: dict[str, RequestOutput] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[r] for r in ids]
