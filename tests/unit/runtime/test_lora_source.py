"""Where an adapter's folder is (kvfleet.runtime.lora_source): a path, a ``file://`` URI, and
``hf://`` URIs that name no organisation refused."""

from __future__ import annotations

import pytest

from kvfleet.runtime.lora_request import LoRALoadError


def test_lora_paths_file_uris_and_bad_hub_uris():
    from kvfleet.runtime.lora_source import resolve_lora_path

    assert resolve_lora_path("/adapters/a") == "/adapters/a"
    assert resolve_lora_path("file:///adapters/a") == "/adapters/a"
    with pytest.raises(LoRALoadError, match="hf://ORG/NAME"):
        resolve_lora_path("hf://no-org-part")
