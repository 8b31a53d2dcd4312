"""kvfleet runtime: a continuous-batching LLM engine over a paged KV cache, with an
OpenAI-compatible server and Prometheus metrics.

Public Python API (shaped like vLLM's)::

    from kvfleet.runtime import LLM, SamplingParams
    llm = LLM()                                   # default model: SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=16))
"""

from kvfleet.runtime.lora_request import LoRARequest
from kvfleet.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "LLMEngine", "AsyncLLMEngine", "EngineConfig", "LoRARequest"]


def __getattr__(name: str):
    # Heavy imports (torch, transformers) only when the engine is actually used.
    if name == "LLM":
        from kvfleet.runtime.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvfleet.runtime.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from kvfleet.runtime.engine.async_llm import AsyncLLMEngine

        return AsyncLLMEngine
    if name == "EngineConfig":
        from kvfleet.runtime.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
