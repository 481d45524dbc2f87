"""tokenfab: an LLM inference and serving engine (paged KV cache, continuous batching, MLA + MoE models)."""
from tokenfab.kernels.cpu.isa import apply_library_caps as _apply_cpu_isa_caps

_apply_cpu_isa_caps()  # TOKENFAB_CPU_ISA caps oneDNN and ATen before either reads its setting

from tokenfab.logprobs import Logprob
from tokenfab.outputs import CompletionOutput, RequestOutput
from tokenfab.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing tokenfab must not pull torch for the CLI's --help
    if name == "LLM":
        from tokenfab.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "__version__"]
