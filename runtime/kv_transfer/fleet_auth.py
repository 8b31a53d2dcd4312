"""The fleet secret: who may name a peer, who may read ``/kv_blocks``, whose KV blocks are taken.

Peer KV pull moves KV blocks between the replicas of one fleet (docs/routing.md, "Peer KV pull").
Three things must hold, or a client that reaches a replica could make it send requests anywhere
its network reaches (SSRF) and poison its prefix cache with a fake peer's garbage K/V:

1. **Hints come from the router only.** The router signs ``x-kvfleet-kv-peer: URL`` with
   ``x-kvfleet-kv-peer-signature: t=<unix seconds>,v1=<hex>`` (HMAC-SHA256 with the fleet's hint
   key over the timestamp and the URL). A replica takes a hint only when the signature verifies
   and is at most :data:`MAX_AGE` seconds old; anything else is ignored, counted by reason
   (``unsigned``, ``signature``, ``expired``, ``malformed``, ``no_secret``), and never fetched.
2. **``/kv_blocks`` is served to the fleet only.** A pull carries ``x-kvfleet-fleet-auth:
   t=<unix seconds>,n=<nonce>,v1=<hex>`` (HMAC with the replica key over the timestamp and a fresh
   nonce); a replica answers 403 to anything else.
3. **Blocks are taken from replicas only.** The answer ends with a seal, ``b"KVM1"`` and the
   HMAC-SHA256, keyed by the replica key and the pull's nonce, of every byte of frames before it
   (:class:`Sealer`, checked by :class:`~kvfleet.runtime.kv_transfer.wire.FrameReader`). An
   address that the router named but that holds no replica key (a recycled pod IP, anything
   else listening there) cannot seal, and its frames are refused (``not_replica``): nothing of
   them is installed. The seal binds the frames to this pull (the nonce), so a recorded answer
   cannot be replayed.

The secret: ``$KVFLEET_FLEET_SECRET`` (the operator mounts its Secret there), else the file
``fleet_secret_file`` names, else ``$XDG_CONFIG_HOME/kvfleet/fleet-secret`` (``~/.config``),
created with a random secret (mode 0600) by the first kvfleet process of this user that needs it:
every ``kvfleet serve`` and ``kvfleet router`` of one user on one machine is then one fleet with
no flag. With no secret to be had (no such file and no writable home), hints, ``/kv_blocks`` and
pulls are off (logged). The hint key and the replica key are derived from the secret
(HMAC-SHA256 with a label each). Stdlib only, torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from pathlib import Path

from kvfleet.runtime import env

logger = logging.getLogger(__name__)

SECRET_ENV = env.FLEET_SECRET.name
HINT_SIGNATURE_HEADER = "x-kvfleet-kv-peer-signature"
FLEET_AUTH_HEADER = "x-kvfleet-fleet-auth"
SEAL_MAGIC = b"KVM1"
SEAL_BYTES = len(SEAL_MAGIC) + 32
MAX_AGE = 60.0
"""Seconds a hint signature or a pull's auth stays valid (clock skew between pods included)."""
MIN_SECRET_BYTES = 16


