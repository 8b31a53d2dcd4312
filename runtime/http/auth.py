"""The API key check both HTTP front ends share: ``Authorization: Bearer <key>`` (the scheme in any
case, the token stripped), or Anthropic's ``x-api-key`` header where the caller accepts it.

:func:`presented_key` reads the key a request carries; :func:`key_matches` compares it with the
configured one in constant time (``secrets.compare_digest``). A missing or malformed header is no
key (never a match); an empty configured key is the caller's "auth off", decided before calling.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping


def presented_key(headers: Mapping[str, str], *, x_api_key: bool = False) -> str | None:
    """The key in ``headers`` (case-insensitive names, as starlette's ``Headers``): ``x-api-key``
    first when ``x_api_key``, else the token of ``Authorization: Bearer <token>``; None without one."""
    if x_api_key and (value := headers.get("x-api-key")) is not None:
        return value.strip()
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def key_matches(headers: Mapping[str, str], key: str, *, x_api_key: bool = False) -> bool:
    """Whether the request carries ``key`` (:func:`presented_key`), compared in constant time."""
    given = presented_key(headers, x_api_key=x_api_key)
    return given is not None and secrets.compare_digest(given.encode(), key.encode())
