"""RFC 3339 times: the one format the operator writes (status, conditions, Events) and reads.

Kubernetes writes and expects ``2026-01-02T03:04:05Z`` (UTC, whole seconds). Times travel
through the pure code as seconds since the epoch; only :func:`rfc3339` without an argument
reads the clock.
"""

from __future__ import annotations

import datetime
import time


def rfc3339(t: float | None = None) -> str:
    """Seconds since the epoch (default: now) -> ``2026-01-02T03:04:05Z``."""
    when = time.time() if t is None else t
    return datetime.datetime.fromtimestamp(when, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_datetime(value: str | None) -> datetime.datetime | None:
    """An RFC 3339 / ISO 8601 time -> an aware datetime (no offset: UTC); None for None or ''.

    Raises ValueError for a malformed string.
    """
    if not value:
        return None
    t = datetime.datetime.fromisoformat(str(value))
    return t if t.tzinfo else t.replace(tzinfo=datetime.UTC)


def parse_time(value: str | None) -> float | None:
    """An RFC 3339 time -> seconds since the epoch; None for None or ''.

    Raises ValueError for a malformed string.
    """
    t = parse_datetime(value)
    return None if t is None else t.timestamp()
