"""Pure: ``spec.disaggregation`` (issue 43; docs/routing.md, "Prefill/decode disaggregation") as
two pools of runtime pods and the router's flags.

Contract: :func:`disaggregation` is the one reader of the field (defaulted, checked; None when
absent; a dict, since a pool's ``engine`` is merged field by field over ``spec.engine`` before the
pool's own view, :func:`kvfleet.operator.spec_view.of`, is built). With it,
:func:`desired_children` renders each pool through the ordinary builders (``build``:
:func:`kvfleet.operator.builders.desired_children`) from :func:`pool_isvc`, the
InferenceService as that pool sees it: ``spec.engine`` overlaid with the pool's ``engine``, its
``replicas``, and its name:

- decode: the InferenceService's own children (ConfigMap ``NAME-config``, Service and Deployment
  ``NAME``, PDB, HPA), ``replicas`` = the autoscaler's decision when there is one, else
  ``decode.replicas``;
- prefill: ConfigMap ``NAME-prefill-config``, Service and Deployment ``NAME-prefill``, PDB
  ``NAME-prefill`` (no HPA: per-pool autoscaling is not built yet), labelled and owned as the
  InferenceService's children.

Every Deployment and its pods carry ``kvfleet.io/role: prefill|decode``. The router (needs
``spec.router.enabled``) gets :func:`router_args`: ``--prefill-kube-service NAME-prefill`` beside
its ``--kube-service NAME``. Both pools keep the peer KV tier (the connector the two legs move
blocks through): a spec without it, or with ``tensorParallelSize`` > 1 in a pool, is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from kvfleet.operator import crd, crd_schema, kv_tiers, spec_view
from kvfleet.operator.crd import InvalidSpec
from kvfleet.operator.service_spec import LABEL_ISVC

ROLE_LABEL = "kvfleet.io/role"
ROLES = ("prefill", "decode")


def disaggregation(isvc: Mapping[str, Any]) -> dict[str, Any] | None:
    """``spec.disaggregation`` with the CRD's defaults, or None when absent.

    Raises:
        InvalidSpec: ``InvalidDisaggregation``: without the router, or a pool that could not move
            KV blocks (no peer tier, or tensor parallelism)."""
    raw = (isvc.get("spec") or {}).get("disaggregation")
    if not raw:
        return None
    out = crd.apply_defaults(dict(raw), crd_schema.DISAGGREGATION)
    if not crd.apply_defaults(dict((isvc.get("spec") or {}).get("router") or {}), crd_schema.ROUTER).get("enabled"):
        raise InvalidSpec("InvalidDisaggregation", "disaggregation needs router.enabled: the router runs the two legs")
    for role in ROLES:
        engine = spec_view.of(pool_isvc(isvc, role, out)).engine
        if int(engine.tensor_parallel_size or 1) > 1 or "peer" not in kv_tiers.tiers(engine):
            raise InvalidSpec("InvalidDisaggregation", f"disaggregation.{role}: the pool needs the peer KV tier "
                                                       "and tensorParallelSize 1 (blocks move between pods)")
    return out


def pool_isvc(isvc: Mapping[str, Any], role: str, spec: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The InferenceService as the ``role`` pool sees it (see the module doc)."""
    spec = spec if spec is not None else disaggregation(isvc)
    assert spec is not None
    pool = spec[role]
    out = copy.deepcopy(dict(isvc))
    out["spec"] = {k: v for k, v in out.get("spec", {}).items() if k != "disaggregation"}
    out["spec"]["engine"] = {**(out["spec"].get("engine") or {}), **copy.deepcopy(pool.get("engine") or {})}
    out["spec"]["replicas"] = pool["replicas"]
    if role == "prefill":
        out["metadata"] = {**out["metadata"], "name": f"{isvc['metadata']['name']}-prefill"}
        out["spec"]["autoscaling"] = {"mode": "none"}
    return out


def desired_children(isvc: Mapping[str, Any], build: Callable[..., list[dict[str, Any]]], *,
                     replicas: int | None = None, scaled_externally: bool = False) -> list[dict[str, Any]]:
    """Both pools' children, decode first (``build(pool_isvc, replicas=, scaled_externally=)``)."""
    spec = disaggregation(isvc)
    assert spec is not None
    decode = build(pool_isvc(isvc, "decode", spec), replicas=replicas, scaled_externally=scaled_externally)
    prefill = build(pool_isvc(isvc, "prefill", spec))
    name, uid = isvc["metadata"]["name"], isvc["metadata"].get("uid")
    for role, children in (("decode", decode), ("prefill", prefill)):
        for child in children:
            meta = child["metadata"]
            meta["labels"] = {**meta.get("labels", {}), LABEL_ISVC: name, ROLE_LABEL: role}
            for ref in meta.get("ownerReferences", []):
                ref.update(name=name, uid=uid)
            if child["kind"] == "Deployment":
                template = child["spec"]["template"]["metadata"]
                template["labels"] = {**template["labels"], LABEL_ISVC: name, ROLE_LABEL: role}
    return decode + prefill


def router_args(isvc: Mapping[str, Any]) -> list[str]:
    """The router's prefill pool flag (none without ``spec.disaggregation``)."""
    if disaggregation(isvc) is None:
        return []
    return ["--prefill-kube-service", f"{isvc['metadata']['name']}-prefill"]
