"""LoRALoadError at start-up (kvfleet.runtime.lora_request): an adapter of --lora-modules that
cannot be served is bad input, so the server logs its one line without a traceback."""

from __future__ import annotations

import logging
import time

from fastapi.testclient import TestClient

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.entrypoints.openai.api_server import create_app
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings
from kvfleet.runtime.lora_request import LoRALoadError

REASON = "lora_path '/adapters/big': rank 32 of 'model.layers.0.mlp.down_proj' is over --max-lora-rank (16)"


def test_an_adapter_that_cannot_be_served_is_one_error_line_at_start(caplog):
    def factory(config, stat_loggers):
        raise LoRALoadError(REASON)

    app = create_app(EngineConfig(model="base-model", enable_lora=True), ServerSettings(), engine_factory=factory)
    app.state.kvfleet.on_fatal = lambda: None
    with caplog.at_level(logging.ERROR, logger="kvfleet.server"), TestClient(app) as c:
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 503:
            assert time.monotonic() < deadline, "the failed load was not reported"
            time.sleep(0.05)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and f"LoRALoadError: {REASON}" in errors[0].getMessage()
    assert not errors[0].exc_info  # no traceback: the line is the whole story
    assert "base-model" not in errors[0].getMessage()  # the adapter is the problem, not the base model
