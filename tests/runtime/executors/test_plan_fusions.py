"""Each optional plan-level fusion against the same plan built without it, on the torch executor on CPU.

The CPU faces of the fused ops keep the unfused graph's arithmetic, so a packed step (a chunked prefill, then a
decode of two sequences) must give bit-identical logits, hence the same greedy tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from trtopt.build.builder import build_plan
from trtopt.build.plan import REPORT_FILE, Limits, read_plan
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
    without = build_plan(export_dir(model), tmp_path / "without", limits=Limits(
        block_size=limits.block_size, max_num_tokens=limits.max_num_tokens, max_num_seqs=limits.max_num_seqs,
        max_model_len=limits.max_model_len), force=True, progress=False, disable_passes=(rule,))
    assert without.report.counts[rule] == 0
    assert json.loads((with_pass / REPORT_FILE).read_text())["counts"][rule] > 0  # else the comparison is vacuous
    for a, b in zip(_steps(with_pass), _steps(without.plan_dir)):
        assert torch.equal(a, b)
