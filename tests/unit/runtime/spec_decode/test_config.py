"""``--speculative-config`` (runtime/spec_decode/config.py) through EngineConfig."""

import pytest

from kvfleet.runtime.config import EngineConfig


def test_vllm_json_form_parses():
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    spec = cfg.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == ("ngram", 3, 5, 2)
    assert EngineConfig().speculative_config is None
    assert EngineConfig(speculative_config="").speculative_config is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["ngram"]', "a JSON object is expected"),
        ('{"method": "eagle"}', "method"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"draft_model": "x"}', "draft_model"),
    ],
)
def test_bad_configs_name_the_problem(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_an_engine_accepts_it():
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    cfg.check_engine_support()
    assert cfg.speculative_config.num_speculative_tokens == 3
