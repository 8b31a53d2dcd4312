"""Options of ``kvfleet router`` (command line; every option also as ``KVFLEET_ROUTER_<NAME>``).

Endpoints come from ``--endpoints URL,...`` (static) or ``--kube-service NAME`` (the
EndpointSlices of that Service, ready addresses only; :mod:`.endpointslices`). Everything else is
on with no flag (issue 42): prefix-aware routing from the replicas' KV events where they publish
them (``precise-prefix-cache``, the char-prefix CHWBL ring where they do not), signed peer hints
and mid-stream migration; flags only turn things off (``--routing-algorithm prefix-hash``,
``--no-kv-peer-hint``, ``--max-migrations 0``). Meanings and defaults: docs/routing.md.
An invalid value stops the router with argparse's exit status 2 and one line per problem naming
where it came from (``--port='abc': ...`` or ``KVFLEET_ROUTER_PORT='abc': ...``), as ``kvfleet serve``
does; an endpoint that is not an ``http(s)://host[:port]`` URL is such a problem.
"""

from __future__ import annotations

import argparse
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvfleet.runtime import env
from kvfleet.runtime.router.prefix_key import DEFAULT_PREFIX_CHARS
from kvfleet.runtime.router.routing import DEFAULT, NAMES, Algorithm, describe

ENV_PREFIX = env.ROUTER_OPTION.prefix


