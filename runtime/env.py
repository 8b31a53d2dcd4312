"""Every ``KVFLEET_*`` environment variable kvfleet reads: one table and its typed getters.

Contract:

- Each variable is declared here once, as an :class:`EnvVar` (name, type, default, doc), or, for
  the two option families (``KVFLEET_<OPTION>`` of ``kvfleet serve``, ``KVFLEET_ROUTER_<OPTION>``
  of ``kvfleet router``), as an :class:`EnvFamily` whose members the option parsers own.
- Getters read the environment at call time (``os.environ`` by default, or the mapping given), so
  a test's ``monkeypatch.setenv`` counts. A module that wants a value fixed at import (a timeout
  constant, as before the registry) assigns ``X = env.NAME.get()`` itself.
- Unset or blank: the default. A value that does not parse: :class:`EnvError` (a ``ValueError``)
  naming the variable, its value and what was expected; nothing is guessed.
- Names the operator writes into pods come from here too (``env.CACHE_DIR.name``,
  ``env.SERVE_OPTION.name("api_key")``), so a rename is one line.
- Outside this module no kvfleet module reads ``os.environ`` / ``os.getenv`` for a ``KVFLEET_*``
  name (tests/repo/test_env_registry.py, an AST scan).
- ``python -m kvfleet.runtime.env`` prints the Markdown table docs/configuration.md holds
  (tests/repo/test_env_registry.py checks it is current).

Standard library only: kernels/, operator/ and the router import it (docs/architecture.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")

PREFIX = "KVFLEET_"


class EnvError(ValueError):
    """A ``KVFLEET_*`` variable's value does not parse; the message names the variable."""


_SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True,
                 "0": False, "false": False, "no": False, "off": False}


def _switch(text: str) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case); anything else is an
    error, never silently "on"."""
    try:
        return _SWITCH_WORDS[text.lower()]
    except KeyError:
        raise ValueError(f"a switch is one of {', '.join(_SWITCH_WORDS)}") from None


def _path(text: str) -> Path:
    return Path(text).expanduser()


_KINDS: dict[str, Callable[[str], Any]] = {
    "str": str, "int": int, "float": float, "path": _path, "switch": _switch,
}


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One variable: ``name``, the parse ``kind`` (str, int, float, path (``~`` expanded) or switch
    (1/0, true/false, yes/no, on/off)), its ``default`` (returned when unset or blank; a callable is called
    then), ``doc``, and for a str variable its allowed values (``choices``; empty: any)."""

    name: str
    kind: str
    default: T
    doc: str
    choices: tuple[str, ...] = ()
    lower: bool = False
    """Lower-case the value before the choices check (and return it lower-cased)."""

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The stripped value, or None when unset or blank."""
        value = (os.environ if environ is None else environ).get(self.name, "").strip()
        return value or None

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The typed value (the default when unset or blank).

        Raises:
            EnvError: the value does not parse, or is not one of ``choices``.
        """
        text = self.raw(environ)
        if text is None:
            return self.default() if callable(self.default) else self.default
        if self.lower:
            text = text.lower()
        if self.choices and text not in self.choices:
            raise EnvError(f"{self.name}={text!r}: expected one of {', '.join(self.choices)}")
        try:
            return _KINDS[self.kind](text)
        except ValueError as exc:
            raise EnvError(f"{self.name}={text!r}: expected {self.kind} ({exc})") from None


