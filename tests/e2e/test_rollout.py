"""Rolling updates under load: ``kvfleet operator`` (a process) on the emulator, tests/support/kubelet.py
rolling real ``kvfleet serve`` processes as the Deployment controller does (``rollout="surge"``),
the pod's own preStop sleep (the operator's 10 s, not shortened) and grace period, and 16
streaming clients over the ready pods only (the Service's endpoints) while the spec changes.
One operator, one kubelet and one InferenceService for the module (two replicas, started once);
each test rolls it under its own load and can run alone.

- ``rollout.strategy: ResourceAware`` (maxSurge 0, maxUnavailable 1), two replicas: an old pod
  stops *before* its replacement exists and the other one carries all 16 streams meanwhile.
  Checked: no failed request and never a moment without a ready pod; the streams in flight on a
  pod when it left the endpoints all finish; each old pod goes terminating -> exits after
  SIGTERM -> deleted; never more than one of the two pods unavailable; the new pods serve the
  new config; the InferenceService is Ready for the new generation.
- ``Availability`` (the default: maxSurge 1, maxUnavailable 0), scaled to one replica in the
  same change (what tests/test_operator_rollout.py checked before it moved here, on its own
  one-replica service): the new pod is ready before the last old one leaves the endpoints, no
  failed request, the old pods terminate -> exit after SIGTERM -> deleted, the new pod reads the
  new config, Ready for the new generation.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from support.kube_emulator import ISVC
from support.kubelet import TestKubelet
from support.operator_process import running_operator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NS, NAME, MODEL, STREAMS = "default", "rolling-ru", "smollm2", 16
OLD_LEN, NEW_LEN = 256, 384  # maxModelLen before / after: a config change, visible in /v1/models
# The runtime's drain bound. kvfleet serve's default, 30 s, is too short on the loaded 2-core test
# machine: 7-13 streams were still in flight on a pod at SIGTERM (after its 10 s preStop), and their
# drains took 24.6 to 39.9 s in two runs; in a run with the default the shutdown timeout ended
# 6 of them with an error event, as documented. The operator ties the pod's
# terminationGracePeriodSeconds to it (preStop + this + margin), which the test kubelet obeys.
SHUTDOWN_TIMEOUT = 120


@dataclass
class Stream:
    pod: str
    start: float
    end: float = 0.0
    ok: bool = False
    error: str = ""


class StreamingLoad:
    """``clients`` loops, each streaming one completion at a time (16-48 tokens) from a pod the
    kubelet reports ready and not terminating, round robin; a stream is ok only when it ends
    with a finish reason and ``[DONE]``. Also samples the number of ready pods."""

    def __init__(self, kubelet: TestKubelet, clients: int):
        self.kubelet, self.clients = kubelet, clients
        self.streams: list[Stream] = []
        self.errors: list[str] = []
        self.min_ready = 99
        self._stop = threading.Event()
        self._rr = itertools.count()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    @property
    def done(self) -> int:
        return sum(s.ok for s in self.streams)

    async def _one(self, http: httpx.AsyncClient, pod, i: int, n: int) -> None:
        s = Stream(pod.name, time.monotonic())
        self.streams.append(s)
        body = {"model": MODEL, "prompt": f"Stream {i}.{n}: count from one to fifty.",
                "max_tokens": 16 + 8 * ((i + n) % 5), "ignore_eos": True, "temperature": 0, "stream": True}
        finish, done = None, False
        try:
            async with http.stream("POST", f"http://127.0.0.1:{pod.port}/v1/completions", json=body,
                                   timeout=180) as r:
                if r.status_code != 200:
                    s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            s.error = f"error event {event['error']}"
                            return
                        finish = event["choices"][0].get("finish_reason") or finish
        except httpx.HTTPError as e:
            s.error = repr(e)
        finally:
            s.end = time.monotonic()
            if not s.error and not (done and finish):
                s.error = f"stream ended early (finish {finish}, [DONE] {done})"
            s.ok = not s.error
            if s.error:
                self.errors.append(f"{pod.name}: {s.error}")

    async def _client(self, http: httpx.AsyncClient, i: int) -> None:
        for n in itertools.count():
            if self._stop.is_set():
                return
            pods = self.kubelet.ready_pods(NAME)
            if not pods:
                self.errors.append("no ready pod")
                await asyncio.sleep(0.2)
                continue
            await self._one(http, pods[next(self._rr) % len(pods)], i, n)

    async def _watch(self) -> None:
        while not self._stop.is_set():
            self.min_ready = min(self.min_ready, len(self.kubelet.ready_pods(NAME)))
            await asyncio.sleep(0.1)

    async def _main(self) -> None:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as http:
            tasks = [asyncio.create_task(self._client(http, i)) for i in range(self.clients)]
            watch = asyncio.create_task(self._watch())
            await asyncio.gather(*tasks, return_exceptions=True)  # each finishes its last stream
            await watch

    def start(self) -> StreamingLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(240)


def unavailable(emu) -> int:
    st = (emu.get("apps/v1/deployments", NS, NAME) or {}).get("status") or {}
    return 2 - int(st.get("availableReplicas") or 0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """The operator, the kubelet and the two-replica ResourceAware service: ``(emu, kubelet)``."""
    tmp = tmp_path_factory.mktemp("rollout")
    with running_operator(tmp) as (emu, _op):
        kubelet = TestKubelet(emu.url, NS, tmp / "kubelet", config_overrides={"model": None},
                              env={"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}, rollout="surge")
        with kubelet:
            emu.create(ISVC, {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
                              "metadata": {"name": NAME, "namespace": NS},
                              "spec": {"model": {"uri": "file:///models/smollm2.gguf", "servedModelName": MODEL},
                                       "replicas": 2, "rollout": {"strategy": "ResourceAware"},
                                       "engine": {"maxModelLen": OLD_LEN, "maxNumSeqs": 32,
                                                  "extraArgs": {"kv_cache_memory": "128MiB",
                                                                "shutdown_timeout": SHUTDOWN_TIMEOUT}}}})
            yield emu, kubelet


def settled_pods(emu, kubelet, replicas: int) -> list:
    """The service's ready pods once exactly ``replicas`` run and none is stopping."""
    def steady():
        ready = kubelet.ready_pods(NAME)
        mine = [p for p in kubelet.pods.values() if p.deployment == NAME]
        return len(ready) == replicas == len(mine) and ready
    return emu.wait_for(steady, 300, message=f"{replicas} pods ready")


