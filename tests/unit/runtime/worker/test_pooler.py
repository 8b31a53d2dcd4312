"""The pooling forward against plain transformers: the same hidden states, pooled LAST / MEAN,
normalised or not, for sequences of different lengths packed in one forward; the engine's KV
cache is left alone."""

from __future__ import annotations

import pytest
import torch

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.pooler_config import PoolerConfig
from kvfleet.runtime.worker.pooler import embed

SEQS = [[504, 2634, 30, 1073, 314], [28, 29], list(range(100, 140))]


@pytest.fixture(scope="module")
def hidden():
    """Each sequence's last hidden states, one at a time, from a plain transformers copy."""
    from kvfleet.runtime.worker.model_loader import load_model

    ref = load_model(None, dtype="float32", device="cpu")
    with torch.inference_mode():
        out = [ref.model.get_decoder()(input_ids=torch.tensor([s])).last_hidden_state[0] for s in SEQS]
    del ref
    return out


@pytest.mark.parametrize("config", [PoolerConfig(), PoolerConfig(pooling_type="MEAN"),
                                    PoolerConfig(normalize=False)])
def test_embed_matches_transformers(smollm2, hidden, config):
    engine = LLMEngine(EngineConfig(kv_cache_memory=32 * 2**20), [], loaded=smollm2)
    before = [k.clone() for k, _ in engine.runner.kv_caches]
    got = torch.tensor(embed(engine.runner, SEQS, config))
    for i, h in enumerate(hidden):
        v = h[-1] if config.pooling_type == "LAST" else h.mean(0)
        if config.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        torch.testing.assert_close(got[i], v, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(b, k) for b, (k, _) in zip(before, engine.runner.kv_caches, strict=True))
