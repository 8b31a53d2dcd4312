"""The Helm chart (charts/kvfleet) as the repository tests read it: ``helm`` (the real binary),
``render`` (``helm template`` into objects), ``by_kind`` / ``one``, and ``VALUE_SETS``, the
non-default value sets the chart tests render, lint and validate."""

from __future__ import annotations

import subprocess

import yaml

from support.paths import ROOT

CHART = ROOT / "charts" / "kvfleet"


def helm(helm_bin: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm_bin, *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def render(helm_bin: str, *args: str, namespace: str = "kvfleet-system") -> list[dict]:
    """`helm template` -> the rendered objects (CRDs from crds/ included)."""
    out = helm(helm_bin, "template", "kvf", str(CHART), "--namespace", namespace, "--include-crds", *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


# Non-default value sets, each rendered, linted and validated.
VALUE_SETS = {
    "default": [],
    "namespaced": ["--set", "operator.watchNamespaces={team-a,team-b}"],
    "namespaced-no-discovery": ["--set", "operator.watchNamespaces={team-a}", "--set", "rbac.clusterDiscovery=false"],
    "monitoring-podmonitor": ["--set", "monitoring.enabled=true", "--set-json", 'monitoring.labels={"release":"kps"}'],
    "monitoring-servicemonitor": ["--set", "monitoring.enabled=true", "--set", "monitoring.kind=ServiceMonitor",
                                  "--set", "monitoring.namespaces={llm}"],
    "monitoring-auto-served": ["--api-versions", "monitoring.coreos.com/v1/PodMonitor"],
    "all-optional-off": ["--set", "prometheusAdapter.rules.enabled=false", "--set", "grafanaDashboard.enabled=false",
                         "--set", "tests.enabled=false", "--set", "podDisruptionBudget.enabled=false",
                         "--set", "operator.peering.enabled=false", "--set", "monitoring.enabled=false"],
    "ha-and-scheduling": [
        "--set", "replicaCount=2", "--set", "podDisruptionBudget.minAvailable=1",
        "--set", "image.digest=sha256:" + "a" * 64, "--set", "operator.logLevel=debug",
        "--set-json", 'imagePullSecrets=[{"name":"regcred"}]',
        "--set-json", 'tolerations=[{"key":"dedicated","operator":"Equal","value":"ops","effect":"NoSchedule"}]',
        "--set-json", 'nodeSelector={"kubernetes.io/os":"linux"}',
        "--set-json", 'operator.extraEnv=[{"name":"KOPF_LOG","value":"1"}]',
        "--set-json", 'operator.extraArgs=["--priority=100"]',
        "--set-json", 'topologySpreadConstraints=[{"maxSkew":1,"topologyKey":"kubernetes.io/hostname",'
                      '"whenUnsatisfiable":"ScheduleAnyway","labelSelector":{"matchLabels":'
                      '{"app.kubernetes.io/component":"operator"}}}]',
        "--set", "grafanaDashboard.namespace=monitoring", "--set", "priorityClassName=system-cluster-critical"],
    "existing-serviceaccount": ["--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops-sa",
                                "--set", "rbac.create=false"],
}
