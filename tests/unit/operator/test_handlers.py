"""The kopf wiring, without a cluster: settings, handler registration, CLI options."""

from __future__ import annotations

import logging

import kopf
import pytest

from kvfleet.operator import handlers, main


def _own_handlers():
    registry = kopf.get_default_registry()
    out = []
    for sub in (registry._changing, registry._watching, registry._spawning, registry._activities):
        for h in sub.get_all_handlers():
            if getattr(h.fn, "__module__", "") == handlers.__name__:
                out.append(h)
    return out


def test_handlers_need_no_finalizer():
    own = _own_handlers()
    ids = {h.id for h in own}
    assert "reconcile_inference_service" in ids
    assert {"child-configmaps", "child-services", "child-deployments", "child-poddisruptionbudgets"} <= ids
    assert not [h.id for h in own if getattr(h, "requires_finalizer", None)]
    assert not [h for h in kopf.get_default_registry()._changing.get_all_handlers()
                if h.fn.__module__ == handlers.__name__ and str(getattr(h, "reason", "")) == "delete"]


def test_configure_puts_kopf_state_in_status_and_one_annotation(tmp_path, monkeypatch):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters: [{name: c, cluster: "
                          "{server: 'http://127.0.0.1:1'}}]\nusers: [{name: u, user: {token: t}}]\n"
                          "contexts: [{name: c, context: {cluster: c, user: u}}]\n")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    settings = kopf.OperatorSettings()
    memo = kopf.Memo()
    handlers.configure(settings=settings, memo=memo, logger=logging.getLogger("test"))
    progress = settings.persistence.progress_storage
    assert isinstance(progress, kopf.StatusProgressStorage) and progress.field == ("status", "kopf")
    diffbase = settings.persistence.diffbase_storage
    assert isinstance(diffbase, kopf.AnnotationsDiffBaseStorage)
    assert diffbase.prefix == "kvfleet.io" and diffbase.key == "last-handled-configuration"
    assert settings.posting.level == logging.WARNING
    assert settings.peering.name == "kvfleet-operator" and not settings.peering.mandatory
    assert memo.kube is not None


def test_backoff_grows_and_is_capped():
    assert [handlers.backoff(r) for r in range(7)] == [10, 20, 40, 80, 160, 300, 300]


def test_cli_options():
    a = main.parse_args(["--namespace", "a", "-n", "b", "--kubeconfig", "k", "--health-port", "8080",
                         "--peering", "p", "--priority", "5"])
    assert a.namespace == ["a", "b"] and a.kubeconfig == "k" and a.health_port == 8080
    assert a.peering == "p" and a.priority == 5 and not a.standalone
    assert main.parse_args([]).namespace == [] and not main.parse_args(["-A"]).namespace
    with pytest.raises(SystemExit):
        main.parse_args(["--namespace", "a", "--all-namespaces"])
    with pytest.raises(SystemExit):
        main.parse_args(["--peering", "p", "--standalone"])


def test_cli_dispatches_to_the_operator(capsys):
    from kvfleet.runtime import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["operator", "--help"])
    assert e.value.code == 0
    assert "--all-namespaces" in capsys.readouterr().out


def test_missing_kubeconfig_is_a_usage_error_not_an_endless_retry(tmp_path, capsys):
    from kvfleet.operator.main import main

    assert main(["--kubeconfig", str(tmp_path / "nope.yaml"), "--standalone"]) == 2
    assert "no such file" in capsys.readouterr().err


def _run_operator(env_extra: dict, *args: str, timeout: float = 60):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "kvfleet.runtime.cli", "operator", "--standalone", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_no_cluster_is_one_clear_line_not_an_endless_retry(tmp_path):
    r = _run_operator({"HOME": str(tmp_path)})  # no service account, no ~/.kube/config
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("kvfleet operator: no Kubernetes cluster")


def test_an_api_server_that_does_not_answer_is_one_clear_line(tmp_path):
    from support.serve import free_port

    port = free_port()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
users: [{{name: u, user: {{}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    r = _run_operator({"HOME": str(tmp_path)}, "--kubeconfig", str(kubeconfig))
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"kvfleet operator: cannot reach the Kubernetes API at http://127.0.0.1:{port}")
