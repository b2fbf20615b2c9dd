"""Part of the paged signature rewrite: re-source shape reads of the cache tensors that the rewrite removes.

Exporters read sizes off past/present tensors: the batch size (dim 0) from ``Shape(past)[0:1]`` (dynamo), the
head_dim (dim 3) from ``Gather(Shape(present), 3)`` (legacy SDPA). Those tensors disappear in the paged graph,
so each such read is re-sourced: dim 0 from ``input_ids`` (both are the batch, 1), dims 1 and 3 (kv heads,
head_dim) from constants. A read of dim 2 (the past length) has no meaning in the paged graph; it is left in place
and the rewrite then reports the tensor as still read.
"""

from __future__ import annotations

import onnx_ir as ir

from trtopt.fusion_passes.ir_helpers import int64_initializer, int_list_constant

_RANK = 4  # [B, Hkv, L, D]
_LENGTH_AXIS = 2


def _shape_range(node: ir.Node) -> range:
    start = node.attributes["start"].value if "start" in node.attributes else 0
    end = node.attributes["end"].value if "end" in node.attributes else _RANK
    start, end = start % _RANK if start < 0 else start, end % _RANK if end < 0 else min(end, _RANK)
    return range(start, end)


def _reads_only(shape_node: ir.Node, dims: range) -> bool:
    """True when the dims read from this Shape never include the length axis."""
    if _LENGTH_AXIS not in dims:
        return True
    for use in shape_node.outputs[0].uses():
        gather = use.node
        if gather.op_type != "Gather" or use.idx != 0:
            return False
        indices = int_list_constant(gather.inputs[1])
        if indices is None or any(dims[i] == _LENGTH_AXIS for i in indices):
            return False
    return True


def rebind_cache_shapes(graph: ir.Graph, cut: dict[int, int], *, batch_source: ir.Value, head_dim: int) -> int:
    """Replace Shape reads of the ``cut`` tensors that avoid the length axis; returns how many were replaced.

    cut: id(value) → its head count (dim 1): kv heads for past/present, query heads after repeat_kv.
    """
    batch = ir.Node(
        "", "Shape", [batch_source], [ir.AttrInt64("start", 0), ir.AttrInt64("end", 1)], name="paged_batch_size"
    )
    sources = {
        0: batch.outputs[0],
        # Proven never read (see _reads_only); it only keeps the vector's length.
        2: int64_initializer(graph, "paged_unread_length", [0]),
        3: int64_initializer(graph, "paged_head_dim", [head_dim]),
    }
    replaced = 0
    shape_nodes = [n for n in graph if n.op_type == "Shape" and n.inputs[0] is not None and id(n.inputs[0]) in cut]
    if shape_nodes:
        graph.insert_before(next(iter(graph)), batch)
    for node in shape_nodes:
        dims = _shape_range(node)
        if not _reads_only(node, dims):
            continue
        heads = cut[id(node.inputs[0])]
        parts = [sources[d] if d != 1 else int64_initializer(graph, f"{node.name}_heads", [heads]) for d in dims]
        concat = ir.Node("", "Concat", parts, [ir.AttrInt64("axis", 0)], name=f"{node.name}_paged")
        graph.insert_after(node, concat)
        ir.convenience.replace_all_uses_with(node.outputs[0], concat.outputs[0])
        replaced += 1
    return replaced
