"""LoRA adapters over HTTP, as vLLM serves them.

- ``GET /v1/models`` lists every loaded adapter as a model card whose ``parent`` is the base model
  and ``root`` the adapter's folder (:func:`lora_model_cards`); a request names an adapter in its
  ``model`` field (:meth:`ServerState.check_model <.serving_engine.ServerState.check_model>`
  accepts adapter names, :func:`lora_for` picks the adapter).
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` (a folder, ``file:///PATH`` or
  ``hf://ORG/NAME[@REV]``, fetched first: :mod:`kvfleet.runtime.lora_source`) and ``POST
  /v1/unload_lora_adapter`` ``{"lora_name"}``, answered with vLLM's plain-text ``Success: ...``
  lines, only when runtime updating is allowed: ``--allow-runtime-lora-updating``,
  ``KVFLEET_ALLOW_RUNTIME_LORA_UPDATING=true`` or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
  (otherwise 404 saying so, as vLLM, which registers the routes only then). A checkpoint the
  engine refuses is a 400 naming why (:class:`~kvfleet.runtime.lora_request.LoRALoadError`); an
  unknown adapter on unload a 404.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.entrypoints.openai.errors import APIError
from kvfleet.runtime.entrypoints.openai.serving_engine import ServerState
from kvfleet.runtime.lora_request import LoRALoadError, LoRANotFoundError
from kvfleet.runtime.lora_source import resolve_lora_path


def lora_model_cards(state: ServerState) -> list[P.ModelCard]:
    """One card per loaded adapter (none with LoRA off or while loading)."""
    if not state.config.enable_lora or state.engine is None:
        return []
    return [
        P.ModelCard(
            id=lora.lora_name,
            created=int(state.started_at),
            root=lora.lora_path,
            parent=lora.base_model_name or state.model_name,
            max_model_len=state.engine.max_model_len,
        )
        for lora in state.engine.list_loras()
    ]


def lora_for(state: ServerState, model: str | None) -> str | None:
    """The adapter a request's ``model`` names, or None (the base model)."""
    if model is None or model == state.model_name or not state.config.enable_lora or state.engine is None:
        return None
    return model if any(lora.lora_name == model for lora in state.engine.list_loras()) else None


def _updating_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kvfleet
    if not state.settings.allow_runtime_lora_updating:
        raise APIError(
            404,
            "runtime LoRA adapter loading is disabled: start the server with "
            "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
            code="not_found",
        )
    if not state.config.enable_lora:
        raise APIError(400, "LoRA adapters need --enable-lora", code="invalid_value")
    return state


def lora_router(auth: Sequence[Any], parse_body: Callable[[Request, type], Awaitable[Any]]) -> APIRouter:
    """The two routes, with the app's API-key dependency ``auth`` and its body parser
    ``parse_body(request, model)`` (size limit, OpenAI-style 400s)."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter", dependencies=list(auth))
    async def load_lora_adapter(request: Request):
        state = _updating_state(request)
        body = await parse_body(request, P.LoadLoRAAdapterRequest)
        engine = state.require_engine()
        if body.lora_name == state.model_name:
            raise APIError(400, f"'{body.lora_name}' is the served model's name; an adapter needs another name.",
                           param="lora_name", code="invalid_value")
        if any(lora.lora_name == body.lora_name for lora in engine.list_loras()):
            raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name",
                           code="invalid_value")
        try:  # an hf:// adapter downloads here, off the engine thread
            path = await asyncio.to_thread(resolve_lora_path, body.lora_path)
            await engine.add_lora(body.lora_name, path)
        except LoRALoadError as exc:
            raise APIError(400, str(exc), param="lora_path", code="invalid_value") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", dependencies=list(auth))
    async def unload_lora_adapter(request: Request):
        state = _updating_state(request)
        body = await parse_body(request, P.UnloadLoRAAdapterRequest)
        engine = state.require_engine()
        try:
            await engine.remove_lora(body.lora_name)
        except LoRANotFoundError as exc:
            raise APIError(404, str(exc), param="lora_name", code="model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
