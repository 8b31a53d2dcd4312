"""runtime/http/auth.py: the API key both front ends check."""

import pytest
from starlette.datastructures import Headers

from kvfleet.runtime.http.auth import key_matches, presented_key


@pytest.mark.parametrize(("headers", "x_api_key", "expected"), [
    ({"Authorization": "Bearer k1"}, False, "k1"),
    ({"authorization": "bearer  k1 "}, False, "k1"),  # scheme in any case, token stripped
    ({"Authorization": "Basic k1"}, False, None),
    ({"Authorization": "k1"}, False, None),
    ({}, False, None),
    ({"x-api-key": "k2", "Authorization": "Bearer k1"}, True, "k2"),  # Anthropic's header first
    ({"x-api-key": "k2"}, False, None),  # only where the caller accepts it
    ({"Authorization": "Bearer k1"}, True, "k1"),
])
def test_presented_key(headers, x_api_key, expected):
    assert presented_key(Headers(headers), x_api_key=x_api_key) == expected


def test_key_matches_only_the_configured_key():
    assert key_matches(Headers({"Authorization": "Bearer s3cret"}), "s3cret")
    assert not key_matches(Headers({"Authorization": "Bearer s3cre"}), "s3cret")
    assert not key_matches(Headers({}), "s3cret")
    assert not key_matches(Headers({"x-api-key": "s3cret"}), "s3cret")
    assert key_matches(Headers({"x-api-key": "s3cret"}), "s3cret", x_api_key=True)