@dataclass(frozen=True)
class EnvFamily:
    """``prefix + OPTION`` for every option of a command (its parser owns the option list and
    their types; strings here, validated there)."""

    prefix: str
    doc: str
    members: str = ""
    """Where the option list lives (for the docs table)."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """option -> another program's variable read when ours is unset (vLLM's names)."""

    def name(self, option: str) -> str:
        """``api_key`` -> ``<prefix>API_KEY``."""
        return self.prefix + option.upper()

    def read(self, option: str, environ: Mapping[str, str] | None = None) -> str | None:
        """The stripped value of ``option``'s variable, else of its alias; None when both are unset
        or blank."""
        environ = os.environ if environ is None else environ
        for name in (self.name(option), self.aliases.get(option)):
            value = environ.get(name, "").strip() if name else ""
            if value:
                return value
        return None


_REGISTRY: dict[str, EnvVar] = {}


def _var(name: str, kind: str, default: Any, doc: str, **kw: Any) -> EnvVar:
    if name in _REGISTRY:
        raise ValueError(f"{name} is declared twice")
    if kind not in _KINDS:
        raise ValueError(f"{name}: unknown kind {kind!r}")
    var = EnvVar(PREFIX + name, kind, default, doc, **kw)
    _REGISTRY[var.name] = var
    return var


# --- files and folders -------------------------------------------------------------------------
CACHE_DIR = _var("CACHE_DIR", "path", lambda: Path.home() / ".cache" / "kvfleet",
                 "kvfleet's cache: converted GGUF checkpoints (gguf/), LoRA downloads (lora/), the C "
                 "kernels built at first use (kernels/), inductor's cache (inductor/).")
KERNELS_DIR = _var("KERNELS_DIR", "path", None,
                   "A folder of prebuilt C kernel libraries (the images' /opt/kvfleet/kernels): a "
                   "library found there is loaded and nothing is compiled.")
PEERS_DIR = _var("PEERS_DIR", "path", Path(".peers"),
                 "`kvfleet bench peers`: where the peer systems (llama.cpp, vLLM) are installed.")
FLEET_SECRET = _var("FLEET_SECRET", "str", None,
                    "The fleet's shared secret (signs peer hints and KV pulls); the operator mounts its "
                    "Secret here. Unset: ~/.config/kvfleet/fleet-secret (created if missing).")
CONFIG = _var("CONFIG", "path", None, "`kvfleet serve`: a YAML or JSON file of options (as --config).")

# --- CPU kernels -------------------------------------------------------------------------------
CPU_ISA = _var("CPU_ISA", "str", None,
               "Caps the CPU features the C kernels use (a level and those below it; unset: all this "
               "CPU has).", choices=("avx2", "avx512", "avx512_bf16", "amx"))
CPU_MATMUL = _var("CPU_MATMUL", "str", None,
                  "Where the CPU plan chose bf16 matmuls, the fused decoder's kernels instead (where the "
                  "CPU or library lacks them: float32). Unset: the plan's.",
                  choices=("float32", "avx512_bf16", "amx"))
CPU_DECODER = _var("CPU_DECODER", "switch", True,
                   "0 turns the fused C decode path off (every step runs transformers' modules).")
CPU_FUSED_PREFILL = _var("CPU_FUSED_PREFILL", "str", None,
                         "1 runs prefill chunks and mixed steps on the fused path too, 0 never; unset: "
                         "fused where its matmuls run in bf16.", choices=("0", "1"))
CPU_WOQ = _var("CPU_WOQ", "switch", True,
               "0 keeps weight-only quantized layers off kvfleet's C kernels (torch's matmuls instead).")
CPU_WOQ_PARALLEL_MIN = _var("CPU_WOQ_PARALLEL_MIN", "int", 1 << 16,
                            "Layers with fewer weights run on one thread in the weight-only ops.")
CPU_SPIN_US = _var("CPU_SPIN_US", "int", 200,
                   "Microseconds a fused-decoder helper thread spins after its last task before it sleeps.")
ATTENTION_BACKEND = _var("ATTENTION_BACKEND", "str", "auto",
                         "Attention kernels: auto (triton on CUDA, torch elsewhere), torch or triton.",
                         choices=("auto", "torch", "triton"), lower=True)
COMPILE_BACKEND = _var("COMPILE_BACKEND", "str", "inductor",
                       "torch.compile's backend for compiled forwards (eager: dynamo only, for smoke tests).")

# --- workers -----------------------------------------------------------------------------------
TP_WORKER_THREADS = _var("TP_WORKER_THREADS", "int", 1,
                         "Torch threads of each tensor-parallel worker process (OMP_NUM_THREADS of a "
                         "multi-node rank).")
TP_STARTUP_TIMEOUT = _var("TP_STARTUP_TIMEOUT", "float", 600.0,
                          "Seconds tensor-parallel workers may take to start (read at import).")
MULTINODE_HEARTBEAT_TIMEOUT = _var("MULTINODE_HEARTBEAT_TIMEOUT", "float", 3.0,
                                   "Seconds without a heartbeat after which a multi-node rank counts as "
                                   "lost and the replica fails (read at import).")
PP_LAYER_PARTITION = _var("PP_LAYER_PARTITION", "str", None,
                          "Pipeline parallelism: the layers of each stage, comma-separated (vLLM's "
                          "VLLM_PP_LAYER_PARTITION, e.g. 3,1); unset: vLLM's get_pp_indices split.")
LORA_FETCH_TIMEOUT = _var("LORA_FETCH_TIMEOUT", "float", 600.0,
                          "Seconds one download attempt of an hf:// LoRA adapter may take (read at import).")

# --- operator ----------------------------------------------------------------------------------
RUNTIME_IMAGE = _var("RUNTIME_IMAGE", "str", None,
                     "Operator: the runtime image of InferenceServices without spec.runtime.image.")
ROUTER_IMAGE = _var("ROUTER_IMAGE", "str", None,
                    "Operator: the router image of InferenceServices without spec.router.image "
                    "(unset: the runtime image).")
ADAPTER_LOAD_TIMEOUT = _var("ADAPTER_LOAD_TIMEOUT", "float", 120.0,
                            "Operator: seconds one LoRA adapter load on a replica may take (read at import).")
AUTOSCALER_INTERVAL = _var("AUTOSCALER_INTERVAL", "float", None,
                           "Operator: seconds between autoscaler steps, at least 0.1 (unset: the spec's "
                           "autoscaling.metrics.intervalSeconds, else 15).")
PEERING_LIFETIME = _var("PEERING_LIFETIME", "int", 30,
                        "Operator: seconds kopf's peering record lives (one active operator among its replicas).")

# --- option families ---------------------------------------------------------------------------
SERVE_OPTION = EnvFamily(PREFIX, "`kvfleet serve`'s option OPTION (command line beats environment beats "
                         "--config file); e.g. KVFLEET_MAX_NUM_SEQS=64, KVFLEET_API_KEY.",
                         "kvfleet serve --help; docs/server.md",
                         aliases={"allow_runtime_lora_updating": "VLLM_ALLOW_RUNTIME_LORA_UPDATING"})
ROUTER_OPTION = EnvFamily(PREFIX + "ROUTER_", "`kvfleet router`'s option OPTION (command line beats "
                          "environment); e.g. KVFLEET_ROUTER_API_KEY.", "kvfleet router --help; docs/routing.md")
FAMILIES = (SERVE_OPTION, ROUTER_OPTION)


def check_all(environ: Mapping[str, str] | None = None) -> list[str]:
    """One message per declared variable whose value does not parse (empty: all good). Run once at
    start (``kvfleet`` does, before any command loads a model), so a bad value fails in the first
    second, not when a deep module first reads it."""
    errors = []
    for var in _REGISTRY.values():
        try:
            var.get(environ)
        except EnvError as exc:
            errors.append(str(exc))
    return errors


def registry() -> dict[str, EnvVar]:
    """Every declared variable by name, in declaration order."""
    return dict(_REGISTRY)


def _default_text(var: EnvVar) -> str:
    default = var.default() if callable(var.default) else var.default
    if default is None:
        return "unset"
    if isinstance(default, Path):
        home = str(Path.home())
        text = str(default)
        return "~" + text[len(home):] if text.startswith(home) else text
    if var.kind == "switch":
        return "on"
    return str(default)


def table() -> str:
    """docs/configuration.md's table: every variable, then the two option families."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for var in _REGISTRY.values():
        kind = " \\| ".join(var.choices) if var.choices else var.kind
        rows.append(f"| `{var.name}` | {kind} | {_default_text(var)} | {var.doc} |")
    for fam in FAMILIES:
        also = "".join(f" {fam.name(o)} unset: {a}." for o, a in fam.aliases.items())
        rows.append(f"| `{fam.prefix}<OPTION>` | option | the option's | {fam.doc} Options: {fam.members}.{also} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
