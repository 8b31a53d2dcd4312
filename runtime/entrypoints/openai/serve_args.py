"""Options of ``kvfleet serve``, from the command line, the environment and a config file.

Every option has three spellings, and the first one present wins:

1. command line: ``--max-num-seqs 64`` (booleans: ``--enable-prefix-caching`` /
   ``--no-enable-prefix-caching``);
2. environment: ``KVFLEET_MAX_NUM_SEQS=64`` (booleans: ``true``/``false``/``1``/``0``/
   ``yes``/``no``; an empty value counts as unset);
3. config file (``--config PATH`` or ``KVFLEET_CONFIG``): a YAML or JSON mapping whose keys
   are the option names in snake_case or kebab-case (``max_num_seqs: 64`` or
   ``max-num-seqs: 64``), as the operator writes them into a ConfigMap.

Engine options map 1:1 onto the fields of :class:`kvfleet.runtime.config.EngineConfig`;
server options (host, port, API key, queue limit, metrics naming, body size limit, shutdown and
probe bounds, termination log, log level) onto
:class:`ServerSettings`. ``kv_cache_memory`` and ``max_request_body_size`` also accept sizes
with a unit (``2GiB``, ``512MiB``, ``1.5G``, ``800M``; binary and decimal units).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvfleet.runtime import env
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.pooler_config import PoolerConfig

ENV_PREFIX = env.SERVE_OPTION.prefix

DEFAULT_DRAIN_HANDOFF_GRACE = 2.0
"""Seconds a SIGTERM drain lets router streams run before handing them off (issue 42). Measured
(tests/e2e/test_fleet_defaults.py, docs/routing.md "Drain hand-off"): a handed-off 200-token
stream's longest pause at the client -- the router's resume, the new replica's prefill of prompt +
delivered tokens under the load of the other streams -- was 0.7-1.9 s for the default model on the
shared 2-core Xeon. A stream that would end within about that pause gains nothing from moving, so
the grace matches it: streams about to end finish in place, the rest move at once, and a pod's
drain is bounded by preStop + 2 s rather than by its longest stream."""
DEFAULT_KV_EVENTS_CONFIG = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
                            "include_token_ids": False}
"""``kv_events_config`` when no source sets it: published on a free port the router reads from
``/kv_events/snapshot``; block hashes only (a router needs no prompt tokens). ``none`` turns it off."""
DEFAULT_KV_TRANSFER_CONFIG = {"kv_connector": "PeerPullConnector", "kv_role": "kv_both"}
"""``kv_transfer_config`` when no source sets it (and ``tensor_parallel_size`` is 1): ``/kv_blocks``
served to the fleet, a pull when the router's signed hint names a peer. ``none`` turns it off."""


