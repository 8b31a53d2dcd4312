"""A rolling update that hands its streams off instead of waiting for them (issue 27): ``kvfleet
operator`` (a process) on the API emulator, tests/support/kubelet.py running the operator's router
pods as real ``kvfleet router`` processes and the runtime pods as real ``kvfleet serve`` processes
(``rollout="surge"``: maxSurge / maxUnavailable as the Deployment controller plays them).

A default InferenceService (issue 42: the router, the peer tier, the fleet Secret and the 2 s drain
hand-off are all the defaults; no ``router`` or ``drain_handoff_grace`` in the manifest) with
``rollout.strategy: ResourceAware`` (maxSurge 0, maxUnavailable 1) and two replicas. 16 long
greedy chat streams go through the router
pods (round robin, as the ``<name>-router`` Service spreads clients) with the official ``openai``
SDK, retries off (a resent request would hide a cut); once every stream has tokens, a spec change
(``maxModelLen``) rolls the runtime pods one at a time. Checked:

- 0 cut streams: every stream ends with all its ``max_tokens`` (usage) and ``finish_reason: length``;
- the routers migrated streams for the draining replicas: ``router_migrations_total{reason="drain"}`` > 0;
- the roll did not wait for the streams: each old pod exits within preStop + the grace + a margin
  after leaving the endpoints, the roll (spec change -> both new pods ready, both old pods gone,
  the InferenceService Ready for the new generation) is bounded by preStop + grace per pod (one
  pod after the other: maxSurge 0) + two pod starts + a margin, and every stream was still
  running when it ended.

The pods' preStop sleep is shortened to 2 s (``prestop_seconds``; tests/e2e/test_rollout.py rolls
with the real 10 s): the sleep only delays the hand-off, and CI time is short.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.kube_emulator import ISVC
from support.kubelet import TestKubelet
from support.operator_process import running_operator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NS, NAME, MODEL, STREAMS = "default", "handoff", "smollm2", 16
OLD_LEN, NEW_LEN = 1024, 1152  # maxModelLen before / after: the spec change that rolls the pods
MAX_TOKENS = 768  # per stream: it outlasts the roll (asserted); 256 did not once decode ran on AMX tiles
PRESTOP, GRACE = 2.0, 2.0  # the pods' preStop sleep here, the runtime's drain_handoff_grace (its default)
EXIT_MARGIN = 8.0  # an old pod's exit after preStop + grace: the hand-off, the process's own shutdown
ROLL_MARGIN = 30.0
"""The operator's and the kubelet's polling and reactions, the migrations' prefills, a loaded CPU.
15 s held on a quieter machine; at load average 12-13 (five sessions on 2 cores, issue 42's runs)
the operator took 8-15 s to start the roll and the kubelet 3-7 s between an old pod's exit and its
replacement's start, while each old pod still left 4.8-5.2 s after leaving the endpoints (preStop +
the grace): the roll came to 101 s against pod starts of 80 s, and 154 s against 114 s. The bound
still fails a roll that waits for its streams (they last 240-350 s)."""


@dataclass
class Stream:
    start: float = 0.0
    first: float = 0.0
    end: float = 0.0
    tokens: int = 0
    finish: str | None = None
    completion_tokens: int | None = None
    error: str = ""
    replicas: set = field(default_factory=set)


def run_stream(port: int, i: int, s: Stream, started: threading.Barrier) -> None:
    """One greedy chat stream through the router on ``port`` (the SDK, no retries)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    s.start = time.monotonic()
    try:
        with client.chat.completions.with_streaming_response.create(
                model=MODEL, stream=True, max_tokens=MAX_TOKENS, temperature=0,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": f"Story {i}: tell me a long tale about a lighthouse."}]) as r:
            s.replicas.add(r.headers.get("x-kvfleet-replica"))
            for chunk in r.parse():
                if chunk.usage is not None:
                    s.completion_tokens = chunk.usage.completion_tokens
                for c in chunk.choices:
                    s.tokens += bool(c.delta.content)
                    s.finish = c.finish_reason or s.finish
                if s.tokens == 8:
                    s.first = time.monotonic()
                    started.wait(120)
    except (openai.APIError, httpx.HTTPError, threading.BrokenBarrierError) as e:
        s.error = repr(e)[:300]
    finally:
        s.end = time.monotonic()


def drain_migrations(kubelet: TestKubelet) -> float:
    """``kvfleet:router_migrations_total{reason="drain"}`` summed over the router pods."""
    total = 0.0
    for pod in kubelet.ready_pods(f"{NAME}-router"):
        text = httpx.get(f"http://127.0.0.1:{pod.port}/metrics", timeout=10).text
        total += sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                     if s.name == "kvfleet:router_migrations_total" and s.labels.get("reason") == "drain")
    return total


def manifest() -> dict:
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {"model": {"uri": "file:///models/smollm2.gguf", "servedModelName": MODEL},
                     "replicas": 2, "rollout": {"strategy": "ResourceAware"},
                     "engine": {"maxModelLen": OLD_LEN, "maxNumSeqs": 32, "extraArgs": {"kv_cache_memory": "320MiB"}}}}


