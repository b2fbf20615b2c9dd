"""rope_table: the cos/sin rows computed from position_ids every step → a Gather from a table built at build time."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
from graphs import FLOAT, model, op_types, run
from onnx import TensorProto, helper

from trtopt.fusion_passes import rope_table
from trtopt.fusion_passes.cleanup import cleanup
from trtopt.fusion_passes.ops import DOMAIN
from trtopt.fusion_passes.rope_table import tabulate_rope
from trtopt.fusion_passes.trace import Trace
from trtopt.plugins.common import OPSET_VERSION

D, H = 8, 2
INV_FREQ = (1.0 / (10000.0 ** (np.arange(0, D, 2) / D))).astype(np.float32)


def _graph(form: str = "mul", *, bf16_tail: str | None = None, reads_ids: bool = False, cumulative: bool = False,
           batch_from_ids: bool = False):
    """q [1, H, T, D] rotated by trtopt.Rope with cos/sin computed from position_ids as the exporters write it:
    ``mul`` Unsqueeze → Cast → Mul(inv_freq) (legacy/optimum), ``matmul`` inv_freq[None, :, None] @ pos[:, None, :]
    then Transpose (dynamo, HF's own code). ``bf16_tail``: "cast" rounds the tables to bf16 then back (a bf16 plan
    feeding a float32 test graph), "arith" also scales the bf16 value (not exact in float32: must be refused).
    ``reads_ids`` adds input_ids into the angle; ``cumulative`` takes a CumSum of the positions (not per token);
    ``batch_from_ids`` expands inv_freq to Shape(input_ids)[0] rows first (torch 2.11's dynamo export of HF)."""
    inits = [("inv", INV_FREQ), ("ax_last", np.array([-1], np.int64)), ("ax_01", np.array([0, 1], np.int64)),
             ("inv3", INV_FREQ[None, :, None]), ("ax1", np.array([1], np.int64)),
             ("two_bf", np.array(2.0, np.float32)), ("i0", np.array(0, np.int64)),
             ("rest", np.array([D // 2, 1], np.int64)), ("ax0", np.array([0], np.int64))]
    nodes = []
    pos = "position_ids"
    if cumulative:
        nodes.append(helper.make_node("CumSum", ["position_ids", "ax1"], ["pos_c"]))
        pos = "pos_c"
    if reads_ids:
        nodes.append(helper.make_node("Add", [pos, "input_ids"], ["pos_i"]))
        pos = "pos_i"
    if form == "mul":
        nodes += [helper.make_node("Unsqueeze", [pos, "ax_last"], ["pu"]),
                  helper.make_node("Cast", ["pu"], ["pf"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", ["pf", "inv"], ["freqs"])]  # [1, T, D/2]
    else:
        inv = "inv3"
        if batch_from_ids:
            nodes += [helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
                      helper.make_node("Gather", ["ids_shape", "i0"], ["b"], axis=0),
                      helper.make_node("Unsqueeze", ["b", "ax0"], ["b1"]),
                      helper.make_node("Concat", ["b1", "rest"], ["inv_shape"], axis=0),
                      helper.make_node("Expand", ["inv3", "inv_shape"], ["inv_b"])]
            inv = "inv_b"
        nodes += [helper.make_node("Unsqueeze", [pos, "ax1"], ["pu"]),  # [1, 1, T]
                  helper.make_node("Cast", ["pu"], ["pf"], to=TensorProto.FLOAT),
                  helper.make_node("MatMul", [inv, "pf"], ["ft"]),  # [1, D/2, T]
                  helper.make_node("Transpose", ["ft"], ["freqs"], perm=[0, 2, 1])]
    nodes.append(helper.make_node("Concat", ["freqs", "freqs"], ["emb"], axis=-1))  # [1, T, D]
    for f in ("cos", "sin"):
        nodes.append(helper.make_node(f.capitalize(), ["emb"], [f"{f}_f"]))
        src = f"{f}_f"
        if bf16_tail:
            nodes.append(helper.make_node("Cast", [src], [f"{f}_b"], to=TensorProto.BFLOAT16))
            src = f"{f}_b"
            if bf16_tail == "arith":
                nodes += [helper.make_node("CastLike", ["two_bf", src], [f"{f}_two"]),
                          helper.make_node("Mul", [src, f"{f}_two"], [f"{f}_b2"])]
                src = f"{f}_b2"
            nodes.append(helper.make_node("Cast", [src], [f"{f}_r"], to=TensorProto.FLOAT))
            src = f"{f}_r"
        nodes.append(helper.make_node("Unsqueeze", [src, "ax1"], [f"{f}_u"]))
    nodes.append(helper.make_node("Rope", ["q", "cos_u", "sin_u"], ["y"], domain=DOMAIN, half=D // 2))
    inputs = [helper.make_tensor_value_info("q", FLOAT, [1, H, "T", D]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "T"])]
    if reads_ids or batch_from_ids:
        inputs.append(helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"]))
    proto = model(nodes, inputs, [helper.make_tensor_value_info("y", FLOAT, [1, H, "T", D])], inits)
    proto.opset_import.append(helper.make_opsetid(DOMAIN, OPSET_VERSION))
    return proto


def _apply(proto, max_positions: int = 64):
    m = ir.from_proto(proto)
    trace = Trace()
    count = tabulate_rope(m, trace, max_positions=max_positions)
    cleanup(m)  # the pipeline's dead-code removal drops the computation the tables replaced
    return count, ir.to_proto(m), trace


def _feeds(positions, reads_ids: bool = False):
    positions = np.asarray(positions, np.int64)[None]
    feeds = {"q": np.random.default_rng(0).standard_normal((1, H, positions.shape[1], D)).astype(np.float32),
             "position_ids": positions}
    if reads_ids:
        feeds["input_ids"] = np.zeros_like(positions)
    return feeds


@pytest.mark.parametrize("form", ["mul", "matmul", "matmul-batch-from-ids"])
def test_tables_replace_the_per_step_computation_bit_for_bit(form):
    ids = form.endswith("from-ids")  # input_ids read for its shape only: allowed, and no longer read at all after
    proto = _graph(form.split("-")[0], batch_from_ids=ids)
    count, fused, trace = _apply(proto)
    assert count == 2 and not trace.failures
    types = op_types(fused)
    assert "Cos" not in types and "Sin" not in types and types.count("Gather") == 2, types
    tables = {i.name: i for i in fused.graph.initializer if i.name.endswith(".table")}
    assert sorted(list(t.dims) for t in tables.values()) == [[1, 1, 64, D]] * 2  # what Rope reads
    for positions in ([0], [63], [5, 0, 63, 17, 17], list(range(64))):  # the table's ends, repeats, a whole prefill
        feeds = _feeds(positions, reads_ids=ids)
        fused_feeds = {k: v for k, v in feeds.items() if k in {i.name for i in fused.graph.input}}
        np.testing.assert_array_equal(run(fused, fused_feeds)[0], run(proto, feeds)[0])


def test_a_bf16_table_is_rounded_once_like_the_plans_cast():
    proto = _graph("mul", bf16_tail="cast")
    count, fused, trace = _apply(proto)
    # The Cast back to float32 is arithmetic on a bf16 value as far as the rule knows (it does not look past it),
    # so the tables stop at the bf16 Cast's readers: only the float32 Cast → Unsqueeze values remain candidates.
    assert count == 0 and trace.failures
    assert "computes on a bf16 value" in trace.failures[0].reason

    # The same subgraph ending at the bf16 value (what a bf16 plan's Rope reads) is tabulated in bf16.
    m = ir.from_proto(_graph("mul", bf16_tail="cast"))
    cos_b = next(v for n in m.graph for v in n.outputs if v.name == "cos_b")
    table, axis = rope_table._table(m, cos_b, m.graph.inputs[1], 64)
    assert axis == 1 and table.dtype == ml_dtypes.bfloat16
    angles = np.arange(64, dtype=np.float32)[:, None] * INV_FREQ
    want = np.cos(np.concatenate([angles, angles], -1)).astype(np.float32).astype(ml_dtypes.bfloat16)
    # numpy's and ORT's float32 cos agree to an ulp; after the bf16 rounding nearly every element is equal.
    assert np.mean(table[0].astype(np.float32) == want.astype(np.float32)) > 0.99


@pytest.mark.parametrize("case,reason", [
    ("reads_ids", "not only position_ids"),
    ("cumulative", "not a function of each token's position"),
    ("arith", "computes on a bf16 value"),
])
def test_what_is_not_a_per_position_table_is_left_alone(case, reason):
    proto = _graph("mul", reads_ids=case == "reads_ids", cumulative=case == "cumulative",
                   bf16_tail="arith" if case == "arith" else None)
    count, fused, trace = _apply(proto)
    types = op_types(fused)
    assert count == 0 and "Cos" in types and "Sin" in types and "Gather" not in types
    assert trace.failures and all(f.rule == "rope_table" for f in trace.failures)
    assert any(reason in f.reason for f in trace.failures), [f.reason for f in trace.failures]


def test_a_table_over_the_size_cap_is_left_alone(monkeypatch):
    monkeypatch.setattr(rope_table, "MAX_TABLE_BYTES", 1024)
    count, _, trace = _apply(_graph("mul"), max_positions=64)  # 64 × 8 float32 = 2 KiB per table
    assert count == 0 and "2,048 bytes (> 1,024)" in trace.failures[0].reason


def test_graphs_without_position_ids_or_rope_are_untouched():
    proto = _graph("mul")
    m = ir.from_proto(proto)
    m.graph.inputs[1].name = "positions"  # not the paged signature's input
    assert tabulate_rope(m, Trace(), max_positions=64) == 0
