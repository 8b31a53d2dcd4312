"""``/v1/embeddings`` request body (OpenAI's shape): ``input`` as a string, a list of strings,
token ids or a list of token-id lists; ``encoding_format`` ``float`` or ``base64``; ``dimensions``
only when it equals the model's hidden size (no Matryoshka truncation: anything else is a 400)."""

from __future__ import annotations

from typing import Literal

from kvfleet.runtime.entrypoints.openai.protocol.common import ProtocolError, StrictRequest

MAX_INPUTS = 2048
"""Most inputs in one request (OpenAI's limit)."""


class EmbeddingRequest(StrictRequest):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs, one per vector; a 400 for an empty one."""
        inp = self.input
        items: list[str | list[int]] = [inp] if isinstance(inp, str) else list(inp)  # type: ignore[arg-type]
        if items and isinstance(items[0], int):
            items = [list(inp)]  # type: ignore[arg-type]
        if not items or len(items) > MAX_INPUTS:
            raise ProtocolError(f"input must hold 1 to {MAX_INPUTS} items", "input")
        for i, item in enumerate(items):
            if len(item) == 0:
                raise ProtocolError(f"input[{i}] is empty", "input")
        return items
