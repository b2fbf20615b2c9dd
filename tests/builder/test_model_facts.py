"""Config spellings of the head counts and context (build/model_facts.py), and the graph winning over config."""

from __future__ import annotations

import pytest

from trtopt.builder.model_facts import config_disagreements, context_length, head_dims_from_config
from trtopt.builder.plan import ModelFacts
from trtopt.fusion_passes.context import HeadDims


@pytest.mark.parametrize("config,dims", [
    # Falcon-7B: multi_query means one KV head although the config carries num_kv_heads = the query heads
    ({"hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 4, "multi_query": True,
      "new_decoder_architecture": False}, HeadDims(4, 1, 16)),
    # Falcon-40B: the new decoder architecture broadcasts its num_kv_heads groups to every head before the cache
    ({"hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2, "multi_query": True,
      "new_decoder_architecture": True}, HeadDims(4, 4, 16)),
    ({"hidden_size": 64, "num_attention_heads": 4, "multi_query": False}, HeadDims(4, 4, 16)),  # Falcon-RW
    ({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}, HeadDims(4, 2, 16)),  # Llama
    ({"n_embd": 64, "n_head": 4}, HeadDims(4, 4, 16)),  # GPT-2 / BLOOM
    ({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32},
     HeadDims(4, 1, 32)),  # Gemma: head_dim is not hidden / heads
    ({"d_model": 64, "n_heads": 8}, HeadDims(8, 8, 8)),
])
def test_head_dims_from_config_aliases(config, dims):
    assert head_dims_from_config(config) == dims


@pytest.mark.parametrize("config,length", [({"max_position_embeddings": 32768}, 32768), ({"n_positions": 1024}, 1024),
                                           ({"max_sequence_length": 2048}, 2048), ({}, 0)])
def test_context_length(config, length):
    assert context_length(config) == length


def test_the_graph_wins_and_the_disagreement_is_noted():
    facts = ModelFacts(num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16, vocab_size=256, dtype="float32",
                       eos_token_ids=(2,))
    bad = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4}
    assert config_disagreements(facts, bad) == [
        "num_kv_heads: config.json says 4, the graph's attention has 1; using the graph's"]
    assert config_disagreements(facts, {"hidden_size": 64, "num_attention_heads": 4, "multi_query": True}) == []
