"""``LoRARequest``: which LoRA adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``).

Torch-free: the engine core (the scheduler, the prefix-cache hashes) and the HTTP server use it.
``lora_int_id`` is unique for the engine's lifetime: an adapter unloaded and loaded again under
the same name gets a new id, so KV blocks cached for the old weights are never reused for the new.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A loaded adapter.

    Attributes:
        lora_name: the name clients send in ``model``.
        lora_int_id: >= 1, unique per load (0 is the base model).
        lora_path: the adapter's folder (PEFT format).
        base_model_name: the model it belongs to (/v1/models' ``parent``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None


class LoRANotFoundError(LookupError):
    """No adapter of that name is loaded (the server answers 404 ``model_not_found``)."""


class LoRALoadError(ValueError):
    """An adapter cannot be served: a bad path, not a PEFT LoRA checkpoint, a feature kvfleet does
    not support (DoRA, embedding or LM-head adapters, ...), a rank over ``max_lora_rank``, or a
    name already in use. The message says which and why (the server answers 400; at start-up,
    ``bad_input``: the server logs that one line, no traceback, and exits 1)."""

    bad_input = True
    about_model = False  # the start-up line names the adapter (in the message), not the base model
