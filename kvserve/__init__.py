"""kvserve: an LLM inference server built like vLLM's V1 engine.

from kvserve import LLM, SamplingParams, StructuredOutputsParams, LoRARequest
"""

from kvserve.services.api.serving.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.shared.lora import LoRARequest
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]


def __getattr__(name: str):
    # LLM pulls in the engine (torch); import it only when asked for.
    if name == "LLM":
        from kvserve.llm import LLM

        return LLM
    raise AttributeError(name)
