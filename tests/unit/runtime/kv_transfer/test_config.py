"""``--kv-transfer-config``: parsing (through :mod:`kvfleet.runtime.json_option`), roles, and the
combinations the engine refuses."""

from __future__ import annotations

import pytest

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.kv_transfer.config import KVTransferConfig


def test_parse_forms_and_defaults():
    assert KVTransferConfig.parse(None) is None and KVTransferConfig.parse("  ") is None
    cfg = KVTransferConfig.parse('{"kv_connector": "PeerPullConnector"}')
    assert (cfg.kv_role, cfg.min_pull_blocks, cfg.max_concurrent_pulls) == ("kv_both", 4, 2)
    assert cfg.serves and cfg.pulls
    assert KVTransferConfig.parse(cfg) is cfg
    consumer = KVTransferConfig.parse({"kv_role": "kv_consumer", "min_pull_blocks": 8})
    assert consumer.pulls and not consumer.serves and consumer.min_pull_blocks == 8
    assert not KVTransferConfig.parse({"kv_role": "kv_producer"}).pulls


@pytest.mark.parametrize(("value", "match"), [
    ("{", "kv_transfer_config: not valid JSON"), ("[1]", "a JSON object is expected"),
    ({"kv_connector": "NixlConnector"}, "kv_connector"), ({"min_pull_blocks": 0}, "min_pull_blocks"),
    ({"kv_role": "kv_both", "shared_storage_path": "/x"}, "shared_storage_path"),
])
def test_bad_values_are_refused_naming_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        KVTransferConfig.parse(value)


def test_engine_config_takes_it_and_refuses_tensor_parallelism():
    cfg = EngineConfig(kv_transfer_config='{"kv_role": "kv_both"}')
    assert isinstance(cfg.kv_transfer_config, KVTransferConfig)
    cfg.check_engine_support()
    with pytest.raises(ValueError, match="--kv-transfer-config: not supported with tensor_parallel_size"):
        EngineConfig(kv_transfer_config={}, tensor_parallel_size=2).check_engine_support()