class ServerSettings(BaseModel):
    """Options of the HTTP server itself (everything that is not an engine option)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "0.0.0.0"
    port: int = Field(8000, ge=0, le=65535)
    """TCP port; 0 picks a free one (printed in the log)."""
    api_key: str | None = None
    """When set, every ``/v1/*`` route and ``/reset_prefix_cache`` need
    ``Authorization: Bearer <api_key>``; ``/health``, ``/ready``, ``/metrics`` stay open."""
    max_queue_len: int | None = Field(None, ge=1)
    """Reject new requests with HTTP 429 while this many are waiting; None: unbounded."""
    metrics_compat: Literal["none", "vllm"] = "none"
    """``vllm``: also export every ``kvfleet:`` series under vLLM's ``vllm:`` name."""
    max_request_body_size: int = Field(32 * 1024**2, ge=1)
    """Largest request body the server reads, bytes (also ``32MiB``, ``8M``); a larger one is
    answered HTTP 413 without being read (``Content-Length`` checked first, chunked bodies
    counted as they arrive). Bounds the JSON parsing the event loop does for one request."""
    shutdown_timeout: float = Field(30.0, ge=0)
    """Seconds a SIGTERM waits for the requests in flight (vLLM's name); then their streams end."""
    drain_handoff_grace: float | None = Field(DEFAULT_DRAIN_HANDOFF_GRACE, ge=0)
    """Seconds a SIGTERM drain lets router-fronted streams run before handing them back to the
    router to migrate (None: they run until ``shutdown_timeout``, where they are handed off too)."""
    engine_iteration_timeout: float = Field(120.0, ge=1)
    """``/health`` fails while one engine step (its heartbeat) is older than this, seconds."""
    termination_log: str | None = None
    """Where a fatal engine error is written for the kubelet; None: ``/dev/termination-log`` if it exists."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    allow_runtime_lora_updating: bool = False
    """Serve ``POST /v1/load_lora_adapter`` / ``unload_lora_adapter`` (docs/lora.md); also set by
    vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``."""
    pooler_config: PoolerConfig = Field(default_factory=PoolerConfig)
    """How ``/v1/embeddings`` pools the decoder's hidden states (vLLM's ``--pooler-config``),
    JSON ``{"pooling_type": "LAST"|"MEAN", "normalize": true}``."""
    max_stored_responses: int = Field(1000, ge=0)
    """Responses kept for ``GET /v1/responses/{id}`` and ``previous_response_id`` (LRU, per replica)."""

    @field_validator("pooler_config", mode="before")
    @classmethod
    def _parse_pooler_config(cls, value):
        return PoolerConfig.parse(value) if isinstance(value, str) else value
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = None
    """How ``tool_choice: auto`` output is read into ``tool_calls`` (vLLM's ``--tool-call-parser``);
    ``hermes``: ``<tool_call>{json}</tool_call>``, ``llama3_json``: ``{"name", "parameters"}``,
    ``mistral``: ``[TOOL_CALLS][...]``. None: detected from the chat template at start-up
    (:func:`~.tool_calls.detect_tool_parser`); this overrides the detection."""
    enable_auto_tool_choice: bool = False
    """vLLM's flag, accepted with ``tool_call_parser`` (``auto`` works without it whenever a parser
    is given or detected)."""
    return_tokens_as_token_ids: bool = False
    """Logprobs name tokens ``"token_id:{id}"`` instead of their text (vLLM's flag; a request's own
    ``return_tokens_as_token_ids`` overrides it)."""
    chat_template: str | None = None
    """A Jinja chat template, or a file holding one (vLLM's ``--chat-template``): replaces the
    tokenizer's (a GGUF file or checkpoint without one gets chat). Checked at start: a file that
    cannot be read or a template that does not compile is an option error."""

    @field_validator("chat_template")
    @classmethod
    def _read_chat_template(cls, value: str | None) -> str | None:
        return None if value is None else read_chat_template(value)

    @model_validator(mode="after")
    def _auto_needs_parser(self) -> ServerSettings:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice requires tool_call_parser (e.g. --tool-call-parser hermes)")
        return self


_HELP = {
    "model": "checkpoint directory, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer path or hub id (default: the model's)",
    "served_model_name": "model name clients send and /v1/models lists (default: --model, or the default model's name)",
    "dtype": ("weights, activations and KV cache dtype (auto: float32 activations on a CPU, the fused "
              "decoder's, with bf16 weights where the CPU has native bf16; bfloat16 on a CPU: bf16 weights, "
              "float32 compute; bfloat16 on a GPU that has it, else float16)"),
    "quantization": "weight-only quantization of the linear layers (torchao): int8, or int4 (CPU only)",
    "device": "auto, cpu, cuda or cuda:N",
    "seed": "engine seed (requests without their own seed)",
    "kv_cache_dtype": ("KV cache dtype (vLLM's --kv-cache-dtype): auto (the activation dtype; bf16 where the "
                       "CPU's fused decoder runs its matmuls in bf16), float32, or "
                       "bfloat16 (CPU: half the cache bytes, activations stay float32; GPU: must equal --dtype)"),
    "block_size": "tokens per KV cache block",
    "num_blocks": "number of KV blocks (default: derived from the memory budget)",
    "gpu_memory_utilization": "fraction (0-1] of GPU memory the engine may use",
    "kv_cache_memory": "KV cache budget, bytes or with a unit (2GiB, 512MiB); CPU default 2GiB",
    "max_model_len": "longest prompt + output, tokens (default: the model's context length)",
    "max_num_seqs": "most sequences in one engine step",
    "max_num_batched_tokens": "token budget of one engine step",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "batch_invariant": "outputs independent of the batch (on; --no-batch-invariant: native bf16 prefill of "
                       "quantized/bf16 weights on AVX512-BF16 / AMX CPUs, faster, batch-dependent rounding)",
    "scheduling_policy": "order of admission: fcfs, priority (request field), fair (per tenant = user field)",
    "enable_chunked_prefill": "split long prompts over several steps",
    "tensor_parallel_size": "processes (GPUs) the model is split over by tensor parallelism (-tp; over --nnodes nodes)",
    "pipeline_parallel_size": "stages the layers are split into (-pp; each of tensor_parallel_size ranks; layers as "
                              "vLLM's get_pp_indices, $KVFLEET_PP_LAYER_PARTITION overrides)",
    "nnodes": "nodes the ranks run on (tensor_parallel_size * pipeline_parallel_size / nnodes each)",
    "node_rank": "this node's index (0: the leader, serves HTTP; others run --headless)",
    "master_addr": "address of node 0, where the ranks meet (with --nnodes > 1)",
    "master_port": "port of node 0's rendezvous store (with --nnodes > 1)",
    "headless": "no HTTP server, no scheduler: run node 0's steps on this node's ranks (node_rank >= 1)",
    "enforce_eager": "run the model eagerly; --no-enforce-eager compiles it (torch.compile) before /ready",
    "host": "address to listen on",
    "port": "TCP port to listen on",
    "api_key": "require 'Authorization: Bearer KEY' on /v1/* routes",
    "max_queue_len": "answer HTTP 429 while this many requests are waiting (default: unbounded)",
    "metrics_compat": "'vllm': also export the metrics under vLLM's names (vllm:...)",
    "max_request_body_size": "largest request body, bytes or with a unit (32MiB); larger ones get HTTP 413",
    "shutdown_timeout": "seconds SIGTERM waits for requests in flight (new ones get 503) before the process exits",
    "drain_handoff_grace": "seconds a SIGTERM drain lets streams behind a kvfleet router run before handing them "
                           f"back to the router to resume on another replica (default {DEFAULT_DRAIN_HANDOFF_GRACE:g}; "
                           "none: at --shutdown-timeout, where they are handed off either way)",
    "engine_iteration_timeout": "/health fails while an engine step has run this many seconds (a stuck engine)",
    "termination_log": "file the reason of a fatal engine error goes to (default /dev/termination-log if it exists)",
    "log_level": "log level of the server",
    "pooler_config": "embeddings pooling, JSON {\"pooling_type\": \"LAST\"|\"MEAN\", \"normalize\": true}",
    "max_stored_responses": "responses kept (LRU) for GET /v1/responses/{id} and previous_response_id",
    "tool_call_parser": "parser of tool_choice auto output into tool_calls: hermes, llama3_json, mistral "
    "(default: detected from the chat template)",
    "enable_auto_tool_choice": "vLLM's flag for tool_choice auto (on by default when a parser is given or detected)",
    "return_tokens_as_token_ids": "logprobs name tokens 'token_id:{id}' instead of their text (a request's "
                                  "own return_tokens_as_token_ids overrides it)",
    "chat_template": "a Jinja chat template, or a file holding one; replaces the tokenizer's (default: the model's)",
    "enable_lora": "serve LoRA adapters (a request names one in its model field)",
    "lora_modules": "LoRA adapters to load at start: name=path ... or JSON {\"name\",\"path\",\"base_model_name\"}",
    "max_loras": "most distinct LoRA adapters in one engine step",
    "max_lora_rank": "largest LoRA rank accepted",
    "max_cpu_loras": "LoRA adapters kept in host memory (default: max_loras)",
    "skip_failed_lora_modules": "log and skip --lora-modules entries that cannot be loaded (instead of failing)",
    "speculative_config": "speculative decoding, a JSON object: {\"method\": \"ngram\"|\"suffix\", "
                          "\"num_speculative_tokens\": k, \"prompt_lookup_max\": n, \"prompt_lookup_min\": n}",
    "kv_events_config": "KV cache events, a JSON object: {\"enable_kv_cache_events\": true, \"publisher\": "
                        "\"zmq\"|\"null\", \"endpoint\": \"tcp://*:5557\", \"topic\": \"\"} (default: on, ZMQ on a "
                        "free port the router discovers, block hashes only; none: off)",
    "kv_transfer_config": "peer KV pull, a JSON object: {\"kv_connector\": \"PeerPullConnector\", \"kv_role\": "
                          "\"kv_both\"|\"kv_producer\"|\"kv_consumer\", \"min_pull_blocks\": 4, "
                          "\"max_concurrent_pulls\": 2, \"pull_timeout\": 30} (default: kv_both, for the fleet "
                          "only; none: off)",
    "allow_runtime_lora_updating": "serve /v1/load_lora_adapter and /v1/unload_lora_adapter",
}

ENV_ALIASES = env.SERVE_OPTION.aliases
"""vLLM's environment variables read when kvfleet's own is unset."""


def read_chat_template(value: str) -> str:
    """``--chat-template``'s value as a template: ``value`` itself when it holds Jinja (``{``, ``}``
    or a newline), else the text of the file it names; compiled once here (transformers' sandboxed
    Jinja) so a broken one stops the start with its reason.

    Raises:
        ValueError: the file cannot be read, or the template does not compile.
    """
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    text = value
    if not any(c in value for c in "{}\n"):  # no Jinja in it: a file's name (vLLM reads it the same way)
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise ValueError(f"chat_template: cannot read the file {value}: {exc.strerror or exc}") from None
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateError as exc:
        raise ValueError(f"chat_template: not a valid Jinja template: {exc}") from None
    return text


def option_names() -> list[str]:
    """Every option name (snake_case): engine options first, then server options."""
    return list(EngineConfig.model_fields) + list(ServerSettings.model_fields)


def env_var(name: str) -> str:
    """Environment variable of an option: ``block_size`` -> ``KVFLEET_BLOCK_SIZE``."""
    return env.SERVE_OPTION.name(name)


def _is_bool(name: str) -> bool:
    f = EngineConfig.model_fields.get(name) or ServerSettings.model_fields[name]
    return f.annotation is bool


def _choices(name: str) -> list[str] | None:
    f = EngineConfig.model_fields.get(name) or ServerSettings.model_fields[name]
    if typing.get_origin(f.annotation) is Literal:
        return [str(x) for x in typing.get_args(f.annotation)]
    return None


def build_parser() -> argparse.ArgumentParser:
    """The ``kvfleet serve`` argument parser.

    Every option defaults to "not given" (argparse.SUPPRESS) so that the environment and the
    config file can fill what the command line leaves out.
    """
    parser = argparse.ArgumentParser(
        prog="kvfleet serve",
        description=(
            "Run the OpenAI-compatible inference server. Every option can also be set with an "
            f"environment variable ({ENV_PREFIX}<OPTION_IN_UPPER_SNAKE_CASE>) or a key of the "
            "--config file (snake_case or kebab-case); command line beats environment beats file."
        ),
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", metavar="PATH", help=f"YAML or JSON file of options (env {ENV_PREFIX}CONFIG)")
    for name in option_names():
        flags = ["--" + name.replace("_", "-"), *_SHORT_FLAGS.get(name, ())]
        help_ = f"{_HELP.get(name, name)} (env {env_var(name)})"
        if _is_bool(name):
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, help=help_)
        elif name == "lora_modules":  # vLLM's repeatable, multi-valued option
            parser.add_argument(*flags, dest=name, nargs="+", action="extend", metavar="NAME=PATH", help=help_)
        else:
            choices = _choices(name)
            metavar = "{" + ",".join(choices) + "}" if choices else name.upper()
            parser.add_argument(*flags, dest=name, metavar=metavar, choices=choices, help=help_)
    return parser


_SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",)}
"""vLLM's short spellings of options."""
_SIZE_OPTIONS = ("kv_cache_memory", "max_request_body_size")
"""Options that accept a size with a unit (:func:`parse_size`)."""
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(value: Any) -> Any:
    """``"2GiB"`` -> 2147483648, ``"800M"`` -> 800000000, ``"1024"`` -> 1024; other values unchanged.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (K, M, G, T, KB, ...)
    powers of 1000. A string that is not a size is returned as is (validation rejects it later).
    """
    if not isinstance(value, str):
        return value
    m = _SIZE_RE.match(value)
    if not m:
        return value
    number, unit, binary = m.groups()
    power = "kmgt".find(unit.lower()) + 1 if unit else 0
    base = 1024 if binary else 1000
    return int(float(number) * base**power)


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Options from a YAML/JSON file, keys normalised to snake_case.

    Raises:
        ValueError: unreadable file, not a mapping, or an unknown key (the message lists the
            valid ones).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read config file {str(p)!r}: {exc}") from None
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        kind = "JSON" if p.suffix == ".json" else "YAML"
        raise ValueError(f"config file {str(p)!r} is not valid {kind}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(p)!r} must hold a mapping of options, got {type(data).__name__}")
    known = set(option_names())
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ValueError(
                f"config file {str(p)!r}: unknown option {key!r}; valid options: {', '.join(sorted(known))}"
            )
        out[name] = value
    return out


@dataclass
class ServeArgs:
    """The resolved options of one ``kvfleet serve``."""

    engine: EngineConfig
    server: ServerSettings
    sources: dict[str, str] = field(default_factory=dict)
    """option name -> where its value came from: ``cli``, ``env``, ``file`` (absent: default)."""


class ServeArgsError(ValueError):
    """Invalid options; the message names each option, its value's source and the problem."""


def resolve(
    cli: Mapping[str, Any], environ: Mapping[str, str] | None, file_values: Mapping[str, Any]
) -> ServeArgs:
    """Merge the three sources (CLI > env > file) and validate.

    Raises:
        ServeArgsError: a value of the wrong type or out of range.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in option_names():
        if name in cli:
            values[name], sources[name] = cli[name], "cli"
        elif (value := env.SERVE_OPTION.read(name, environ)) is not None:
            values[name], sources[name] = value, "env"
        elif name in file_values:
            values[name], sources[name] = file_values[name], "file"
    for name in _SIZE_OPTIONS:
        if name in values:
            values[name] = parse_size(values[name])
    _fleet_defaults(values)
    # Strings from the command line / env are coerced by pydantic's lax mode ("16" -> 16,
    # "false" -> False, "0.5" -> 0.5); an explicit "none" / "null" unsets an optional field.
    for name, value in list(values.items()):
        if isinstance(value, str) and value.lower() in ("none", "null"):
            values[name] = None
    engine_values = {k: v for k, v in values.items() if k in EngineConfig.model_fields}
    server_values = {k: v for k, v in values.items() if k in ServerSettings.model_fields}
    problems: list[str] = []
    engine = server = None
    for model, vals in ((EngineConfig, engine_values), (ServerSettings, server_values)):
        try:
            built = model.model_validate(vals)
        except ValidationError as exc:
            for err in exc.errors():
                if not err["loc"]:  # a rule over several options (a model validator): its message names them
                    problems.append(str(err["msg"]).removeprefix("Value error, "))
                    continue
                name = str(err["loc"][0])
                where = {"cli": f"--{name.replace('_', '-')}", "env": env_var(name), "file": f"config key {name}"}
                problems.append(f"{where.get(sources.get(name, ''), name)}={vals.get(name)!r}: {err['msg']}")
            continue
        if model is EngineConfig:
            engine = built
        else:
            server = built
    if problems:
        raise ServeArgsError("invalid options:\n  " + "\n  ".join(problems))
    return ServeArgs(engine=engine, server=server, sources=sources)  # type: ignore[arg-type]


def _fleet_defaults(values: dict[str, Any]) -> None:
    """KV events and peer KV pull when no source sets them (issue 42; docs/server.md): a replica
    is a member of its fleet with no flag. Peer pull is left off with ``tensor_parallel_size`` or
    ``pipeline_parallel_size`` > 1 (each rank caches a share of the heads or of the layers)."""
    values.setdefault("kv_events_config", dict(DEFAULT_KV_EVENTS_CONFIG))
    if "kv_transfer_config" not in values:
        try:
            ranks = int(values.get("tensor_parallel_size", 1) or 1) * int(values.get("pipeline_parallel_size", 1) or 1)
        except (TypeError, ValueError):
            return  # the bad value's own error says what is wrong
        if ranks == 1:
            values["kv_transfer_config"] = dict(DEFAULT_KV_TRANSFER_CONFIG)


def parse_serve_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> ServeArgs:
    """Parse ``kvfleet serve`` options (see the module docstring for the precedence).

    Raises:
        SystemExit: on ``--help`` (status 0) or a usage error (status 2, message on stderr),
            including invalid values from the environment or the config file.
    """
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    config_path = ns.pop("config", None) or env.CONFIG.raw(environ)
    try:
        file_values = load_config_file(config_path) if config_path else {}
        return resolve(ns, environ, file_values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