def rolled_at(emu, kubelet: TestKubelet, old: set[str]) -> float:
    """Waits until both new pods are ready, the old ones are gone and the InferenceService is Ready
    for the new generation; returns when that was first seen."""
    gen = emu.get(ISVC, NS, NAME)["metadata"]["generation"]

    def done() -> bool:
        ready = {p.name for p in kubelet.ready_pods(NAME)}
        conds = (emu.get(ISVC, NS, NAME).get("status") or {}).get("conditions") or []
        return (len(ready) == 2 and not ready & old and not old & set(kubelet.pods)
                and any(c["type"] == "Ready" and c["status"] == "True" and c.get("observedGeneration") == gen
                        for c in conds))
    emu.wait_for(done, 300, interval=0.2, message="the roll")
    return time.monotonic()


def test_a_resource_aware_roll_hands_16_long_streams_off_and_takes_the_grace_not_the_streams(tmp_path):
    with running_operator(tmp_path) as (emu, _op):
        kubelet = TestKubelet(emu.url, NS, tmp_path / "kubelet", config_overrides={"model": None},
                              kubeconfig=tmp_path / "kubeconfig", rollout="surge", prestop_seconds=PRESTOP,
                              env={"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "PYTHONSAFEPATH": "1"})
        with kubelet:
            emu.create(ISVC, manifest())
            emu.wait_for(lambda: len(kubelet.ready_pods(NAME)) == 2 and len(kubelet.ready_pods(f"{NAME}-router")) == 2
                         and all(httpx.get(f"http://127.0.0.1:{p.port}/ready", timeout=2).json()["available"] == 2
                                 for p in kubelet.ready_pods(f"{NAME}-router")),
                         240, message="two runtime pods and two routers that see them")
            dep = emu.get("apps/v1/deployments", NS, NAME)
            assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
            old = {p.name for p in kubelet.ready_pods(NAME)}
            routers = [p.port for p in kubelet.ready_pods(f"{NAME}-router")]
            streams = [Stream() for _ in range(STREAMS)]
            started = threading.Barrier(STREAMS + 1)
            with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
                futures = [pool.submit(run_stream, routers[i % 2], i, s, started) for i, s in enumerate(streams)]
                started.wait(180)  # every stream has its first tokens
                t0 = time.monotonic()
                emu.patch(ISVC, NS, NAME, {"spec": {"engine": {"maxModelLen": NEW_LEN}}})
                t_rolled = rolled_at(emu, kubelet, old)
                migrated = drain_migrations(kubelet)
                tokens_at_roll = [s.tokens for s in streams]
                for f in futures:
                    f.result(timeout=300)
            models = [httpx.get(f"http://127.0.0.1:{p.port}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
                      for p in kubelet.ready_pods(NAME)]
            migrated = max(migrated, drain_migrations(kubelet))
            events = [(t - t0, what, name) for t, what, name in kubelet.events if t >= t0 and name.startswith(NAME + "-")
                      and not name.startswith(NAME + "-router")]
    left = {n: t for t, what, n in events if what == "terminating"}
    exited = {n: t for t, what, n in events if what == "exited after SIGTERM"}
    starts = {n: t for t, what, n in events if what == "started"}
    pod_start = [t - starts[n] for t, what, n in events if what == "ready" and n in starts]
    roll = t_rolled - t0
    durations = [s.end - s.start for s in streams]
    print(f"\nroll {roll:.1f} s (pod starts {[round(x, 1) for x in pod_start]} s; old pods exited "
          f"{ {n: round(exited[n] - left[n], 1) for n in exited} } s after leaving the endpoints); "
          f"{migrated:g} drain migrations; streams {min(durations):.1f}-{max(durations):.1f} s, "
          f"{min(s.end for s in streams) - t_rolled:.1f} s or more left after the roll "
          f"({min(tokens_at_roll)}-{max(tokens_at_roll)} of {MAX_TOKENS} tokens at its end)")
    print("events: " + ", ".join(f"{t:.1f} {what} {n}" for t, what, n in events))
    for i, s in enumerate(streams):
        assert not s.error and s.finish == "length" and s.completion_tokens == MAX_TOKENS, (i, s)
    assert migrated > 0, "the draining replicas handed streams to the routers"
    assert models == [NEW_LEN, NEW_LEN]
    assert set(exited) == old and set(left) == old
    for n in old:  # the hand-off, not the streams: each old pod leaves after preStop + grace
        assert exited[n] - left[n] <= PRESTOP + GRACE + EXIT_MARGIN, (n, exited[n] - left[n])
    assert len(pod_start) == 2
    # maxSurge 0: each old pod's replacement starts once it has gone, so the roll is about preStop +
    # the hand-off grace per pod plus the pod starts, not the streams
    assert roll <= len(old) * (PRESTOP + GRACE) + sum(pod_start) + ROLL_MARGIN, (roll, pod_start)
    assert min(s.end for s in streams) > t_rolled, "every stream was still running when the roll ended"
