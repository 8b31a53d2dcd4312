"""The router's options (kvfleet.runtime.router.settings)."""

from __future__ import annotations

import pytest

from kvfleet.runtime.router.settings import parse_args


def test_settings_need_one_endpoint_source():
    s = parse_args(["--endpoints", "http://a:1, http://b:2/", "--routing-algorithm", "least-load"], environ={})
    assert s.endpoints == ["http://a:1", "http://b:2/"] and s.routing_algorithm == "least-load"
    assert parse_args([], environ={"KVFLEET_ROUTER_KUBE_SERVICE": "svc"}).kube_service == "svc"
    for argv in ([], ["--endpoints", "http://a:1", "--kube-service", "s"], ["--endpoints", "x", "--max-pending", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(argv, environ={})
