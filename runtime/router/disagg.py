"""Prefill/decode disaggregation in the router (issue 43; docs/routing.md, "Prefill/decode
disaggregation"): a completion or chat completion runs as two legs, as vLLM's P/D proxy runs them.

Contract: :meth:`Disaggregator.prepare` is called by the forwarder (one site) with the request's
parsed body, before the decode pool is picked. It sends the *prefill leg* to a replica of the
prefill pool (``--prefill-endpoints`` or ``--prefill-kube-service``): the same body with
``max_tokens`` 1, not streamed, and ``kv_transfer_params: {"do_remote_decode": true}``; that replica
computes the prompt, holds its blocks and answers ``kv_transfer_params``. The body returned for the
*decode leg* carries them, with ``remote_url`` (the prefill replica's base URL) and
``remote_signature`` (the router's, with the fleet secret: a replica sends its fleet auth to no URL
a client names) added; the forwarder
then sends it to the decode pool as any request (streaming, failover before the first byte,
mid-stream migration), and the decode replica pulls the blocks over ``/kv_blocks`` (fleet auth,
sealed frames) and decodes. The prefill leg's own token is dropped: the decode replica samples the
first token again from the pulled KV (greedy: the same token).

Failover: a prefill replica that fails (connect error, connection lost mid-request, HTTP 5xx, or
past ``prefill_timeout``) is ejected and the leg goes to the next prefill replica; when none is
left (or the prefill pool has none available), the original body is returned and the decode
replica computes the prompt itself (colocated). An answer without ``kv_transfer_params`` (a 4xx,
or a replica without a connector) is also run colocated: the decode replica answers the client's
error, if any, itself. Requests that are not two-leg material go through unchanged: other paths,
``n`` > 1, a body that already carries ``kv_transfer_params`` or a router resume, and prompts shorter
than ``--prefill-min-prompt-chars`` (computed where they decode: a short prompt costs the decode
replica less than the extra leg, as llm-d's prefill threshold has it).
"""

from __future__ import annotations

import copy
import json
import logging

import httpx

from kvfleet.runtime.kv_transfer.fleet_auth import FleetKeys
from kvfleet.runtime.router.endpoints import EndpointPool
from kvfleet.runtime.router.metrics import RouterMetrics
from kvfleet.runtime.router.picker import Picker
from kvfleet.runtime.router.prefix_key import prefix_key

logger = logging.getLogger("kvfleet.router")

TWO_LEG_PATHS = ("/v1/completions", "/v1/chat/completions")


def two_leg(method: str, path: str, body, min_prompt_chars: int = 0) -> bool:
    """Whether a request runs as prefill + decode legs (see the module doc)."""
    return (method == "POST" and path in TWO_LEG_PATHS and isinstance(body, dict)
            and body.get("n") in (None, 1) and body.get("kv_transfer_params") is None
            and body.get("kvfleet_resume") is None and prompt_chars(body) >= min_prompt_chars)


def prompt_chars(body: dict) -> int:
    """The prompt's size in characters (a completion's prompt, or the text of a chat's messages;
    a token id counts as 4)."""
    def size(x) -> int:
        if isinstance(x, str):
            return len(x)
        if isinstance(x, int):
            return 4
        if isinstance(x, list):
            return sum(size(v) for v in x)
        if isinstance(x, dict):
            return size(x.get("content") or x.get("text") or "")
        return 0

    return size(body.get("prompt") if "prompt" in body else body.get("messages"))


def prefill_body(body: dict) -> dict:
    """The prefill leg's body: one token, not streamed, asking the replica to hold the blocks."""
    out = copy.deepcopy(body)
    for key in ("stream_options", "max_completion_tokens", "min_tokens"):
        out.pop(key, None)
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


class Disaggregator:
    """Runs prefill legs on ``pool`` (the prefill replicas, probed by their own prober).

    Args:
        pool: the prefill replicas.
        client: the router's proxy client.
        metrics: the router's series (``kvfleet_router_prefill_legs_total{outcome}``).
        prefill_timeout: seconds one prefill leg may take on one replica.
        prefix_chars: characters of the prompt the prefill pool's prefix affinity covers.
        min_prompt_chars: shorter prompts run on the decode pool alone.
    """

    def __init__(self, pool: EndpointPool, client: httpx.AsyncClient, metrics: RouterMetrics | None = None, *,
                 fleet_keys: FleetKeys | None = None, prefill_timeout: float = 300.0, prefix_chars: int = 256,
                 min_prompt_chars: int = 0) -> None:
        self.pool = pool
        self.min_prompt_chars = min_prompt_chars
        self.fleet_keys = fleet_keys
        self.client = client
        self.metrics = metrics
        self.prefill_timeout = prefill_timeout
        self.prefix_chars = prefix_chars
        self.picker = Picker()  # prefix-hash (CHWBL affinity with bounded load) over the prefill pool

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.prefill_legs.labels(outcome).inc()

    async def prepare(self, method: str, path: str, headers: list[tuple[bytes, bytes]], body) -> dict | None:
        """The decode leg's body (``body`` with the prefill replica's ``kv_transfer_params``), the
        original ``body`` (colocated: no prefill replica could do it), or None (not two-leg material)."""
        if not two_leg(method, path, body, self.min_prompt_chars):
            return None
        leg = json.dumps(prefill_body(body)).encode()
        key = prefix_key(path, body, self.prefix_chars)
        tried: set[str] = set()
        while candidates := self.pool.available(exclude=tried):
            decision = self.picker.pick([e.candidate() for e in candidates], key, ring_keys=self.pool.urls())
            ep = self.pool.get(decision.key)
            assert ep is not None
            tried.add(ep.url)
            ep.in_flight += 1
            try:
                resp = await self.client.post(ep.url + path, content=leg, headers=headers,
                                              timeout=httpx.Timeout(self.prefill_timeout, connect=5.0))
            except httpx.HTTPError as exc:
                backoff = self.pool.eject(ep)
                logger.warning("prefill replica %s failed (%s: %s): ejected for %.1f s, trying another",
                               ep.url, type(exc).__name__, exc, backoff)
                self._count("retried")
                continue
            finally:
                ep.in_flight -= 1
            if resp.status_code >= 500:
                backoff = self.pool.eject(ep)
                logger.warning("prefill replica %s answered HTTP %d: ejected for %.1f s, trying another",
                               ep.url, resp.status_code, backoff)
                self._count("retried")
                continue
            self.pool.succeeded(ep)
            params = _params(resp)
            if params is None:
                self._count("colocated")
                return body
            self._count("success")
            return {**body, "kv_transfer_params": {**params, **self._signed(ep.url)}}
        logger.warning("no prefill replica could take the prefill leg: the decode replica computes the prompt")
        self._count("colocated")
        return body


    def _signed(self, url: str) -> dict[str, str]:
        """``remote_url`` and the router's signature of it (a replica fetches from no other URL)."""
        out = {"remote_url": url}
        if self.fleet_keys is not None:
            out["remote_signature"] = self.fleet_keys.sign_hint(url)
        return out


def _params(resp: httpx.Response) -> dict | None:
    """The prefill answer's ``kv_transfer_params`` when it holds blocks for a decode leg."""
    if resp.status_code != 200:
        return None
    try:
        params = resp.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) and params.get("do_remote_prefill") else None
