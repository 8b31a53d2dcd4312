"""The fleet secret of an InferenceService (issue 42): a Secret ``<name>-fleet`` the operator
creates once, with a random key, and the env entry that mounts it into every runtime pod and
router pod as ``$KVFLEET_FLEET_SECRET``.

With it the router signs its peer hints, a replica serves ``/kv_blocks`` to the fleet only and
takes KV blocks only from another replica of the same InferenceService (the runtime's
:mod:`kvfleet.runtime.kv_transfer.fleet_auth`; docs/routing.md, "Peer KV pull"): each
InferenceService is its own fleet. :func:`build` is the only impure part of the operator's
children (the random value); the reconcile creates it when it is missing and never rewrites it
(:func:`kvfleet.operator.reconcile.ensure_fleet_secret`), so the key stays the pods' for the
service's life; it goes with the InferenceService (ownerReference).
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping
from typing import Any

from kvfleet.operator import service_spec
from kvfleet.runtime import env

KEY = "secret"
ENV = env.FLEET_SECRET.name


def name(isvc: Mapping[str, Any]) -> str:
    return f"{isvc['metadata']['name']}-fleet"


def env_entry(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """``$KVFLEET_FLEET_SECRET`` from the Secret (runtime and router containers)."""
    return {"name": ENV, "valueFrom": {"secretKeyRef": {"name": name(isvc), "key": KEY}}}


def build(isvc: Mapping[str, Any], value: str | None = None) -> dict[str, Any]:
    """The Secret, with ``value`` (default: 32 random bytes, URL-safe base64)."""
    value = value or secrets.token_urlsafe(32)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": service_spec.child_meta(isvc, name(isvc)),
            "data": {KEY: base64.b64encode(value.encode()).decode()}}
