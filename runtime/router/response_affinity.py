"""Which replica holds a stored Responses-API response (``/v1/responses``).

A replica keeps the responses it stored in its own memory (``--max-stored-responses``), so
``GET`` / ``DELETE /v1/responses/{id}`` and a ``POST /v1/responses`` with
``previous_response_id`` must reach that replica. The replica names the id of a stored response
in the ``x-kvfleet-response-id`` header of its answer; the router remembers ``id -> replica``
in a bounded LRU (:class:`ResponseAffinity`) and sends the follow-ups there while that replica
is available (else the usual pick: the replica that gets it answers 404).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

RESPONSE_ID_HEADER = "x-kvfleet-response-id"


def wanted_response_id(method: str, path: str, body: Any) -> str | None:
    """The stored response a request needs, or None."""
    if path.startswith("/v1/responses/") and method in ("GET", "DELETE", "HEAD"):
        return path.removeprefix("/v1/responses/").split("/")[0] or None
    if path == "/v1/responses" and method == "POST" and isinstance(body, dict):
        rid = body.get("previous_response_id")
        return rid if isinstance(rid, str) else None
    return None


class ResponseAffinity:
    """Bounded LRU of ``response id -> replica url``."""

    def __init__(self, size: int = 100_000):
        self.size = size
        self._where: OrderedDict[str, str] = OrderedDict()

    def record(self, response_id: str | None, url: str) -> None:
        if not response_id:
            return
        self._where[response_id] = url
        self._where.move_to_end(response_id)
        while len(self._where) > self.size:
            self._where.popitem(last=False)

    def replica(self, response_id: str | None) -> str | None:
        return self._where.get(response_id) if response_id else None
