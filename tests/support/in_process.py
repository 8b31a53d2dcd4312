"""The OpenAI server's app in this process, on the real engine: ``serving_app``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi.testclient import TestClient

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.async_llm import AsyncLLMEngine
from kvfleet.runtime.entrypoints.openai.api_server import create_app
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings


@contextmanager
def serving_app(loaded, config: EngineConfig | None = None, settings: ServerSettings | None = None,
                timeout: float = 120.0) -> Iterator[TestClient]:
    """``create_app`` whose engine is the real ``AsyncLLMEngine`` on ``loaded`` (the ``smollm2``
    fixture: a small KV cache of its own), driven by FastAPI's ``TestClient``, ready-waited."""
    config = config or EngineConfig(kv_cache_memory=32 * 1024**2, max_model_len=256)

    def real_engine(cfg: EngineConfig, stat_loggers: list) -> AsyncLLMEngine:
        return AsyncLLMEngine(cfg, stat_loggers, loaded=loaded)

    app = create_app(config, settings or ServerSettings(), engine_factory=real_engine)
    with TestClient(app) as client:
        deadline = time.monotonic() + timeout
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, f"server never became ready: {client.get('/health').text}"
            time.sleep(0.02)
        yield client
