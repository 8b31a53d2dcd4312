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


def test_everything_is_on_with_no_flag_and_flags_turn_things_off():
    """Issue 42: prefix-aware routing from KV events, signed peer hints and migration by default."""
    s = parse_args(["--endpoints", "http://a:1"], environ={})
    assert (s.routing_algorithm, s.kv_peer_hint, s.max_migrations) == ("precise-prefix-cache", True, 3)
    off = parse_args(["--endpoints", "http://a:1", "--routing-algorithm", "prefix-hash", "--no-kv-peer-hint",
                      "--max-migrations", "0"], environ={})
    assert (off.routing_algorithm, off.kv_peer_hint, off.max_migrations) == ("prefix-hash", False, 0)
    assert not parse_args(["--endpoints", "http://a:1"], environ={"KVFLEET_ROUTER_KV_PEER_HINT": "false"}).kv_peer_hint


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    (["--endpoints", "http://a:1", "--port", "abc"], {}, "--port='abc': Input should be a valid integer"),
    (["--endpoints", "http://a:1"], {"KVFLEET_ROUTER_PORT": "abc"}, "KVFLEET_ROUTER_PORT='abc': Input should be"),
    (["--endpoints", "http://a:1"], {"KVFLEET_ROUTER_MAX_MIGRATIONS": "-3"}, "KVFLEET_ROUTER_MAX_MIGRATIONS='-3': "),
    (["--endpoints", "notaurl"], {}, "--endpoints=['notaurl']: 'notaurl' is not a replica base URL"),
    (["--endpoints", "http://a:1,ftp://b"], {}, "'ftp://b' is not a replica base URL"),
    (["--endpoints", "http://a:1"], {"KVFLEET_ROUTER_PREFILL_ENDPOINTS": "p:1"}, "KVFLEET_ROUTER_PREFILL_ENDPOINTS=['p:1']"),
    ([], {}, "kvfleet router: error: invalid options:\n  give exactly one of --endpoints and --kube-service"),
])
def test_a_bad_value_is_one_line_naming_its_flag_or_variable(argv, environ, expected, capsys):
    """As kvfleet serve: the error names where the value came from, with no pydantic dump."""
    with pytest.raises(SystemExit) as info:
        parse_args(argv, environ=environ)
    err = capsys.readouterr().err
    assert info.value.code == 2 and expected in err and "errors.pydantic.dev" not in err, err
