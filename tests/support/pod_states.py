"""Pod objects in the states a kubelet reports when a runtime pod will not become ready, each with
the condition reason the operator gives it and a piece of the message: ``CASES``, as
``(pod, reason, needle)``."""

from __future__ import annotations


def pod(name: str = "p-1", **st) -> dict:
    return {"metadata": {"name": name}, "status": st}


def waiting(reason: str, message: str = "", name: str = "runtime", last: dict | None = None) -> dict:
    cs = {"name": name, "image": "img:1", "state": {"waiting": {"reason": reason, "message": message}}}
    if last:
        cs["lastState"] = {"terminated": last}
    return cs


CASES = [
    (pod(containerStatuses=[waiting("ImagePullBackOff", 'Back-off pulling image "img:1"')]),
     "ImagePullBackOff", 'Back-off pulling image "img:1"'),
    (pod(containerStatuses=[waiting("CrashLoopBackOff", "back-off 5m0s", last={
        "exitCode": 1, "reason": "Error", "message": "ValueError: tensor_parallel_size 3 does not divide 9"})]),
     "CrashLoopBackOff", "ValueError: tensor_parallel_size 3 does not divide 9"),
    (pod(containerStatuses=[waiting("CrashLoopBackOff", last={"exitCode": 137, "reason": "OOMKilled"})]),
     "CrashLoopBackOff", "OOMKilled with exit code 137"),
    (pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]),
     "Unschedulable", "3 Insufficient nvidia.com/gpu"),
    (pod(initContainerStatuses=[waiting("CrashLoopBackOff", name="fetch-model", last={
        "exitCode": 1, "message": "attempt 3/3: failed with exit code 1"})]),
     "ModelFetchFailed", "init container fetch-model failed: attempt 3/3"),
    (pod(containerStatuses=[waiting("CrashLoopBackOff", "back-off 10s", last={
        "exitCode": 1, "reason": "Error",
        "message": "UnsupportedArchitecture: /models/x.gguf: architecture 'mamba' has no recipe in this kvfleet"})]),
     "UnsupportedArchitecture", "architecture 'mamba' has no recipe"),
    (pod(containerStatuses=[{"name": "runtime", "image": "img:1", "state": {"terminated": {
        "exitCode": 1, "reason": "Error", "message": "InvalidModelFile: /models/x.gguf: truncated"}}}]),
     "InvalidModelFile", "/models/x.gguf: truncated"),
    (pod(containerStatuses=[waiting("CreateContainerConfigError", 'secret "hf" not found')]),
     "SecretNotFound", 'secret "hf" not found'),
    (pod(containerStatuses=[waiting("CreateContainerConfigError", "couldn't find key token in Secret default/hf")]),
     "SecretKeyNotFound", "couldn't find key token"),
]
