"""LoRA adapters of an InferenceService (``spec.model.adapters: [{name, uri}]``): pod config that
never rolls the pods, and the load/unload calls that bring running pods in line.

- Declaring ``spec.model.adapters`` (even ``[]``) turns on ``enable_lora`` (and
  ``skip_failed_lora_modules``) in the pods' config file and runtime adapter updating
  (``KVFLEET_ALLOW_RUNTIME_LORA_UPDATING``), and gives the runtime container the environment
  variable ``KVFLEET_LORA_MODULES`` from the key ``lora_modules`` of the ``NAME-config`` ConfigMap
  (a JSON list of ``{"name", "path"}``). That key is left out of the config hash the pod template
  carries (:func:`hashed_data`) and the template names the key, never its content, so adding or
  removing an adapter leaves the template alone: no pod restarts; a new pod reads
  the current list at start and loads every adapter before ``/ready`` (one that fails is skipped,
  ``skip_failed_lora_modules``, and reported by the next sync: a bad entry never keeps pods down).
- ``uri``: ``hf://ORG/NAME[@REV]`` (the runtime fetches it, :mod:`kvfleet.runtime.lora_source`),
  ``file:///PATH`` (in the image), or ``pvc://CLAIM/PATH`` on the claim the model volume already
  mounts (a ``pvc://`` model, or ``model.download.claimName``): mounting another claim would change
  the pod template.
- :func:`sync_pods` (I/O, called by the reconcile): on every ready pod, ``GET /v1/models``, then
  ``POST /v1/load_lora_adapter`` for each adapter it lacks and ``/v1/unload_lora_adapter`` for each
  adapter no longer in the spec; returns ``status.adapters`` (``name``, ``loadedReplicas``,
  ``readyReplicas``) and the ``AdaptersLoaded`` condition (False, reason ``AdapterLoadFailed`` and
  the pod's answer, when one fails; ``AdaptersLoading`` while some are not loaded yet).

Invalid adapters raise :class:`~kvfleet.operator.crd.InvalidSpec` (reasons ``InvalidAdapter``,
``InvalidAdapterURI``, ``AdapterClaimNotMounted``). Pods that require an API key
(``runtime.apiKeySecretRef``) are not called (the condition says so): new pods still get the list.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from kvfleet.operator import spec_view
from kvfleet.operator.crd import InvalidSpec
from kvfleet.operator.weights import MODELS_DIR, parse_model_uri
from kvfleet.runtime import env

CONFIGMAP_KEY = "lora_modules"
ENV_NAME = env.SERVE_OPTION.name("lora_modules")
CONDITION = "AdaptersLoaded"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
TIMEOUT = env.ADAPTER_LOAD_TIMEOUT.get()
"""Seconds one load call may take (an hf:// adapter downloads first); the chart's
``operator.adapterLoadTimeoutSeconds``."""


def declared(spec: spec_view.Spec) -> bool:
    """Whether ``spec.model.adapters`` is set (an empty list counts)."""
    return spec.model.adapters is not None


def _model_claim(spec: spec_view.Spec) -> str | None:
    model = parse_model_uri(spec.model.uri)
    if model["scheme"] == "pvc":
        return model["claim"]
    if model["scheme"] == "hf":
        return spec.model.download.claim_name or None
    return None


def desired_adapters(spec: spec_view.Spec) -> list[dict[str, str]]:
    """``[{"name", "uri", "path"}]`` where ``path`` is what the runtime loads (an ``hf://`` URI, or a
    folder in the pod).

    Raises:
        InvalidSpec: a bad name, a duplicate, a bad URI, a ``pvc://`` claim the pods do not mount."""
    served = spec.model.served_model_name
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    for i, item in enumerate(spec.model.adapters or ()):
        name, uri = str(item.name or ""), str(item.uri or "")
        if not _NAME_RE.match(name):
            raise InvalidSpec("InvalidAdapter", f"model.adapters[{i}].name {name!r} must be 1-128 letters, digits, "
                                                "'.', '_', '-' or '/' (clients send it as the model)")
        if name in seen or name == served:
            raise InvalidSpec("InvalidAdapter", f"model.adapters[{i}].name {name!r} is used twice (or is the "
                                                "served model name)")
        seen.add(name)
        try:
            where = parse_model_uri(uri)
        except InvalidSpec as e:
            raise InvalidSpec("InvalidAdapterURI", f"model.adapters[{i}].uri: {e.message}") from None
        if where["scheme"] == "hf":
            path = uri
        elif where["scheme"] == "file":
            path = str(where["path"])
        else:
            claim = _model_claim(spec)
            if where["claim"] != claim:
                raise InvalidSpec(
                    "AdapterClaimNotMounted",
                    f"model.adapters[{i}].uri {uri!r}: a pvc:// adapter "
                    f"must be on the claim the model volume mounts ({claim or 'none'}); another "
                    "claim would change the pod template",
                )
            rel = str(where["path"] or "")  # the claim's root is mounted at MODELS_DIR
            path = f"{MODELS_DIR}/{rel}" if rel else MODELS_DIR
        out.append({"name": name, "uri": uri, "path": path})
    return out


def configmap_data(spec: spec_view.Spec) -> dict[str, str]:
    """The ``lora_modules`` key of the ``NAME-config`` ConfigMap (none when not declared)."""
    if not declared(spec):
        return {}
    modules = [{"name": a["name"], "path": a["path"]} for a in desired_adapters(spec)]
    return {CONFIGMAP_KEY: json.dumps(modules, sort_keys=True)}


def hashed_data(data: Mapping[str, Any]) -> dict[str, Any]:
    """The ConfigMap data the pod template's config hash covers: all but the adapter list."""
    return {k: v for k, v in data.items() if k != CONFIGMAP_KEY}


def pod_env(spec: spec_view.Spec, configmap: str) -> list[dict[str, Any]]:
    """The runtime container's env entries (none when not declared): the adapter list from the
    ``configmap`` key, and runtime adapter updating on."""
    if not declared(spec):
        return []
    return [{"name": ENV_NAME, "valueFrom": {"configMapKeyRef": {"name": configmap, "key": CONFIGMAP_KEY}}},
            {"name": env.SERVE_OPTION.name("allow_runtime_lora_updating"), "value": "true"}]


def engine_keys(spec: spec_view.Spec) -> dict[str, Any]:
    """Keys of the pods' config file when adapters are declared (fixed: no restart as they change)."""
    if not declared(spec):
        return {}
    return {"enable_lora": True, "skip_failed_lora_modules": True}


def pod_base_url(pod: Mapping[str, Any]) -> str:
    """``http://IP:PORT`` of a runtime pod (the port the metrics are read from)."""
    from kvfleet.operator.metrics_source import metrics_url

    parts = urlsplit(metrics_url(pod))
    return f"{parts.scheme}://{parts.netloc}"


def _answer(r) -> str:
    try:
        return str(r.json()["error"]["message"])
    except Exception:
        return r.text[:300]


def sync_pods(spec: spec_view.Spec, pods: list[Mapping[str, Any]], *, client=None) -> dict[str, Any]:
    """Load and unload adapters on the ready pods; return ``{"adapters": [...], "condition":
    (status, reason, message)}`` (see the module docstring). Never raises for a pod's failure."""
    import httpx

    from kvfleet.operator.metrics_source import pod_is_ready, pod_name

    desired = desired_adapters(spec)
    ready = [p for p in pods if pod_is_ready(p)]
    loaded = {a["name"]: 0 for a in desired}
    failures: list[str] = []
    if spec.runtime.api_key_secret_ref and desired:
        return {"adapters": [{"name": n, "loadedReplicas": 0, "readyReplicas": len(ready)} for n in loaded],
                "condition": ("Unknown", "APIKeyRequired", "the pods require an API key: running pods are not "
                              "updated (new pods load the current adapters at start)")}
    own = client is None
    client = client or httpx.Client(timeout=TIMEOUT)
    try:
        for pod in ready:
            base = pod_base_url(pod)
            try:
                cards = client.get(base + "/v1/models", timeout=10).json()["data"]
            except Exception as e:
                failures.append(f"{pod_name(pod)}: /v1/models: {e}")
                continue
            have = {c["id"] for c in cards if c.get("parent")}
            for a in desired:
                ok = a["name"] in have
                if not ok:
                    try:
                        r = client.post(base + "/v1/load_lora_adapter",
                                        json={"lora_name": a["name"], "lora_path": a["path"]})
                        ok = r.status_code == 200
                        if not ok:
                            failures.append(f"{a['name']} on {pod_name(pod)}: HTTP {r.status_code}: {_answer(r)}")
                    except Exception as e:
                        failures.append(f"{a['name']} on {pod_name(pod)}: {e}")
                loaded[a["name"]] += int(ok)
            for name in sorted(have - set(loaded)):
                try:
                    client.post(base + "/v1/unload_lora_adapter", json={"lora_name": name})
                except Exception as e:
                    failures.append(f"unload of {name} on {pod_name(pod)}: {e}")
    finally:
        if own:
            client.close()
    status = [{"name": n, "loadedReplicas": c, "readyReplicas": len(ready)} for n, c in loaded.items()]
    if failures:
        cond = ("False", "AdapterLoadFailed", "; ".join(failures)[:1000])
    elif any(c < len(ready) for c in loaded.values()) or not ready and desired:
        cond = ("False", "AdaptersLoading", "waiting for ready pods to load every adapter")
    else:
        cond = ("True", "AllLoaded", f"{len(desired)} adapters loaded on {len(ready)} ready pods")
    return {"adapters": status, "condition": cond}
