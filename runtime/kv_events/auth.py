"""Who may read a replica's KV events, and whose events a router takes: ZMQ CURVE with keys of the fleet.

Contract: every holder of the fleet secret (:mod:`kvfleet.runtime.kv_transfer.fleet_auth`: the
replicas and routers of one InferenceService, or of one user on one machine) derives the same two
CURVE key pairs from its replica key (:func:`events_keys`): the *publisher's* (the replica's PUB
socket is a CURVE server with it) and the *reader's* (a router's SUB socket is a CURVE client with
it). So, with no flag:

- a subscriber must prove it holds the reader's secret key: the replica's ZAP handler
  (pyzmq's :class:`~zmq.auth.thread.ThreadAuthenticator`) lets in that one public key and refuses
  any other CURVE client (counted in :attr:`SecuredPublisher.refused`); a plaintext subscriber
  fails ZMTP's mechanism check. Everything on the wire is encrypted (block hashes say which
  prompts a replica caches).
- a router takes batches only from a publisher holding the publisher's secret key: a plaintext
  publisher (``"auth": "none"``, anything else listening at that port) or a CURVE server with
  another key fails the handshake before any message is delivered, and the router counts it
  (:func:`refusal_reason`: ``not_fleet``; libzmq reports a plaintext peer sometimes as a mechanism
  mismatch, sometimes as a dropped handshake, so the two are not told apart).

``{"auth": "none"}`` in ``--kv-events-config`` publishes in plaintext as vLLM does (for a reader
outside the fleet, e.g. an llm-d indexer); the router's ``--kv-events-auth none`` reads such
replicas. Key derivation is HMAC-SHA256 with a label per key; CURVE secret keys are any 32 bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from kvfleet.runtime.kv_transfer.fleet_auth import FleetKeys

logger = logging.getLogger(__name__)

AUTH_MODES = ("fleet", "none")
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
"""The socket monitor events of a refused peer (libzmq >= 4.3)."""


@dataclass(frozen=True)
class EventsKeys:
    """Z85-encoded CURVE keys (40 bytes each) of a fleet's KV events sockets."""

    publisher_public: bytes
    publisher_secret: bytes
    reader_public: bytes
    reader_secret: bytes


def _pair(fleet: FleetKeys, label: bytes) -> tuple[bytes, bytes]:
    secret = z85.encode(hmac.new(fleet.replica_key, label, hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def events_keys(fleet: FleetKeys) -> EventsKeys:
    """The fleet's KV events keys (the same in every process holding the fleet secret)."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support: KV events cannot be authenticated "
                           "(publish with {\"auth\": \"none\"} to send them in plaintext)")
    return EventsKeys(*_pair(fleet, b"kvfleet kv-events publisher v1"), *_pair(fleet, b"kvfleet kv-events reader v1"))


class _ReaderOnly:
    """ZAP credentials provider: only the fleet's reader key gets in; others are counted."""

    def __init__(self, reader_public: bytes) -> None:
        self.reader_public = reader_public
        self.refused = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:  # key: the client's public key, Z85
        if hmac.compare_digest(key, self.reader_public):
            return True
        with self._lock:
            self.refused += 1
            first = self.refused == 1
        if first:
            logger.warning("KV events: refused a subscriber without the fleet's reader key (counted in "
                           "kv_events_refused_subscribers; the first one is logged)")
        return False


class SecuredPublisher:
    """Makes ``sock`` (a PUB socket of ``ctx``, not bound yet) a CURVE server with the fleet's
    publisher key that lets in only the fleet's reader key. :meth:`stop` ends the ZAP thread."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, keys: EventsKeys) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self._allow = _ReaderOnly(keys.reader_public)
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self._allow)
        sock.curve_secretkey = keys.publisher_secret
        sock.curve_publickey = keys.publisher_public
        sock.curve_server = True

    @property
    def refused(self) -> int:
        """Subscribers refused so far (a CURVE client key that is not the fleet's reader key)."""
        return self._allow.refused

    def stop(self) -> None:
        self._auth.stop()


def secure_reader(sock: zmq.Socket, keys: EventsKeys) -> None:
    """Make ``sock`` (a SUB socket, not connected yet) a CURVE client of the fleet's publisher key."""
    sock.curve_serverkey = keys.publisher_public
    sock.curve_publickey = keys.reader_public
    sock.curve_secretkey = keys.reader_secret


def refusal_reason(event: int, value: int) -> str | None:
    """What a socket monitor event of a reader says about the publisher: ``not_fleet`` (the
    handshake failed: it speaks no CURVE, or does not hold the fleet's publisher key), None (no
    refusal)."""
    return "not_fleet" if event & HANDSHAKE_FAILED else None
