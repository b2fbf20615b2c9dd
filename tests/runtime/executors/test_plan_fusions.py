"""Each optional plan-level fusion against the same plan built without it, on the torch executor on CPU.

The CPU faces of the fused ops keep the unfused graph's arithmetic, so a packed step (a chunked prefill, then a
decode of two sequences) must give bit-identical logits, hence the same greedy tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from trtopt.builder.pipeline import build_plan
from trtopt.builder.plan import REPORT_FILE, Limits, read_plan
from trtopt.runtime.executors.torch_executor import TorchExecutor

from packed_steps import prefill_then_decode


def _steps(plan_dir) -> list[torch.Tensor]:
    plan = read_plan(plan_dir)
    return prefill_then_decode(TorchExecutor(plan_dir, plan), plan.limits.block_size, chunks=((12, 7), (8, 0)))


@pytest.mark.parametrize("rule,model", [("silu_mul", "tiny-llama"), ("silu_mul", "tiny-qwen2"),
                                        ("add_rms_norm", "tiny-llama"), ("add_rms_norm", "tiny-qwen2"),
                                        ("rope", "tiny-llama"), ("rope", "tiny-qwen2"), ("gelu_mul", "gemma3")])
def test_plan_fusion_is_bit_identical_on_the_cpu_executor(rule, model, plan_dir, export_dir, tiny_hf_dir, tmp_path):
    if not model.startswith("tiny-"):  # a tests/export/tiny_archs.py architecture (Gemma-3: GeGLU)
        model = str(tiny_hf_dir(model))
    with_pass = plan_dir(model)
    limits = read_plan(with_pass).limits
    if rule == "rope":  # without Rope ops rope_table has nothing to tabulate: compare with it off on both sides
        with_pass = build_plan(export_dir(model), tmp_path / "with", limits=limits, force=True, progress=False,
                               disable_passes=("rope_table",)).plan_dir
    without = build_plan(export_dir(model), tmp_path / "without", limits=Limits(
        block_size=limits.block_size, max_num_tokens=limits.max_num_tokens, max_num_seqs=limits.max_num_seqs,
        max_model_len=limits.max_model_len), force=True, progress=False, disable_passes=(rule,))
    assert without.report.counts[rule] == 0
    assert json.loads((with_pass / REPORT_FILE).read_text())["counts"][rule] > 0  # else the comparison is vacuous
    for a, b in zip(_steps(with_pass), _steps(without.plan_dir)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_rope_tables_equal_the_per_step_computation_to_float32_rounding(model, plan_dir, export_dir, tmp_path):
    """rope_table replaces the per-step cos/sin by rows of a table computed at build time on onnxruntime. ORT's and
    torch's float32 cos/sin of the same angles may differ in the last bit, so this pass, unlike the others, is not
    bit-identical on the torch executor: the logits agree to float32 rounding and the greedy tokens are the same.
    (On ORT, which computed the table, the plan equals the unfused one: tests/fusion_passes/test_rope_table.py.)"""
    with_pass = plan_dir(model)
    limits = read_plan(with_pass).limits
    without = build_plan(export_dir(model), tmp_path / "without", limits=limits, force=True, progress=False,
                         disable_passes=("rope_table",))
    assert without.report.counts["rope_table"] == 0
    assert json.loads((with_pass / REPORT_FILE).read_text())["counts"]["rope_table"] == 2  # cos and sin
    for a, b in zip(_steps(with_pass), _steps(without.plan_dir)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
