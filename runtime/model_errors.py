"""Why a model cannot be served: the load errors a user fixes in the model they point at.

A load that fails because of the model itself (a file that is not what its name says, a
truncated file, a tensor type or an architecture kvfleet cannot run) raises :class:`ModelLoadError`
with one of :data:`REASONS`, or an error of the file's reader that carries a ``reason`` attribute
(:func:`reason_for`: the GGUF reader's ``GgufError``, the packed checkpoints' ``PackedError``).
``kvfleet serve`` then logs one ERROR line (the file and what is wrong; no traceback), writes
``REASON: message`` as its termination log and exits 1; the operator turns a crash-looping runtime
pod whose last termination message starts with a reason into a status condition with that reason
(``kvfleet.operator.status``). Torch-free: the operator imports it.
"""

from __future__ import annotations

UNSUPPORTED_ARCHITECTURE = "UnsupportedArchitecture"
"""The model's architecture (``model_type``, a GGUF file's ``general.architecture``) is one this
kvfleet cannot run."""
INVALID_MODEL_FILE = "InvalidModelFile"
"""The file is not a valid checkpoint: wrong magic, truncated, an unknown tensor type, a tensor
whose size does not match its shape."""
UNSUPPORTED_QUANTIZATION = "UnsupportedQuantization"
"""The checkpoint's ``quantization_config`` (or a GGUF tensor type) names a format kvfleet does not read."""
REASONS = (UNSUPPORTED_ARCHITECTURE, INVALID_MODEL_FILE, UNSUPPORTED_QUANTIZATION)


class ModelLoadError(Exception):
    """A model that cannot be loaded, for :attr:`reason` (one of :data:`REASONS`)."""

    def __init__(self, reason: str, source: str, detail: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown model load reason {reason!r}")
        super().__init__(f"{source}: {detail}")
        self.reason = reason
        self.source = source
        self.detail = detail

    def line(self) -> str:
        """``REASON: source: detail`` on one line (the termination log, the ERROR line)."""
        return f"{self.reason}: {self}".replace("\n", " ")


def reason_for(exc: BaseException) -> str | None:
    """The reason of a load error: a :class:`ModelLoadError`'s, or the ``reason`` attribute of an
    error about the model file (the GGUF reader's ``GgufError``, the packed checkpoints'
    ``PackedError``), or None."""
    reason = getattr(exc, "reason", None)
    return reason if reason in REASONS else None


def reason_of(message: str) -> str | None:
    """The reason a termination message starts with (``REASON: ...``), or None."""
    head = message.strip().split(":", 1)[0]
    return head if head in REASONS else None
