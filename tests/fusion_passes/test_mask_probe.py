"""The mask probe proves what a mask means by running it: causal and sliding-window masks are accepted with the
right window, ALiBi biases (in the mask, or BLOOM's per-head slope·kpos) with the right slopes, anything else
(biases not linear in the key position, padding-only or per-head masks) is refused with a reason."""

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


class AlibiInMask(torch.nn.Module):
    """slope·(kpos − p) folded into the causal mask, one slope for all heads."""

    def forward(self, input_ids, attention_mask, position_ids, past):
        q, k = _positions(input_ids, past)
        return torch.where(k <= q, -0.5 * (q - k).float(), NEG)[None, None]


class Quadratic(torch.nn.Module):
    """Not linear in the key position: softmax cannot turn it into any slope."""

    def forward(self, input_ids, attention_mask, position_ids, past):
        q, k = _positions(input_ids, past)
        return torch.where(k <= q, -0.1 * ((q - k).float() ** 2), NEG)[None, None]


class SlopeFromQuery(torch.nn.Module):
    """Linear in kpos within each row, but the slope changes with the query position: not one ALiBi slope."""

    def forward(self, input_ids, attention_mask, position_ids, past):
        q, k = _positions(input_ids, past)
        return torch.where(k <= q, 0.01 * (q + 1).float() * k.float(), NEG)[None, None]


SLOPES = [0.25, 0.0625, 0.015625, 0.00390625]  # BLOOM's for 4 heads


class BloomStyle(torch.nn.Module):
    """BLOOM: a causal mask plus a separate per-head bias slope[h]·kpos, kpos from the attention-mask cumsum,
    in the heads-folded layout [B·H, 1, S] (``nonlinear_head`` squares one head's bias)."""

    def __init__(self, nonlinear_head: int | None = None):
        super().__init__()
        self.nonlinear_head = nonlinear_head
        self.register_buffer("slopes", torch.tensor(SLOPES))

    def forward(self, input_ids, attention_mask, position_ids, past):
        q, k = _positions(input_ids, past)
        mask = torch.where(k <= q, 0.0, NEG)[None, None]
        kpos = ((attention_mask.cumsum(-1) - 1) * attention_mask).float()  # [1, S]
        bias = self.slopes[:, None] * kpos  # [H, S]
        if self.nonlinear_head is not None:
            squared = bias[self.nonlinear_head] ** 2
            bias = torch.cat([bias[: self.nonlinear_head], squared[None], bias[self.nonlinear_head + 1 :]])
        return mask, bias[:, None, :]


class PaddingOnly(torch.nn.Module):
    def forward(self, input_ids, attention_mask, position_ids, past):
        return (1.0 - attention_mask[:, None, None, :].float()) * NEG


class PerHead(torch.nn.Module):
    def forward(self, input_ids, attention_mask, position_ids, past):
        q, k = _positions(input_ids, past)
        causal = torch.where(k <= q, 0.0, NEG)
        return torch.stack([causal, torch.zeros_like(causal)])[None]


def _export(module: torch.nn.Module, tmp_path, outputs: tuple[str, ...] = ("mask",)) -> ir.Model:
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
        output_names=list(outputs),
        dynamic_axes={"input_ids": {1: "T"}, "attention_mask": {1: "L"}, "position_ids": {1: "T"}, "past": {2: "P"}},
    )
    return ir.load(str(path))


def _probe(model: ir.Model, kind: str = "add"):
    roles = ProbeInputs(
        "input_ids", "position_ids", "attention_mask", tuple(v for v in model.graph.inputs if v.name == "past")
    )
    folded = model.graph.outputs[1] if len(model.graph.outputs) > 1 else None
    return probe_causal(model, MaskSpec(kind, model.graph.outputs[0], folded_bias=folded), roles, long_len=64)


@pytest.mark.parametrize(
    "module,kind,window", [(Causal(), "add", 0), (Window(), "add", 3), (CausalBool(), "where_keep", 0)]
)
def test_causal_masks_are_proven(tmp_path, module, kind, window):
    proven = _probe(_export(module, tmp_path), kind)
    assert proven.window == window
    assert proven.alibi_slopes is None


def test_alibi_in_the_mask_gives_one_slope(tmp_path):
    proven = _probe(_export(AlibiInMask(), tmp_path))
    assert (proven.window, proven.alibi_slopes) == (0, (0.5,))


def test_bloom_style_bias_gives_per_head_slopes(tmp_path):
    proven = _probe(_export(BloomStyle(), tmp_path, ("mask", "bias")))
    assert proven.window == 0
    assert proven.alibi_slopes == tuple(SLOPES)  # exact: recovered from float32 differences of slope·kpos


def test_bloom_style_bias_nonlinear_in_one_head_is_refused(tmp_path):
    with pytest.raises(NoMatch, match="not linear in the key position.*head 2"):
        _probe(_export(BloomStyle(nonlinear_head=2), tmp_path, ("mask", "bias")))


@pytest.mark.parametrize(
    "module,reason",
    [
        (Quadratic(), "not linear in the key position"),
        (SlopeFromQuery(), "not linear in the key position"),
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


def test_a_table_read_only_through_shape_is_never_materialised(export_dir, monkeypatch):
    """Legacy exports take the mask's shape off the token embeddings (Shape(Gather(embed_tokens, ids)·c)): the probe
    holds one zero row of the table instead of all of it, so even a table above the probe's size limit (Gemma-3's
    671 MB; here the limit is lowered to 1 kB) does not stop the proof, and the build fuses every layer."""
    import json

    from trtopt.builder.model_facts import head_dims_from_config
    from trtopt.fusion_passes import mask_probe, optimize

    source = export_dir("tiny-llama", "legacy")
    config = json.loads((source / "config.json").read_text())
    embed_shapes = []
    real_probe_model = mask_probe._probe_model

    def spy(model, targets):
        proto, inputs = real_probe_model(model, targets)
        embed_shapes.extend(list(t.dims) for t in proto.graph.initializer if "embed_tokens" in t.name)
        return proto, inputs

    monkeypatch.setattr(mask_probe, "_MAX_PROBE_INITIALIZER", 1024)
    monkeypatch.setattr(mask_probe, "_probe_model", spy)
    graph = ir.load(str(source / "model.onnx"))
    report = optimize(graph, dims=head_dims_from_config(config), block_size=4, vocab_size=config["vocab_size"])
    assert report.counts["paged_attention"] == config["num_hidden_layers"] and not report.unfused
    assert embed_shapes and all(shape == [1, config["hidden_size"]] for shape in embed_shapes)
