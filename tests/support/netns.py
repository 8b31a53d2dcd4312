"""Two "nodes" on one machine with their own network stacks: this process's namespace (node 0)
and a network namespace (node 1) joined by a veth pair, so a multi-node test's ranks talk over a
real link between two addresses instead of loopback. Needs root and iproute2; :func:`two_nodes`
yields None where it cannot make one (the test then runs over 127.0.0.1 and says so)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class TwoNodes:
    leader_addr: str
    """Node 0's address on the link (``--master-addr``)."""
    leader_ifname: str
    worker_ifname: str
    """Each node's interface on the link: its ranks' ``GLOO_SOCKET_IFNAME``."""
    worker_prefix: list[str]
    """Runs a command in node 1's namespace (``ip netns exec NAME``)."""


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def two_nodes() -> Iterator[TwoNodes | None]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        yield None
        return
    tag = f"kvf{os.getpid() % 100000}"
    ns, a, b = f"{tag}-n1", f"{tag}a", f"{tag}b"
    steps = [("netns", "add", ns), ("link", "add", a, "type", "veth", "peer", "name", b),
             ("link", "set", b, "netns", ns), ("addr", "add", "10.213.0.1/30", "dev", a), ("link", "set", a, "up"),
             ("netns", "exec", ns, "ip", "addr", "add", "10.213.0.2/30", "dev", b),
             ("netns", "exec", ns, "ip", "link", "set", b, "up"), ("netns", "exec", ns, "ip", "link", "set", "lo", "up")]
    try:
        made = all(_ip(*step).returncode == 0 for step in steps)
        yield TwoNodes("10.213.0.1", a, b, ["ip", "netns", "exec", ns]) if made else None
    finally:
        _ip("link", "del", a)
        _ip("netns", "del", ns)
