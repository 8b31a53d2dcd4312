"""A rolling update under load loses no request: ``kvfleet operator`` (a process) on the
emulator, tests/kubelet.py running real ``kvfleet serve`` processes and rolling them as the
Deployment controller does (surge first, preStop, SIGTERM, the runtime's drain), and 16
streaming clients over the ready pods (what the Service does) while the spec changes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading

import httpx
import pytest
from kube_emulator import ISVC
from kubelet import TestKubelet
from test_operator_e2e import running_operator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NS, NAME, MODEL, STREAMS = "default", "rolling", "smollm2", 16


class StreamingLoad:
    """``clients`` loops, each streaming one completion at a time from a ready pod (round
    robin); a stream counts as done only when it ends with a finish reason and ``[DONE]``."""

    def __init__(self, kubelet: TestKubelet, clients: int):
        self.kubelet, self.clients = kubelet, clients
        self.done, self.errors = 0, []
        self._stop = threading.Event()
        self._rr = itertools.count()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _one(self, http: httpx.AsyncClient, port: int, i: int) -> None:
        body = {"model": MODEL, "prompt": f"Stream {i}: count from one to fifty.", "max_tokens": 12,
                "ignore_eos": True, "temperature": 0, "stream": True}
        finish, done = None, False
        async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                self.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    finish = json.loads(line[6:])["choices"][0].get("finish_reason") or finish
        if done and finish:
            self.done += 1
        else:
            self.errors.append(f"stream ended early (finish {finish}, [DONE] {done})")

    async def _client(self, http: httpx.AsyncClient, i: int) -> None:
        while not self._stop.is_set():
            pods = self.kubelet.ready_pods(NAME)
            if not pods:
                self.errors.append("no ready pod")
                await asyncio.sleep(0.2)
                continue
            try:
                await self._one(http, pods[next(self._rr) % len(pods)].port, i)
            except httpx.HTTPError as e:
                self.errors.append(repr(e))

    async def _main(self) -> None:
        async with httpx.AsyncClient() as http:
            tasks = [asyncio.create_task(self._client(http, i)) for i in range(self.clients)]
            while not self._stop.is_set():
                await asyncio.sleep(0.1)
            await asyncio.gather(*tasks, return_exceptions=True)  # each finishes its stream

    def start(self) -> StreamingLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(180)


def test_a_spec_change_under_load_rolls_without_a_failed_request(tmp_path):
    with running_operator(tmp_path) as (emu, _op):
        kubelet = TestKubelet(emu.url, NS, tmp_path / "kubelet", config_overrides={"model": None},
                              env={"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"},
                              rollout="surge")  # the pod's own preStop sleep and grace period
        load = StreamingLoad(kubelet, STREAMS)
        with kubelet:
            emu.create(ISVC, {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
                              "metadata": {"name": NAME, "namespace": NS},
                              "spec": {"model": {"uri": "file:///models/smollm2.gguf", "servedModelName": MODEL},
                                       "engine": {"maxModelLen": 256, "maxNumSeqs": 32}}})
            (first,) = emu.wait_for(lambda: kubelet.ready_pods(NAME), 240, message="the first pod ready")
            try:
                load.start()
                emu.wait_for(lambda: load.done >= STREAMS, 240, message=f"streams before the roll {load.errors[-3:]}")
                emu.patch(ISVC, NS, NAME, {"spec": {"engine": {"maxNumSeqs": 64}}})  # a new config: a roll
                emu.wait_for(lambda: first.name not in kubelet.pods and kubelet.ready_pods(NAME), 300,
                             message="the old pod replaced")
                before = load.done
                emu.wait_for(lambda: load.done >= before + STREAMS, 240, message="streams on the new pod")
            finally:
                load.stop()
        what = [e[1] for e in kubelet.events if e[2] == first.name]
        print(f"\n{load.done} streams, {len(load.errors)} failed; old pod: {what}")
        assert load.errors == [] and load.done >= 2 * STREAMS
        assert what[-3:] == ["terminating", "exited after SIGTERM", "deleted"]
