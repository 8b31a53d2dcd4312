"""``/v1/models`` (model cards, adapters included) and vLLM's LoRA adapter load/unload bodies."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from kvfleet.runtime.entrypoints.openai.protocol.common import now


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvfleet"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and ignored)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
