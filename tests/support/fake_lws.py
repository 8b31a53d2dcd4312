"""A fake LeaderWorkerSet controller for the Kubernetes emulator (support/kube_emulator.py).

LWS is not part of Kubernetes: a cluster serves ``leaderworkerset.x-k8s.io/v1`` once its CRD and
controller are installed. Here :func:`install_lws_api` "installs the CRD" on a running emulator
(the resource with its ``status`` and ``scale`` subresources, and a CustomResourceDefinition
object kopf notices), and :class:`FakeLwsController` (a thread polling the emulator over HTTP,
like support/kubelet.py) does what the LWS controller and the kubelets would do, for one
namespace:

- for group ``g`` of ``0 .. spec.replicas-1`` (1 when unset), a leader pod ``NAME-g`` from
  ``leaderTemplate`` and, once it exists (``startupPolicy: LeaderCreated``), workers ``NAME-g-w``
  (``w = 1 .. size-1``) from ``workerTemplate``; every pod gets the LWS labels (``name``,
  ``group-index``, ``worker-index``), an ownerReference to the LWS and the ``LWS_*`` variables in
  every container (``LWS_LEADER_ADDRESS = NAME-g.NAME.NAMESPACE``, ``LWS_GROUP_SIZE``,
  ``LWS_WORKER_INDEX``, ``LWS_NAME``); the pods are then reported Running and Ready (no
  processes: the multi-node runtime has its own tests with real ranks), unless the group is
  :meth:`break_group`-ed, where its workers stay not ready (a crash-looping rank);
- ``RecreateGroupOnPodRestart``: :meth:`restart_pod` restarts one container, and the whole group
  is deleted and created again;
- groups above ``replicas`` are deleted; groups whose pods carry a stale template revision are
  recreated one at a time while the others are whole (a rolling update with ``maxUnavailable: 1``);
- ``status``: ``replicas`` (groups), ``readyReplicas`` (whole groups), ``updatedReplicas``,
  ``hpaPodSelector`` (the leaders; what ``GET .../scale`` answers as its selector, through
  :class:`LwsEmulator`) and an ``Available`` condition.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from collections.abc import Mapping
from typing import Any

import attrs
import kmock

from support.kube_emulator import EmulatorThread, KubeEmulator

LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
PODS = "v1/pods"
PREFIX = "leaderworkerset.sigs.k8s.io/"
REVISION = PREFIX + "template-revision-hash"


@attrs.define(kw_only=True)
class LwsEmulator(KubeEmulator):
    """The emulator whose ``/scale`` of a LeaderWorkerSet answers LWS's selector path
    (``status.hpaPodSelector``: the leaders)."""

    @staticmethod
    def _scale_of(obj: dict[str, Any]) -> dict[str, Any]:
        scale = KubeEmulator._scale_of(obj)
        if obj.get("kind") == "LeaderWorkerSet":
            scale["spec"]["replicas"] = (obj.get("spec") or {}).get("replicas", 1)
            scale["status"]["selector"] = (obj.get("status") or {}).get("hpaPodSelector", "")
        return scale


def install_lws_api(emu: EmulatorThread) -> None:
    """Serve ``leaderworkerset.x-k8s.io/v1`` ``leaderworkersets`` (status and scale subresources)."""
    assert emu.emulator is not None
    emu.emulator.resources[LWS] = kmock.ResourceInfo(kind="LeaderWorkerSet", namespaced=True,
                                                     verbs={"get", "list", "watch", "create", "update", "patch",
                                                            "delete"},
                                                     subresources={"status", "scale"}, shortnames={"lws"},
                                                     singular="leaderworkerset")
    emu.create("apiextensions.k8s.io/v1/customresourcedefinitions", {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
        "spec": {"group": "leaderworkerset.x-k8s.io", "scope": "Namespaced",
                 "names": {"kind": "LeaderWorkerSet", "plural": "leaderworkersets"},
                 "versions": [{"name": "v1", "served": True, "storage": True,
                               "subresources": {"status": {}, "scale": {
                                   "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                                   "labelSelectorPath": ".status.hpaPodSelector"}}}]}})


def validatable(child: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What kubernetes-validate can check of an operator child: the child itself, or, for a
    LeaderWorkerSet (a CRD kind with no schema offline), its leader and worker templates as Pods."""
    if child.get("kind") != "LeaderWorkerSet":
        return [dict(child)]
    group = child["spec"]["leaderWorkerTemplate"]
    return [{"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(group[key])} for key in ("leaderTemplate", "workerTemplate")]


def _revision(lws: Mapping[str, Any]) -> str:
    group = (lws.get("spec") or {}).get("leaderWorkerTemplate") or {}
    return hashlib.sha256(json.dumps(group, sort_keys=True).encode()).hexdigest()[:10]


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


class FakeLwsController:
    """The LWS controller (and the kubelets of its pods) for ``namespace`` (see the module docstring)."""

    def __init__(self, emu: EmulatorThread, namespace: str = "default", interval: float = 0.2):
        self.emu, self.ns, self.interval = emu, namespace, interval
        self.broken: set[tuple[str, int]] = set()
        self.restarts: set[str] = set()
        self.recreated: list[tuple[str, int]] = []
        """``(lws, group)`` of every group deleted to be created again (restart or rollout)."""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fake-lws", daemon=True)

    def __enter__(self) -> FakeLwsController:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def break_group(self, lws: str, group: int, broken: bool = True) -> None:
        """Keep the workers of ``lws``'s group ``group`` not ready (crash-looping) or heal them."""
        with self._lock:
            (self.broken.add if broken else self.broken.discard)((lws, group))

    def restart_pod(self, name: str) -> None:
        """One container of pod ``name`` restarts: its group is recreated (RecreateGroupOnPodRestart)."""
        with self._lock:
            self.restarts.add(name)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as e:  # a test helper: log and go on, like a controller
                print(f"fake-lws: {e!r}")
            self._stop.wait(self.interval)

    # ------------------------------------------------------------------ one pass

    def sync(self) -> None:
        pods = [p for p in self.emu.list(PODS, self.ns) if PREFIX + "name" in (p["metadata"].get("labels") or {})]
        for lws in self.emu.list(LWS, self.ns):
            mine = [p for p in pods if p["metadata"]["labels"][PREFIX + "name"] == lws["metadata"]["name"]]
            self._sync_one(lws, mine)

    def _group_of(self, pod: Mapping[str, Any]) -> int:
        return int(pod["metadata"]["labels"][PREFIX + "group-index"])

    def _sync_one(self, lws: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        name = lws["metadata"]["name"]
        spec = lws["spec"]
        want, size = int(spec.get("replicas", 1)), int(spec["leaderWorkerTemplate"].get("size", 1))
        revision = _revision(lws)
        groups: dict[int, list[dict[str, Any]]] = {}
        for pod in pods:
            groups.setdefault(self._group_of(pod), []).append(pod)
        with self._lock:
            restarted = {self._group_of(p) for p in pods if p["metadata"]["name"] in self.restarts}
            self.restarts -= {p["metadata"]["name"] for p in pods}
        for g in sorted(groups):
            if g >= want or g in restarted:
                self._delete_group(name, g, groups.pop(g))
        whole = {g for g, m in groups.items() if len(m) == size and all(_ready(p) for p in m)}
        stale = [g for g, m in sorted(groups.items()) if any(p["metadata"]["labels"].get(REVISION) != revision
                                                               for p in m)]
        if stale and whole >= set(groups) - {stale[0]}:  # one group at a time, the others whole
            self._delete_group(name, stale[0], groups.pop(stale[0]))
        for g in range(want):
            have = {int(p["metadata"]["labels"][PREFIX + "worker-index"]) for p in groups.get(g, [])}
            for w in range(size):  # the leader first (LeaderCreated), then the workers
                if w not in have:
                    groups.setdefault(g, []).append(self._create_pod(lws, g, w, revision))
            for pod in groups.get(g, []):
                self._report(name, g, pod)
        self._status(lws, want, size, revision)

    def _delete_group(self, name: str, group: int, members: list[dict[str, Any]]) -> None:
        self.recreated.append((name, group))
        for pod in members:
            self.emu.delete(PODS, self.ns, pod["metadata"]["name"])

    def _create_pod(self, lws: Mapping[str, Any], group: int, worker: int, revision: str) -> dict[str, Any]:
        name, size = lws["metadata"]["name"], int(lws["spec"]["leaderWorkerTemplate"].get("size", 1))
        key = "leaderTemplate" if worker == 0 else "workerTemplate"
        template = copy.deepcopy(lws["spec"]["leaderWorkerTemplate"].get(key)
                                 or lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
        meta = template.get("metadata") or {}
        labels = {**(meta.get("labels") or {}), PREFIX + "name": name, PREFIX + "group-index": str(group),
                  PREFIX + "worker-index": str(worker), REVISION: revision}
        env = [{"name": "LWS_LEADER_ADDRESS", "value": f"{name}-{group}.{name}.{self.ns}"},
               {"name": "LWS_GROUP_SIZE", "value": str(size)}, {"name": "LWS_WORKER_INDEX", "value": str(worker)},
               {"name": "LWS_NAME", "value": name}]
        for container in template["spec"].get("containers") or []:
            container["env"] = [*env, *(container.get("env") or [])]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{name}-{group}" + (f"-{worker}" if worker else ""), "namespace": self.ns,
                            "labels": labels, "annotations": dict(meta.get("annotations") or {}),
                            "ownerReferences": [{"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                                 "kind": "LeaderWorkerSet", "name": name,
                                                 "uid": lws["metadata"]["uid"], "controller": True}]},
               "spec": template["spec"], "status": {"phase": "Pending"}}
        return self.emu.create(PODS, pod)

    def _report(self, name: str, group: int, pod: dict[str, Any]) -> None:
        """The kubelet's view: Running and Ready, or a crash-looping worker of a broken group."""
        with self._lock:
            broken = (name, group) in self.broken and pod["metadata"]["labels"][PREFIX + "worker-index"] != "0"
        ready = "False" if broken else "True"
        cs = {"name": "runtime", "ready": not broken, "restartCount": 3 if broken else 0,
              "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}} if broken else {
                  "running": {"startedAt": "2026-01-01T00:00:00Z"}}}
        want = {"phase": "Running", "podIP": "127.0.0.1", "containerStatuses": [cs],
                "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": ready}]}
        if {k: (pod.get("status") or {}).get(k) for k in want} != want:
            self.emu.patch(PODS, self.ns, pod["metadata"]["name"], {"status": want}, subresource="status")

    def _status(self, lws: Mapping[str, Any], want: int, size: int, revision: str) -> None:
        name = lws["metadata"]["name"]
        pods = [p for p in self.emu.list(PODS, self.ns)
                if (p["metadata"].get("labels") or {}).get(PREFIX + "name") == name]
        groups: dict[int, list[dict[str, Any]]] = {}
        for pod in pods:
            groups.setdefault(self._group_of(pod), []).append(pod)
        whole = [g for g, m in groups.items() if len(m) == size and all(_ready(p) for p in m)]
        updated = [g for g, m in groups.items() if all(p["metadata"]["labels"].get(REVISION) == revision for p in m)]
        st = {"replicas": len(groups), "readyReplicas": len(whole), "updatedReplicas": len(updated),
              "hpaPodSelector": f"{PREFIX}name={name},{PREFIX}worker-index=0",
              "conditions": [{"type": "Available", "status": "True" if len(whole) >= want else "False",
                              "reason": "AllGroupsReady" if len(whole) >= want else "GroupsNotReady"}]}
        if {k: (lws.get("status") or {}).get(k) for k in st} != st:
            self.emu.patch(LWS, self.ns, name, {"status": st}, subresource="status")

