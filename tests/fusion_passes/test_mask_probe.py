"""The mask probe proves what a mask means by running it: causal and sliding-window masks are accepted with the
right window, anything else (ALiBi-like biases, padding-only or per-head masks) is refused with a reason."""

from __future__ import annotations

import onnx_ir as ir
import pytest
import torch

from trtopt.fusion_passes.attention_match import MaskSpec
from trtopt.fusion_passes.mask_probe import ProbeInputs, probe_causal
from trtopt.fusion_passes.trace import NoMatch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the legacy exporter is the point here

NEG = torch.finfo(torch.float32).min


def _positions(input_ids, past):
    new, total = input_ids.shape[1], past.shape[2] + input_ids.shape[1]
    query = torch.arange(new) + past.shape[2]  # absolute positions of the new tokens
    key = torch.arange(total)
    return query[:, None], key[None, :]


class Causal(torch.nn.Module):
    def forward(self, input_ids, attention_mask, position_ids, past):
        q, k = _positions(input_ids, past)
        return torch.where(k <= q, 0.0, NEG)[None, None]


class Window(torch.nn.Module):
    def forward(self, input_ids, attention_mask, position_ids, past):
        q, k = _positions(input_ids, past)
        return torch.where((k <= q) & (k > q - 3), 0.0, NEG)[None, None]


class CausalBool(torch.nn.Module):
    def forward(self, input_ids, attention_mask, position_ids, past):
        q, k = _positions(input_ids, past)
        return ((k <= q) & (attention_mask[:, None, None, :] > 0)).expand(1, 1, -1, -1)


class AlibiLike(torch.nn.Module):
    def forward(self, input_ids, attention_mask, position_ids, past):
        q, k = _positions(input_ids, past)
        return torch.where(k <= q, -0.5 * (q - k).float(), NEG)[None, None]


class PaddingOnly(torch.nn.Module):
    def forward(self, input_ids, attention_mask, position_ids, past):
        return (1.0 - attention_mask[:, None, None, :].float()) * NEG


class PerHead(torch.nn.Module):
    def forward(self, input_ids, attention_mask, position_ids, past):
        q, k = _positions(input_ids, past)
        causal = torch.where(k <= q, 0.0, NEG)
        return torch.stack([causal, torch.zeros_like(causal)])[None]


def _export(module: torch.nn.Module, tmp_path) -> ir.Model:
    args = (
        torch.zeros(1, 3, dtype=torch.int64),
        torch.ones(1, 5, dtype=torch.int64),
        torch.arange(2, 5)[None],
        torch.zeros(1, 2, 2, 4),
    )
    path = tmp_path / "mask.onnx"
    torch.onnx.export(
        module,
        args,
        str(path),
        dynamo=False,
        opset_version=17,
        input_names=["input_ids", "attention_mask", "position_ids", "past"],
        output_names=["mask"],
        dynamic_axes={"input_ids": {1: "T"}, "attention_mask": {1: "L"}, "position_ids": {1: "T"}, "past": {2: "P"}},
    )
    return ir.load(str(path))


def _probe(model: ir.Model, kind: str = "add"):
    roles = ProbeInputs(
        "input_ids", "position_ids", "attention_mask", tuple(v for v in model.graph.inputs if v.name == "past")
    )
    return probe_causal(model, MaskSpec(kind, model.graph.outputs[0]), roles, long_len=64)


@pytest.mark.parametrize(
    "module,kind,window", [(Causal(), "add", 0), (Window(), "add", 3), (CausalBool(), "where_keep", 0)]
)
def test_causal_masks_are_proven(tmp_path, module, kind, window):
    assert _probe(_export(module, tmp_path), kind).window == window


@pytest.mark.parametrize(
    "module,reason",
    [
        (AlibiLike(), "ALiBi-like"),
        (PaddingOnly(), "not causal"),
        (PerHead(), "differs across batch/heads"),
    ],
)
def test_other_masks_are_refused(tmp_path, module, reason):
    with pytest.raises(NoMatch, match=reason):
        _probe(_export(module, tmp_path))


def test_a_keep_mask_read_as_a_drop_mask_is_refused(tmp_path):
    with pytest.raises(NoMatch, match="not causal"):
        _probe(_export(CausalBool(), tmp_path), "where_drop")
