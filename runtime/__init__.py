"""kvfleet runtime: a continuous-batching LLM engine over a paged KV cache, with an
OpenAI-compatible server and Prometheus metrics.

Public Python API (shaped like vLLM's)::

    from kvfleet.runtime import LLM, SamplingParams
    llm = LLM()                                   # default model: SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=16))
"""

import os

# The one place kvfleet sets it (every kvfleet.runtime module, the engine, the server and
# `kvfleet bench` included, is imported after this package): before torch loads its OpenMP
# runtime, idle OpenMP threads sleep instead of spinning. With spinning (the default) a CPU
# shared with other processes makes every parallel region wait for a descheduled spinner:
# decode steps measured 10-20x slower (docs/engine.md, "CPU threads"). A user's value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
