"""Do onnxscript's own fusion rules (onnxscript/rewriter/rules/fusion/) match our exports? (issue 16 item 5)

For each export: our cleanup (constant folding, so both sides see the same graph), then, on separate copies,
onnxscript 0.7's RMS-normalization, layer-norm and rotary-embedding rule sets and ours (fusion_passes/rms_norm.py,
layer_norm.py); prints how many regions each fuses. Where one of theirs fuses something, the rewritten model is run
on ONNX Runtime against the cleaned-up original (same random inputs) when ORT can run the op at the model's opset.

The rule modules are private (``_rms_normalization`` etc.; the package exports nothing), so the project itself
cannot import them under its public-API rule; this script may, to measure. Usage:

    python benchmarks/onnxscript_fusion_rules.py EXPORT_DIR [EXPORT_DIR ...]   # dirs made by `trtopt export`

Result (onnxscript 0.7.2, onnxruntime as installed) in docs/fusion.md, "onnxscript's fusion rules".
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnxscript.rewriter.rules.fusion import _layer_norm, _rms_normalization, _rotary_embedding

from trtopt.fusion_passes.cleanup import cleanup
from trtopt.fusion_passes.layer_norm import fuse_layer_norm
from trtopt.fusion_passes.rms_norm import fuse_rms_norm

THEIRS = {
    "rms_norm": _rms_normalization.rms_normalization_ruleset,
    "layer_norm": _layer_norm.layer_normalization_ruleset,
    "rotary": _rotary_embedding.rotary_embedding_rules,
}
OURS = {"rms_norm": fuse_rms_norm, "layer_norm": fuse_layer_norm}


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


def _feeds(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Random inputs: 1 sequence of 5 new tokens after 3 cached ones (optimum-style I/O)."""
    rng = np.random.default_rng(0)
    feeds = {}
    for value in proto.graph.input:
        dims = [d.dim_value if d.dim_value else None for d in value.type.tensor_type.shape.dim]
        name = value.name
        if name == "input_ids":
            feeds[name] = rng.integers(0, 100, size=(1, 5), dtype=np.int64)
        elif name == "position_ids":
            feeds[name] = np.arange(3, 8, dtype=np.int64)[None]
        elif name == "attention_mask":
            feeds[name] = np.ones((1, 8), dtype=np.int64)
        else:  # past_key_values.*: [1, Hkv, 3, D]
            shape = [1, dims[1], 3, dims[3]]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
            feeds[name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _run(model: ir.Model, feeds) -> list[np.ndarray] | str:
    proto = ir.serde.serialize_model(model)
    try:
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:  # an op ORT does not have at this opset: report it, that is the finding
        return f"ORT cannot load it: {str(e).splitlines()[0][:160]}"
    return session.run(None, feeds)


def main(dirs: list[str]) -> None:
    for d in dirs:
        model = ir.external_data.load_to_model(ir.load(str(Path(d) / "model.onnx")))  # weights in memory for ORT
        cleanup(model)
        opset = model.opset_imports.get("", 0)
        line = [f"{Path(d).name} (opset {opset}):"]
        for kind, ruleset in THEIRS.items():
            theirs = _copy(model)
            count = ruleset.apply_to_model(theirs)
            ours = OURS[kind](_copy(model)) if kind in OURS else "-"
            note = ""
            if count:
                feeds = _feeds(ir.serde.serialize_model(model))
                base, got = _run(model, feeds), _run(theirs, feeds)
                note = got if isinstance(got, str) else f"max|Δlogits| {np.abs(got[0] - base[0]).max():.2e}"
                if isinstance(got, str) and opset < 23:
                    # The fused ops exist from opset 23: declare both graphs at 23 (their other ops mean the same
                    # there) and compare again.
                    base23, theirs23 = _copy(model), _copy(theirs)
                    base23.opset_imports[""] = theirs23.opset_imports[""] = 23
                    base, got = _run(base23, feeds), _run(theirs23, feeds)
                    note += "; at opset 23: " + (
                        got if isinstance(got, str) else f"max|Δlogits| {np.abs(got[0] - base[0]).max():.2e}")
            line.append(f"  {kind}: theirs {count}, ours {ours}{(' ' + note) if note else ''}")
        print("\n".join(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