def ready_for_new_generation(emu) -> dict:
    gen = emu.get(ISVC, NS, NAME)["metadata"]["generation"]
    return emu.wait_for(lambda: next((c for c in emu.get(ISVC, NS, NAME)["status"].get("conditions", [])
                                      if c["type"] == "Ready" and c["status"] == "True"
                                      and c.get("observedGeneration") == gen), None),
                        60, message="Ready for the new generation")


def report_failures(load: StreamingLoad, left: dict) -> None:
    for s in load.streams:
        if s.error:
            t_left = left.get(s.pod)
            when = "" if t_left is None else (f" (started {s.start - t_left:+.1f} s, ended {s.end - t_left:+.1f} s "
                                             f"from leaving the endpoints)")
            print(f"failed on {s.pod}{when}: {s.error[:160]}")


def test_a_two_replica_resource_aware_roll_under_16_streams_fails_no_request(fleet):
    emu, kubelet = fleet
    load = StreamingLoad(kubelet, STREAMS)
    old = settled_pods(emu, kubelet, 2)
    dep = emu.get("apps/v1/deployments", NS, NAME)
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    prestop = dep["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep" and float(prestop[1]) >= 5, prestop  # the real one, not shortened
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= float(prestop[1]) + SHUTDOWN_TIMEOUT, grace
    worst = 0
    try:
        load.start()
        emu.wait_for(lambda: load.done >= STREAMS, 300, message=f"streams before the roll {load.errors[-3:]}")
        emu.patch(ISVC, NS, NAME, {"spec": {"engine": {"maxModelLen": NEW_LEN}}})  # new config: a roll

        def rolled():
            nonlocal worst
            worst = max(worst, unavailable(emu))
            names = {p.name for p in kubelet.ready_pods(NAME)}
            return len(names) == 2 and not names & {p.name for p in old} and \
                not any(p.name in kubelet.pods for p in old)
        emu.wait_for(rolled, 480, interval=0.5, message=f"both old pods replaced {load.errors[-3:]}")
        before = load.done
        emu.wait_for(lambda: load.done >= before + STREAMS, 300, message="streams on the new pods")
    finally:
        load.stop()
    new = kubelet.ready_pods(NAME)
    models = [httpx.get(f"http://127.0.0.1:{p.port}/v1/models", timeout=10).json() for p in new]
    ready = ready_for_new_generation(emu)

    events = {p.name: [(t, what) for t, what, name in kubelet.events if name == p.name] for p in old}
    left = {name: next(t for t, what in ev if what == "terminating") for name, ev in events.items()}
    in_flight = [s for s in load.streams if s.pod in left and s.start < left[s.pod] < s.end]
    on_new = [s for s in load.streams if s.ok and s.pod in {p.name for p in new}]
    print(f"\n{load.done} streams ok, {len(load.errors)} failed; {len(in_flight)} in flight on an old pod when it "
          f"left the endpoints; {len(on_new)} on the new pods; fewest ready pods {load.min_ready}, most "
          f"unavailable {worst}; old pods: { {n: [w for _, w in ev] for n, ev in events.items()} }")
    drains = {}  # each old pod's first and last drain line ("draining: N requests in flight", "drained in S s")
    for p in old:
        lines = [line.split(" kvfleet.server: ", 1)[-1] for line in p.log_path.read_text(errors="replace").splitlines()
                 if "drain" in line or "shutdown_timeout" in line]
        drains[p.name] = lines[:1] + lines[-1:]
    print(f"drains: {drains}")
    report_failures(load, left)
    assert load.errors == [], load.errors[:10]
    assert load.min_ready >= 1
    assert worst <= 1, "maxUnavailable 1 of 2 replicas"
    for name, ev in events.items():
        assert [w for _, w in ev][-3:] == ["terminating", "exited after SIGTERM", "deleted"], (name, ev)
    assert in_flight and all(s.ok for s in in_flight), "the streams on a pod leaving the endpoints finish"
    assert len(on_new) >= STREAMS
    assert [m["data"][0]["max_model_len"] for m in models] == [NEW_LEN, NEW_LEN]
    assert ready["reason"] == "RolledOut"


def test_an_availability_roll_to_one_replica_surges_first_and_fails_no_request(fleet):
    """Formerly tests/test_operator_rollout.py (there: a one-replica service of its own)."""
    emu, kubelet = fleet
    load = StreamingLoad(kubelet, STREAMS)
    old = settled_pods(emu, kubelet, 2)
    try:
        load.start()
        emu.wait_for(lambda: load.done >= STREAMS, 300, message=f"streams before the roll {load.errors[-3:]}")
        emu.patch(ISVC, NS, NAME, {"spec": {"replicas": 1, "rollout": {"strategy": "Availability"},
                                            "engine": {"maxNumSeqs": 64}}})  # a new config: a roll
        emu.wait_for(lambda: len(kubelet.ready_pods(NAME)) == 1 and not any(p.name in kubelet.pods for p in old),
                     300, interval=0.5, message=f"the old pods replaced {load.errors[-3:]}")
        before = load.done
        emu.wait_for(lambda: load.done >= before + STREAMS, 240, message="streams on the new pod")
    finally:
        load.stop()
    (new,) = kubelet.ready_pods(NAME)
    dep = emu.get("apps/v1/deployments", NS, NAME)
    ready = ready_for_new_generation(emu)
    events = {p.name: [(t, what) for t, what, name in kubelet.events if name == p.name] for p in old}
    left = {name: next(t for t, what in ev if what == "terminating") for name, ev in events.items()}
    new_ready = next(t for t, what, name in kubelet.events if name == new.name and what == "ready")
    print(f"\n{load.done} streams ok, {len(load.errors)} failed; fewest ready pods {load.min_ready}; new pod ready "
          f"{max(left.values()) - new_ready:.1f} s before the last old one left; old pods: "
          f"{ {n: [w for _, w in ev] for n, ev in events.items()} }")
    report_failures(load, left)
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert load.errors == [] and load.done >= 2 * STREAMS, load.errors[:10]
    assert load.min_ready >= 1
    assert max(left.values()) >= new_ready, "surge first: the last old pod leaves after the new one is ready"
    for name, ev in events.items():
        assert [w for _, w in ev][-3:] == ["terminating", "exited after SIGTERM", "deleted"], (name, ev)
    assert sum(s.ok for s in load.streams if s.pod == new.name) >= STREAMS
    assert "max_num_seqs: 64" in (kubelet.workdir / f"{new.name}.yaml").read_text()
    assert ready["reason"] == "RolledOut"
