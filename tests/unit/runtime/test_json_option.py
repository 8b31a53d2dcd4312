"""One JSON-object option into its pydantic model (``--kv-events-config``, ``--kv-transfer-config``)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from kvfleet.runtime.json_option import parse_json_option


class Opt(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = 1


def test_the_forms_an_option_comes_in():
    assert parse_json_option(Opt, None, "x") is None and parse_json_option(Opt, " ", "x") is None
    assert parse_json_option(Opt, '{"n": 3}', "x").n == 3
    assert parse_json_option(Opt, {"n": 4}, "x").n == 4
    given = Opt(n=5)
    assert parse_json_option(Opt, given, "x") is given


@pytest.mark.parametrize(("value", "match"), [("{", "my_option: not valid JSON"), ("[]", "a JSON object is expected"),
                                              ({"m": 1}, "m")])
def test_bad_values_name_the_option(value, match):
    with pytest.raises(ValueError, match=match):
        parse_json_option(Opt, value, "my_option")
