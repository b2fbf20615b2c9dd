"""The Polygraphy network script: valid paged feeds inside the engine's profile, plugin discovery, plan lookup."""

from __future__ import annotations

import os

import numpy as np
import pytest

from trtopt.builder import polygraphy_net
from trtopt.builder.plan import Limits, ModelFacts, PlanConfig
from trtopt.errors import ConfigError
from trtopt.builder.trt_engine import profile_shapes


def make_plan(dtype: str = "float16", **limits) -> PlanConfig:
    model = ModelFacts(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=50, dtype=dtype,
                       eos_token_ids=(0,))
    return PlanConfig(model=model, limits=Limits(**{"block_size": 16, "max_num_tokens": 64, "max_num_seqs": 4,
                                                    "max_model_len": 128, **limits}))


@pytest.mark.parametrize("prefill_len,context_len,block_size", [(7, 20, 16), (19, 32, 16), (1, 0, 32), (40, 127, 16)])
def test_feeds_are_a_valid_step_inside_the_profile(prefill_len: int, context_len: int, block_size: int) -> None:
    plan = make_plan(block_size=block_size)
    feeds = polygraphy_net.paged_feeds(plan, prefill_len=prefill_len, context_len=context_len)
    for name, shape in profile_shapes(plan).items():
        got = feeds[name].shape
        assert len(got) == len(shape.min) and all(lo <= g <= hi for lo, g, hi in zip(shape.min, got, shape.max)), (
            f"{name} {got} outside the profile {shape}")
    T = feeds["input_ids"].shape[1]
    qsl, seq_lens, tables = feeds["query_start_loc"], feeds["seq_lens"], feeds["block_tables"]
    assert qsl[-1] == T == len(feeds["slot_mapping"]) and feeds["position_ids"].shape == (1, T)
    bs, num_blocks = block_size, feeds["kv_cache.0"].shape[0]
    for s in range(len(seq_lens)):
        rows = range(qsl[s], qsl[s + 1])
        context = seq_lens[s] - len(rows)
        for j, t in enumerate(rows):
            pos = context + j
            assert feeds["position_ids"][0, t] == pos
            assert feeds["slot_mapping"][t] == tables[s, pos // bs] * bs + pos % bs, "slot outside the sequence"
        owned = tables[s, : -(-int(seq_lens[s]) // bs)]
        assert (owned > 0).all() and (owned < num_blocks).all(), "blocks must be real (not the null block 0)"
    assert len(set(tables[tables > 0].tolist())) == (tables > 0).sum(), "no block is shared"
    assert (feeds["logits_indices"] == qsl[1:] - 1).all(), "the last token of each sequence"
    assert feeds["kv_cache.1"].dtype == np.float16 and np.isfinite(feeds["kv_cache.1"]).all()
    assert feeds["input_ids"].max() < plan.model.vocab_size


def test_bfloat16_plans_are_refused() -> None:
    with pytest.raises(ConfigError, match="bfloat16"):
        polygraphy_net.paged_feeds(make_plan("bfloat16"))


def test_plan_dir_comes_from_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(polygraphy_net.PLAN_ENV, raising=False)
    with pytest.raises(ConfigError, match="TRTOPT_PLAN"):
        polygraphy_net.plan_dir()
    monkeypatch.setenv(polygraphy_net.PLAN_ENV, str(tmp_path))
    with pytest.raises(ConfigError, match="model.onnx"):
        polygraphy_net.plan_dir()
    (tmp_path / "model.onnx").write_bytes(b"")
    assert polygraphy_net.plan_dir() == tmp_path


@pytest.mark.tensorrt
def test_load_network_parses_a_plan(tmp_path, monkeypatch) -> None:
    pytest.importorskip("tensorrt", reason="TensorRT cannot be installed here (NVIDIA index unreachable)")
    pytest.importorskip("polygraphy", reason="the engine build uses Polygraphy's loaders (the tensorrt extra)")
    plan_dir = os.environ.get("TRTOPT_TEST_PLAN")
    if not plan_dir:
        pytest.skip("set TRTOPT_TEST_PLAN to a built plan directory to parse it with TensorRT")
    monkeypatch.setenv(polygraphy_net.PLAN_ENV, plan_dir)
    builder, network, parser = polygraphy_net.load_network()
    assert network.num_inputs > 0 and parser.num_errors == 0
    config = polygraphy_net.load_config(builder, network)
    assert builder.build_serialized_network(network, config) is not None
