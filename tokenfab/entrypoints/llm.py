"""The offline API in vLLM's shape: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

from typing import Sequence as Seq

from tokenfab.engine.engine import LLMEngine
from tokenfab.engine.engine_config import EngineConfig, check_argument_names
from tokenfab.outputs import RequestOutput
from tokenfab.sampling_params import SamplingParams


class LLM:
    """Load a checkpoint folder and generate offline with continuous batching.

    Args: see :class:`tokenfab.engine.engine_config.EngineConfig` (model, tokenizer, trust_remote_code, dtype,
    max_model_len, max_num_seqs, max_num_batched_tokens, block_size, num_kv_blocks, kv_cache_memory or
    gpu_memory_utilization, seed, device, tensor_parallel_size, enforce_eager, enable_prefix_caching,
    quantization, generation_config, max_logprobs, speculative_config, scheduling_policy, batch_invariant
    (bit-identical results whatever the batch, docs/batch_invariance.md), load_format ("auto" or "dummy": seeded
    random weights at the config's shapes, no weight file read), plus ``progress`` (tqdm bars).

    Raises:
        UnknownArgumentError (a ValueError and a TypeError): an unknown keyword, naming the nearest supported one;
            raised before anything is loaded.
        ValueError: a setting out of range or not supported (see EngineConfig).
    """

    def __init__(self, model: str | None = None, progress: bool = True, **kwargs):
        check_argument_names(kwargs, {f for f in EngineConfig.__dataclass_fields__ if f != "model"} | {"progress"})
        from tokenfab.default_model import resolve_model
        model = resolve_model(model)  # None -> the default model; *.gguf -> served packed
        self.engine_config = EngineConfig.from_kwargs(model, **kwargs)
        self.llm_engine = LLMEngine.from_config(self.engine_config, progress=progress)
        self._counter = 0
        self.progress = progress
        self._default_fields = self.engine_config.generation_defaults()
        if self._default_fields:
            import logging
            logging.getLogger("tokenfab").info("default sampling settings from generation_config: %s "
                                               "(generation_config='vllm' ignores them)", self._default_fields)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams used when none are given: SamplingParams() updated with the model's
        generation_config.json fields (temperature, top_p, top_k, max_new_tokens as max_tokens ...) unless
        generation_config='vllm' (EngineConfig.generation_defaults)."""
        return SamplingParams(**self._default_fields)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or to a list of them,
        as vLLM's ``LLM.chat``: each conversation is rendered with the tokenizer's chat template (or
        ``chat_template``: template text or a file path) through transformers' ``apply_chat_template``
        (``tools`` and ``chat_template_kwargs`` go to the template), tokenized without special tokens (the
        template writes them), then run as :meth:`generate` runs prompt token ids. Returns one RequestOutput
        per conversation, in order; ``prompt`` holds the rendered text.

        Raises:
            ValueError: no chat template, a malformed message, add_generation_prompt with continue_final_message,
                or what :meth:`generate` raises.
        """
        from tokenfab.entrypoints.chat_template import load_chat_template, render_chat
        convs = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        template = load_chat_template(chat_template)
        tok = self.get_tokenizer()
        prompts = []
        for conv in convs:
            text = render_chat(tok, list(conv), template, add_generation_prompt, continue_final_message, tools,
                               chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(self, prompts: str | list | dict, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns RequestOutputs in prompt order.

        ``prompts``: a string, a list of strings, or dicts ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``.
        ``sampling_params``: one for all prompts or a list aligned with them (default:
        :meth:`get_default_sampling_params`, i.e. SamplingParams() with the generation_config defaults).
        ``priority``: one int per prompt (lower runs earlier) for ``scheduling_policy="priority"``, as vLLM's; other
        policies accept only zeros (default: all 0).

        A request the engine fails while running (``finish_reason`` "error") comes back with the reason in
        ``RequestOutput.error``; the others finish normally.

        Raises:
            PromptTooLongError, ValueError: for a bad prompt, or logprobs / prompt_logprobs above max_logprobs
                (nothing is generated then).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts.")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority: got {len(priorities)} priorities for {len(prompts)} prompts; give one per "
                             "prompt.")
        for sp in params_list:
            self.engine_config.check_logprobs(sp)  # logprobs / prompt_logprobs above max_logprobs: ValueError
        eng = self.llm_engine
        ids = []
        try:
            for p, sp, prio in zip(prompts, params_list, priorities):
                rid = str(self._counter)
                self._counter += 1
                if isinstance(p, dict):
                    eng.add_request(rid, p.get("prompt"), p.get("prompt_token_ids"), sp, priority=prio)
                else:
                    eng.add_request(rid, p, None, sp, priority=prio)
                ids.append(rid)
        except Exception:
            for rid in ids:
                eng.abort_request(rid)
            raise
        from tqdm import tqdm
        show = self.progress if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not show, leave=False)
        done: dict[str, RequestOutput] = {}
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:  # a failure the engine could not pin on one request: leave the LLM usable
            for rid in ids:
                eng.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in ids]
