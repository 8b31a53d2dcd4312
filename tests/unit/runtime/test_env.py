"""kvfleet.runtime.env: how a value parses, and every variable checked once at start."""

from __future__ import annotations

import pytest

from kvfleet.runtime import cli, env


@pytest.mark.parametrize(("text", "on"), [("1", True), ("true", True), ("Yes", True), ("ON", True),
                                          ("0", False), ("false", False), ("no", False), ("Off", False)])
def test_a_switch_takes_the_usual_words(text, on):
    assert env.CPU_DECODER.get({env.CPU_DECODER.name: text}) is on


@pytest.mark.parametrize("text", ["maybe", "2", "enabled"])
def test_a_switch_refuses_anything_else_instead_of_reading_it_as_on(text):
    with pytest.raises(env.EnvError, match=env.CPU_DECODER.name):
        env.CPU_DECODER.get({env.CPU_DECODER.name: text})


def test_check_all_names_every_bad_variable_and_passes_good_ones():
    environ = {env.CPU_DECODER.name: "false", env.CPU_ISA.name: "sse", env.CPU_MATMUL.name: "bogus",
               env.TP_STARTUP_TIMEOUT.name: "soon"}
    errors = env.check_all(environ)
    assert len(errors) == 3
    for var in (env.CPU_ISA, env.CPU_MATMUL, env.TP_STARTUP_TIMEOUT):
        assert any(e.startswith(var.name + "=") for e in errors), (var.name, errors)
    assert env.check_all({}) == []


def test_kvfleet_stops_on_a_bad_variable_before_any_command_loads(monkeypatch, capsys):
    monkeypatch.setenv(env.CPU_ISA.name, "sse")
    assert cli.main(["serve", "--help"]) == 2  # refused before `serve` parses or loads anything
    err = capsys.readouterr().err
    assert f"{env.CPU_ISA.name}='sse'" in err and "avx2" in err