class RouterSettings(BaseModel):
    """Every option of ``kvfleet router``."""

    model_config = ConfigDict(extra="forbid")

    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    endpoints: list[str] = Field(default_factory=list)
    """Static replica base URLs (``http://127.0.0.1:8000``)."""
    kube_service: str | None = None
    """Watch this Service's EndpointSlices instead (in ``kube_namespace``)."""
    prefill_endpoints: list[str] = Field(default_factory=list)
    """Prefill/decode disaggregation (docs/routing.md): the prefill replicas' base URLs; the
    replicas of ``endpoints`` / ``kube_service`` are then the decode pool."""
    prefill_kube_service: str | None = None
    """The same, from this Service's EndpointSlices (in ``kube_namespace``)."""
    prefill_timeout: float = Field(300.0, gt=0)
    """Seconds one prefill leg may take on one prefill replica before the next one is tried."""
    prefill_min_prompt_chars: int = Field(0, ge=0)
    """Prompts shorter than this (characters) skip the prefill leg: the decode replica computes them."""
    kube_namespace: str | None = None
    """Namespace of ``kube_service`` (default: the pod's own, else ``default``)."""
    kube_port: str = "http"
    """Port of the EndpointSlices to use: its name, or its number."""
    routing_algorithm: Algorithm = DEFAULT
    """Default: the replicas' KV events where they publish them, else the char-prefix CHWBL ring."""
    kv_events_topic: str = ""
    """Topic of the replicas' KV events (their ``--kv-events-config`` topic)."""
    kv_peer_hint: bool = True
    """Read the replicas' KV events (any algorithm) and name, in ``x-kvfleet-kv-peer``, the replica
    caching a longer prefix than the chosen one (the replicas' ``--kv-transfer-config`` pulls it)."""
    fleet_secret_file: str | None = None
    """The fleet secret's file, for signing peer hints (None: ``$KVFLEET_FLEET_SECRET``, else
    ``~/.config/kvfleet/fleet-secret``; :mod:`kvfleet.runtime.kv_transfer.fleet_auth`)."""
    prefix_chars: int = Field(DEFAULT_PREFIX_CHARS, ge=1)
    load_factor: float = Field(1.25, ge=1.0)
    min_capacity: int = Field(4, ge=1)
    virtual_nodes: int = Field(100, ge=1, le=10000)
    max_pending: int = Field(1024, ge=0)
    pending_timeout: float = Field(300.0, gt=0)
    probe_interval: float = Field(1.0, gt=0)
    eject_base_seconds: float = Field(1.0, gt=0)
    eject_max_seconds: float = Field(30.0, gt=0)
    connect_timeout: float = Field(3.0, gt=0)
    shutdown_timeout: float = Field(30.0, ge=0)
    """Seconds a SIGTERM drain lets the requests in flight finish (vLLM's name); then the process exits."""
    max_migrations: int = Field(3, ge=0)
    """Moves of one stream to another replica mid-stream (0: never migrate; docs/routing.md)."""
    api_key: str | None = None
    """When set, the router itself checks ``Authorization: Bearer KEY`` on ``/v1/*``."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @field_validator("endpoints", "prefill_endpoints")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r} is not a replica base URL (http://host:port)")
        return urls

    @model_validator(mode="after")
    def _one_source(self) -> RouterSettings:
        if bool(self.endpoints) == bool(self.kube_service):
            raise ValueError("give exactly one of --endpoints and --kube-service")
        if self.prefill_endpoints and self.prefill_kube_service:
            raise ValueError("give at most one of --prefill-endpoints and --prefill-kube-service")
        return self

    @property
    def disaggregated(self) -> bool:
        """Whether requests run as prefill + decode legs (a prefill pool is given)."""
        return bool(self.prefill_endpoints or self.prefill_kube_service)


_HELP = {
    "endpoints": "comma-separated replica base URLs (static endpoints)",
    "kube_service": "Service whose EndpointSlices list the replicas (ready addresses only)",
    "prefill_endpoints": "prefill/decode disaggregation: comma-separated prefill replica base URLs (the replicas "
                         "of --endpoints / --kube-service are then the decode pool)",
    "prefill_kube_service": "prefill/decode disaggregation: Service whose EndpointSlices list the prefill replicas",
    "prefill_timeout": "seconds one prefill leg may take on one prefill replica before another is tried",
    "prefill_min_prompt_chars": "prompts shorter than this many characters skip the prefill leg (the decode replica "
                                "computes them; default 0: every prompt)",
    "kube_namespace": "namespace of --kube-service (default: this pod's namespace)",
    "kube_port": "EndpointSlice port to use, by name or number (default http)",
    "routing_algorithm": describe(),
    "kv_events_topic": "precise-prefix-cache: topic of the replicas' KV events",
    "kv_peer_hint": "tell the chosen replica (header x-kvfleet-kv-peer, signed with the fleet secret) which replica "
                    "caches a longer prefix of the prompt, from the replicas' KV events, so it pulls the KV instead "
                    "of recomputing it (default on; --no-kv-peer-hint: off)",
    "fleet_secret_file": "file of the fleet secret that signs peer hints (default: $KVFLEET_FLEET_SECRET, "
                         "else ~/.config/kvfleet/fleet-secret, created if missing)",
    "prefix_chars": "characters of the prompt the prefix key covers",
    "load_factor": "CHWBL bound: a replica takes at most ceil(load_factor * mean load) before its prefixes spill",
    "min_capacity": "a replica with fewer requests than this in flight never spills its prefixes (floor of the bound)",
    "virtual_nodes": "hash ring points per replica",
    "max_pending": "most requests held while no replica is ready; one more gets HTTP 429",
    "pending_timeout": "seconds a request is held at most; then HTTP 503",
    "probe_interval": "seconds between /ready + /metrics probes of each replica",
    "eject_base_seconds": "first ejection of a failed replica, seconds (doubles per failure)",
    "eject_max_seconds": "longest ejection, seconds",
    "connect_timeout": "seconds to connect to a replica before trying another",
    "shutdown_timeout": "seconds SIGTERM lets requests in flight finish (new ones get 503, /ready fails) "
                        "before the router exits",
    "max_migrations": "times one stream may move to another replica mid-stream (0: never migrate)",
    "api_key": "check 'Authorization: Bearer KEY' at the router (it is passed on to the replicas either way)",
    "host": "address to listen on",
    "port": "TCP port to listen on",
    "log_level": "log level",
}


def parse_args(argv: list[str], environ: dict[str, str] | None = None) -> RouterSettings:
    """Settings from ``argv`` over ``KVFLEET_ROUTER_*`` environment variables.

    Raises: SystemExit(2) with a message on invalid options (argparse's convention).
    """
    parser = argparse.ArgumentParser(prog="kvfleet router", description=(
        "Route OpenAI requests over kvfleet serve replicas: prefix affinity (CHWBL) with least load, "
        "failover, and a hold queue while no replica is ready. Options also as " + ENV_PREFIX + "<NAME>."))
    for name in RouterSettings.model_fields:
        flag = "--" + name.replace("_", "-")
        kw = {"dest": name, "default": argparse.SUPPRESS, "help": _HELP.get(name)}
        if name == "routing_algorithm":
            kw["choices"] = list(NAMES)
        if RouterSettings.model_fields[name].annotation is bool:
            kw["action"] = argparse.BooleanOptionalAction  # --kv-peer-hint / --no-kv-peer-hint
        parser.add_argument(flag, **kw)
    given = {k: v for k, v in vars(parser.parse_args(argv)).items()}
    values: dict[str, object] = {}
    where: dict[str, str] = {}
    for name in RouterSettings.model_fields:
        value = env.ROUTER_OPTION.read(name, environ)
        if name in given:
            values[name], where[name] = given[name], "--" + name.replace("_", "-")
        elif value is not None:
            values[name], where[name] = value, env.ROUTER_OPTION.name(name)
    for name in ("endpoints", "prefill_endpoints"):
        if isinstance(values.get(name), str):
            values[name] = [u.strip() for u in str(values[name]).split(",") if u.strip()]
    try:
        return RouterSettings(**values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            msg = str(err["msg"]).removeprefix("Value error, ")
            name = str(err["loc"][0]) if err["loc"] else ""
            problems.append(f"{where.get(name, name)}={values.get(name)!r}: {msg}" if name else msg)
        parser.error("invalid options:\n  " + "\n  ".join(problems))
        raise  # unreachable: parser.error exits
