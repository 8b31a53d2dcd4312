"""runtime/bench/sizing.py: parameter counts against the models' published sizes, the bytes per
token of TP, PP and P/D by hand, the node count, and docs/sizing.md's table as generated."""

from __future__ import annotations

import re

import pytest
from support.paths import ROOT

from kvfleet.runtime.bench import sizing

PUBLISHED = {  # parameters as the model cards / safetensors index state them
    "SmolLM2-135M": 134_515_008, "Llama-3.1-8B": 8_030_261_248, "Llama-3.1-70B": 70_553_706_496,
    "Llama-3.1-405B": 405_853_388_800,
}


@pytest.mark.parametrize("model", [m for m in sizing.MODELS if m.name in PUBLISHED], ids=lambda m: m.name)
def test_parameter_counts_match_the_published_ones(model):
    assert sizing.param_count(model.shape, model.tied_embeddings) == PUBLISHED[model.name]


def test_bytes_per_token_by_hand():
    llama8b = next(m for m in sizing.MODELS if m.name == "Llama-3.1-8B").shape
    assert sizing.pd_bytes_per_prompt_token(llama8b) == 2 * 32 * 8 * 128 * 2 == 131072
    assert sizing.pp_bytes_per_token(llama8b) == 2 * 4096 * 2
    # two all-reduces per layer, a ring over 8 ranks puts 2*7/8 of the tensor on every link
    assert sizing.tp_bytes_per_token(llama8b, 8) == pytest.approx(32 * 2 * (2 * 7 / 8) * 4096 * 2)
    assert sizing.tp_bytes_per_token(llama8b, 1) == 0
    assert sizing.gbit_per_s(1e9 / 8, 1) == pytest.approx(1.0)


def test_nodes_needed_follow_the_memory():
    by_name = {m.name: m for m in sizing.MODELS}
    assert sizing.nodes_needed(by_name["Llama-3.1-405B"]) == 2
    assert sizing.nodes_needed(by_name["Llama-3.1-70B"]) == 1
    small = sizing.Node("1x 80 GB", 80 * 10**9)
    assert sizing.nodes_needed(by_name["Llama-3.1-70B"], small) == 4  # 141 GB + 84 GB of KV over 72 GB usable
    assert sizing.nodes_needed(by_name["Llama-3.1-70B"], small, context_tokens=0) == 2


def test_the_docs_table_is_the_generated_one():
    text = (ROOT / "docs/sizing.md").read_text()
    found = re.search(r"<!-- sizing-table:[^>]*-->\n(.*?)\n<!-- /sizing-table -->", text, re.S)
    assert found, "docs/sizing.md lost its generated table"
    assert found.group(1) == sizing.sizing_table(), "run python -m kvfleet.runtime.bench.sizing"
