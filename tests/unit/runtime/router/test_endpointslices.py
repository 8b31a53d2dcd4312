"""EndpointSlice parsing (kvfleet.runtime.router.endpointslices): ready addresses only (the watch
against the API emulator: tests/e2e/test_router_endpointslices.py)."""

from __future__ import annotations

from kvfleet.runtime.router.endpointslices import slice_urls


def test_slice_urls_ready_addresses_only():
    slices = [
        {"metadata": {"labels": {"kubernetes.io/service-name": "svc"}}, "addressType": "IPv4",
         "ports": [{"name": "http", "port": 8000}],
         "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                       {"addresses": ["10.0.0.2"], "conditions": {"ready": False, "terminating": True}},
                       {"addresses": ["10.0.0.3"]}]},  # unset: ready
        {"metadata": {"labels": {"kubernetes.io/service-name": "svc"}}, "addressType": "IPv6",
         "ports": [{"name": "http", "port": 8000}], "endpoints": [{"addresses": ["fd00::5"]}]},
        {"metadata": {"labels": {"kubernetes.io/service-name": "other"}}, "ports": [{"name": "http", "port": 1}],
         "endpoints": [{"addresses": ["10.9.9.9"]}]},
        {"metadata": {"labels": {"kubernetes.io/service-name": "svc"}}, "ports": [{"name": "grpc", "port": 9}],
         "endpoints": [{"addresses": ["10.0.0.4"]}]},
    ]
    assert slice_urls(slices, "http", "svc") == ["http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://[fd00::5]:8000"]
    assert slice_urls(slices, "8000", "svc") == slice_urls(slices, "http", "svc")
