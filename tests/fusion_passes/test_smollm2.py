"""The real SmolLM2-135M (30 layers, GQA 9/3): both exports fuse every layer and the paged plan generates the same
logits as the original graph on ORT. Slow: the export alone takes minutes on 2 cores (shared with tests/export)."""

from __future__ import annotations

import pytest
from paged_harness import compare_generation, session

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_smollm2_builds_and_generates_like_the_original(export_dir, built_plan, exporter, tmp_path):
    import json

    from transformers import AutoTokenizer

    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import read_plan

    if exporter == "dynamo":  # the session's shared export, and the plan built from it with the default limits
        source, plan_dir = export_dir("smollm2-135m"), built_plan("smollm2-135m")
    else:  # only this test reads the legacy export: written under tmp_path, removed when the test passes
        from trtopt.export import export_model

        source = export_model("smollm2-135m", tmp_path / "onnx", exporter="legacy", force=True).out_dir
        plan_dir = build_plan(source, tmp_path / "plan", progress=False).plan_dir
    report = json.loads((plan_dir / "fusion_report.json").read_text())
    counts = report["counts"]
    assert counts["paged_attention"] == 30 and counts["rms_norm"] == 61 and counts["logits_gather"] == 1
    assert counts["silu_mul"] == 30
    assert report["unfused"] == []
    facts = read_plan(plan_dir).model
    assert (facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_dim) == (30, 9, 3, 64)
    assert facts.vocab_size == 49152 and 2 in facts.eos_token_ids

    tok = AutoTokenizer.from_pretrained(source)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    err = compare_generation(
        session(str(plan_dir / "model.onnx")),
        session(str(source / "model.onnx")),
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        prompts=[chat, tok("The quick brown fox")["input_ids"]],
        decode_steps=6,
        chunk=16,
    )
    assert err <= 1e-4