class FleetKeys:
    """The keys of one fleet, derived from its secret (at least :data:`MIN_SECRET_BYTES` bytes)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the fleet secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self.hint_key = hmac.new(secret, b"kvfleet kv-peer hint v1", hashlib.sha256).digest()
        self.replica_key = hmac.new(secret, b"kvfleet replica v1", hashlib.sha256).digest()

    # --------------------------------------------------------------- router -> replica: the hint

    def sign_hint(self, peer_url: str, now: float | None = None) -> str:
        """The ``x-kvfleet-kv-peer-signature`` value for a hint naming ``peer_url``."""
        t = int(time.time() if now is None else now)
        mac = hmac.new(self.hint_key, f"{t}\n{peer_url}".encode(), hashlib.sha256).hexdigest()
        return f"t={t},v1={mac}"

    def check_hint(self, peer_url: str, signature: str | None, now: float | None = None) -> str | None:
        """None when ``signature`` is the router's for ``peer_url`` and fresh; else why not."""
        if not signature:
            return "unsigned"
        fields = _fields(signature)
        if fields is None or "t" not in fields or "v1" not in fields or not fields["t"].isdigit():
            return "malformed"
        want = hmac.new(self.hint_key, f"{fields['t']}\n{peer_url}".encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, fields["v1"]):
            return "signature"
        if abs((time.time() if now is None else now) - int(fields["t"])) > MAX_AGE:
            return "expired"
        return None

    # --------------------------------------------------------------- puller -> peer: the pull

    def pull_auth(self, now: float | None = None) -> tuple[str, bytes]:
        """``(x-kvfleet-fleet-auth value, nonce)`` for one pull."""
        t, nonce = int(time.time() if now is None else now), secrets.token_hex(16)
        return f"t={t},n={nonce},v1={self._pull_mac(t, nonce)}", nonce.encode()

    def check_pull_auth(self, value: str | None, now: float | None = None) -> bytes | None:
        """The pull's nonce when ``value`` is a fresh fleet auth, else None."""
        fields = _fields(value or "")
        if fields is None or not {"t", "n", "v1"} <= fields.keys() or not fields["t"].isdigit():
            return None
        if not hmac.compare_digest(self._pull_mac(int(fields["t"]), fields["n"]), fields["v1"]):
            return None
        if abs((time.time() if now is None else now) - int(fields["t"])) > MAX_AGE:
            return None
        return fields["n"].encode()

    def _pull_mac(self, t: int, nonce: str) -> str:
        return hmac.new(self.replica_key, f"kv_blocks\n{t}\n{nonce}".encode(), hashlib.sha256).hexdigest()

    def seal_key(self, nonce: bytes) -> bytes:
        """The key of the seal of the answer to the pull with ``nonce``."""
        return hmac.new(self.replica_key, b"seal\n" + nonce, hashlib.sha256).digest()


class Sealer:
    """The serving side's running MAC: :meth:`add` every frame sent, then send :meth:`seal`."""

    def __init__(self, key: bytes) -> None:
        self._mac = hmac.new(key, digestmod=hashlib.sha256)

    def add(self, data: bytes) -> bytes:
        self._mac.update(data)
        return data

    def seal(self) -> bytes:
        return SEAL_MAGIC + self._mac.digest()


def _fields(value: str) -> dict[str, str] | None:
    out = {}
    for part in value.split(","):
        key, sep, val = part.strip().partition("=")
        if not sep or not key or not val:
            return None
        out[key] = val
    return out


def default_secret_file() -> Path | None:
    base = os.environ.get("XDG_CONFIG_HOME") or (os.path.join(os.path.expanduser("~"), ".config")
                                                 if os.path.expanduser("~") != "~" else None)
    return Path(base) / "kvfleet" / "fleet-secret" if base else None


def _read_or_create(path: Path) -> bytes:
    """The secret in ``path``; a fresh random one written there first when it does not exist
    (atomically: a process that loses the race reads the winner's)."""
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, path)  # fails if another process created it meanwhile
            logger.info("created the fleet secret %s (every kvfleet process of this user shares it)", path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes().strip()


def load_fleet_keys(secret_file: str | None = None, environ=None) -> FleetKeys | None:
    """The fleet's keys from ``$KVFLEET_FLEET_SECRET``, ``secret_file`` or the default file (see
    the module docstring); None (logged) when there is no secret to be had.

    Raises:
        ValueError: a secret shorter than :data:`MIN_SECRET_BYTES`, or a ``secret_file`` that
            cannot be read (given explicitly, it must exist)."""
    value = env.FLEET_SECRET.get(environ)
    if value:
        return FleetKeys(value.encode())
    if secret_file:
        try:
            return FleetKeys(Path(secret_file).read_bytes().strip())
        except OSError as exc:
            raise ValueError(f"fleet_secret_file {secret_file!r}: {exc}") from None
    path = default_secret_file()
    try:
        if path is None:
            raise OSError("no home directory")
        return FleetKeys(_read_or_create(path))
    except OSError as exc:
        logger.warning("no fleet secret (%s, %s): peer KV hints, /kv_blocks and pulls are off", path, exc)
        return None
