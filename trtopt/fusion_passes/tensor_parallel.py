"""Tensor-parallel sharding of a fused paged plan (Megatron-style), run after every fusion.

For ``size`` ranks, every attention layer and every MLP that can be recognised is split so that each rank holds
1/size of its weights and of its KV heads:

    x ─RMSNorm─┬─ Q proj (columns: rank r's H/N query heads)   ─┐
               ├─ K proj (columns: rank r's KV heads)          ─┼─ PagedAttention (per-rank num_heads/num_kv_heads,
               └─ V proj (columns: rank r's KV heads)          ─┘  per-rank KV pool) ─ O proj (rows) ─ AllReduce ─ +x
    h ─RMSNorm─┬─ gate proj (columns: I/N) ─ act ─┐
               └─ up proj   (columns: I/N) ───────┴─ × ─ down proj (rows) ─ AllReduce ─ +h

KV heads are split when num_kv_heads >= N and replicated otherwise (each rank then keeps the one KV head its query
heads read, as vLLM does; N must be a multiple of num_kv_heads). Embedding and norms stay replicated. The LM head is
either replicated (``lm_head="replicated"``, the default: rank 0 computes exactly the sampled rows, nothing is
gathered) or vocabulary-parallel (``"vocab-parallel"``): its weight split by output columns, ceil(vocab/N) per rank
(the last shard padded with zero columns), then a trtopt.AllGather of the sampled logits rows along the vocabulary
axis and a Slice that drops the padding; an untied head saves hidden x vocab x (N-1)/N weights per rank for one
all-gather per step (docs/architecture.md §7b). Tied embeddings stay correct either way: the embedding Gather keeps the whole
table, and a vocab-parallel head tied to it gets its own per-rank initializer (the transposed table's columns).

The pass works on the graph structure, not on names: a projection is a MatMul (or trtopt.MatMulAdd) with a constant
2-D weight; a projection feeds a PagedAttention input when the path between them (followed only through values
that depend on input_ids) holds head-agnostic ops only (Reshape to [.., -1, D], Transpose, the RoPE arithmetic).
An MLP is a projection whose input is an elementwise function (scalar constants only) of projections of one
width. Attention that cannot be sharded is a FusionError (the KV pools of all layers must split alike); an MLP
that cannot be sharded stays replicated, and ``--explain`` lists why.

``shard_structure`` rewrites the graph once (new per-rank initializers hold rank 0's slices); ``rank_weights``
gives any rank's slices of the same initializers, so one rewritten graph serves every rank.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from trtopt import signature
from trtopt.errors import FusionError
from trtopt.fusion_passes.ir_helpers import is_op, projection_weight
from trtopt.fusion_passes.ops import DOMAIN

RULE = "tensor_parallel"
LM_HEAD_MODES = ("replicated", "vocab-parallel")
SHARD_SUFFIX = ".tp_shard"  # per-rank initializers: same name in every rank's plan, rank r's slice as data

# Ops a Q/K/V projection's output may pass through on its way to attention (per-head, head-count-agnostic).
_QKV_PATH_OPS = frozenset({"Reshape", "Transpose", "Mul", "Add", "Sub", "Neg", "Slice", "Concat", "Cast",
                           "Identity", "Unsqueeze", "Squeeze", "Div"})
_DATA_INPUT_0 = frozenset({"Reshape", "Slice", "Unsqueeze", "Squeeze", "Transpose", "Cast", "Identity"})
# Ops between attention's output and the O projection.
_O_PATH_OPS = frozenset({"Transpose", "Reshape", "Cast", "Identity"})
# Elementwise ops between an MLP's up projections and its down projection.
_MLP_PATH_OPS = frozenset({"Mul", "Add", "Sub", "Div", "Sigmoid", "Tanh", "Relu", "Gelu", "Erf", "Pow", "Neg",
                           "Cast", "Softplus", "Exp", "Identity", "HardSigmoid", "Where"})
# Elementwise trtopt ops an MLP path may hold (SwiGLU / GeGLU, fused by silu_mul.py / gelu_mul.py): each output
# column reads the same column of its inputs, so a column-split gate/up stays split through them.
# Likewise trtopt.Rope on the q/k paths: it rotates within each head's last axis, with tables that broadcast over
# heads (checked like a Mul's operands in _check_head_agnostic).
_POINTWISE_TRTOPT_OPS = {_MLP_PATH_OPS: frozenset({"SiluMul", "GeluMul"}), _QKV_PATH_OPS: frozenset({"Rope"})}


class _Skip(Exception):
    """A region the pass cannot shard: the reason, and the node where the check looked."""

    def __init__(self, reason: str, node: str = ""):
        super().__init__(reason)
        self.reason, self.node = reason, node


@dataclasses.dataclass(frozen=True)
class WeightSplit:
    """One initializer split along ``axis``: rank r keeps the index ranges ``ranges[r]`` (concatenated)."""

    source: str  # the unsplit initializer's name
    target: str  # the per-rank initializer's name (source + SHARD_SUFFIX + a counter when needed)
    axis: int  # of the (transposed, when ``transpose``) source
    ranges: tuple[tuple[tuple[int, int], ...], ...]  # per rank: ((start, stop), ...)
    transpose: bool = False  # split the source's transpose (a head tied to the [vocab, hidden] embedding)
    width: int = 0  # > 0: every rank's slice is padded with zeros to this length along ``axis`` (the last shard)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """What the pass did; plan.json records the summary, fusion_report.json all of it."""

    size: int
    num_heads: int  # global
    num_kv_heads: int  # global
    heads_per_rank: int
    kv_heads_per_rank: int
    kv_heads_replicated: bool  # num_kv_heads < size: each KV head lives on size/num_kv_heads ranks
    attention: tuple[dict, ...]  # per layer: {"attention", "q", "k", "v", "o"}: node names
    mlp: tuple[dict, ...]  # per sharded MLP: {"up": [...], "down"}
    replicated: tuple[dict, ...]  # {"node", "why"}: projections every rank computes whole (LM head, unsplit MLPs)
    lm_head: str = "replicated"  # one of LM_HEAD_MODES
    embedding: str = "replicated"
    # vocab-parallel only: {"node", "weight", "tied", "hidden", "vocab", "vocab_per_rank", "padding", "dtype_bytes",
    # "weight_bytes_saved_per_rank"}
    lm_head_split: dict | None = None

    @property
    def num_all_reduces(self) -> int:
        return len(self.attention) + len(self.mlp)

    @property
    def num_all_gathers(self) -> int:
        return 1 if self.lm_head_split is not None else 0

    def summary(self) -> dict:
        return {
            "tensor_parallel_size": self.size,
            "heads_per_rank": self.heads_per_rank,
            "kv_heads_per_rank": self.kv_heads_per_rank,
            "kv_heads_replicated": self.kv_heads_replicated,
            "sharded_attention_layers": len(self.attention),
            "sharded_mlps": len(self.mlp),
            "all_reduces_per_step": self.num_all_reduces,
            "replicated_projections": len(self.replicated),
            "lm_head": self.lm_head,
            "all_gathers_per_step": self.num_all_gathers,
            "lm_head_vocab_per_rank": self.lm_head_split["vocab_per_rank"] if self.lm_head_split else None,
            "embedding": self.embedding,
        }

    def to_dict(self) -> dict:
        return {**self.summary(), "attention": list(self.attention), "mlp": list(self.mlp),
                "replicated": list(self.replicated), "lm_head_split": self.lm_head_split}


@dataclasses.dataclass(frozen=True)
class ShardResult:
    layout: ParallelLayout
    splits: tuple[WeightSplit, ...]
    full_weights: dict  # source name -> np.ndarray of the unsplit weight (for rank_weights)


# ---------------------------------------------------------------------------------------------------------------
# Graph helpers.


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def _is_projection(node: ir.Node) -> bool:
    return projection_weight(node) is not None


def _weight_shape(node: ir.Node) -> tuple[int, int]:
    return tuple(int(d) for d in node.inputs[1].const_value.shape)  # type: ignore[return-value]


def _tainted(graph: ir.Graph) -> set[ir.Value]:
    """Values that depend on input_ids (the hidden states), as opposed to positions, tables and constants."""
    start = [v for v in graph.inputs if v.name == signature.INPUT_IDS.name]
    seen: set[ir.Value] = set(start)
    for node in graph:  # nodes are in topological order
        if node.op_type in ("Shape", "Size"):  # sizes, not values: shape arithmetic is not hidden state
            continue
        if any(v in seen for v in node.inputs if v is not None):
            seen.update(node.outputs)
    return seen


def _shape_elements(value: ir.Value | None) -> list[int | None] | None:
    """A Reshape target as far as it is constant: a constant, or a Concat of 1-D pieces (None = computed)."""
    array = _const(value)
    if array is not None:
        return [int(x) for x in array.reshape(-1)]
    producer = value.producer() if value is not None else None
    if producer is None or producer.op_type != "Concat":
        return None
    out: list[int | None] = []
    for piece in producer.inputs:
        array = _const(piece)
        if array is not None:
            out.extend(int(x) for x in array.reshape(-1))
        elif piece is not None and piece.shape is not None and len(piece.shape) == 1 and isinstance(piece.shape[0], int):
            out.extend([None] * int(piece.shape[0]))
        else:
            return None
    return out


def _check_head_agnostic(node: ir.Node, tainted: set[ir.Value]) -> None:
    """_Skip unless ``node`` computes the same per head whatever the number of heads."""
    if node.op_type == "Reshape":
        target = _shape_elements(node.inputs[1])
        if target is None:
            raise _Skip("its target shape is not a constant or a Concat of known pieces", node.name or "")
        if len(target) == 4 and target[2] != -1:
            raise _Skip(f"it reshapes to a fixed head count {target[2]} (expected -1)", node.name or "")
        if len(target) == 3 and target[2] not in (-1,):
            raise _Skip(f"it reshapes to a fixed width {target[2]} (expected -1)", node.name or "")
        if len(target) not in (3, 4):
            raise _Skip(f"it reshapes to rank {len(target)} (expected [B, T, -1, D] or [B, T, -1])", node.name or "")
    elif node.op_type in ("Slice",):
        axes = _const(node.inputs[3]) if len(node.inputs) > 3 else None
        if axes is None or any(int(a) not in (-1, 3) for a in axes.reshape(-1)):
            raise _Skip("it slices an axis other than the head dim", node.name or "")
    elif node.op_type == "Concat":
        axis = node.attributes["axis"].value if "axis" in node.attributes else 0
        if axis not in (-1, 3):
            raise _Skip(f"it concatenates along axis {axis}, not the head dim", node.name or "")
    elif node.op_type in ("Mul", "Add", "Sub", "Div", "Rope"):
        for operand in node.inputs:
            if operand is None or operand in tainted:
                continue
            shape = operand.shape
            if shape is None:
                raise _Skip(f"operand {operand.name} has no known shape", node.name or "")
            # A table broadcast over heads (RoPE's cos/sin [1, 1, T, D]): everything before the last two axes is 1.
            if any(d != 1 for d in list(shape)[:-2]):
                raise _Skip(f"operand {operand.name} {list(shape)} may vary per head", node.name or "")


def _projection_above(value: ir.Value, tainted: set[ir.Value], allowed: frozenset[str],
                      scalar_operands_only: bool = False) -> tuple[list[ir.Node], list[ir.Node]]:
    """The projections that ``value`` is computed from (walking tainted inputs only) and the nodes in between."""
    found: list[ir.Node] = []
    between: list[ir.Node] = []
    frontier, seen = [value], {value}
    while frontier:
        v = frontier.pop()
        node = v.producer()
        if node is None:
            raise _Skip(f"{v.name} is a graph input, not a projection's output")
        if _is_projection(node):
            if node not in found:
                found.append(node)
            continue
        trtopt_pointwise = node.domain == DOMAIN and node.op_type in _POINTWISE_TRTOPT_OPS.get(allowed, ())
        if not trtopt_pointwise and (node.domain not in ("", "ai.onnx") or node.op_type not in allowed):
            raise _Skip(f"{node.domain + '.' if node.domain else ''}{node.op_type} lies on the path", node.name or "")
        if scalar_operands_only:
            for operand in node.inputs:
                array = _const(operand)
                if operand is not None and operand not in tainted and (array is None or array.size != 1):
                    raise _Skip(f"operand {operand.name} is not a scalar constant", node.name or "")
        else:
            _check_head_agnostic(node, tainted)
        between.append(node)
        # Reshape's shape, Slice's starts/ends...: only input 0 carries data for these ops.
        data_inputs = node.inputs[:1] if node.op_type in _DATA_INPUT_0 else node.inputs
        for inp in data_inputs:
            if inp is not None and inp in tainted and inp not in seen:
                seen.add(inp)
                frontier.append(inp)
    return found, between


def _single_consumer(value: ir.Value) -> ir.Node:
    users = {use.node for use in value.uses()}
    if len(users) != 1 or value.is_graph_output():
        raise _Skip(f"{value.name} is read by {len(users)} nodes; the per-head values would escape the shard")
    return next(iter(users))


def _o_projection(out: ir.Value, tainted: set[ir.Value]) -> ir.Node:
    value = out
    while True:
        node = _single_consumer(value)
        if _is_projection(node):
            if node.inputs[0] is not value:
                raise _Skip("attention's output is a projection's weight", node.name or "")
            return node
        if node.op_type not in _O_PATH_OPS or node.domain not in ("", "ai.onnx"):
            raise _Skip(f"{node.op_type} lies between attention and the O projection", node.name or "")
        _check_head_agnostic(node, tainted)
        value = node.outputs[0]


# ---------------------------------------------------------------------------------------------------------------
# Analysis.


@dataclasses.dataclass
class _Plan:
    column: dict  # node -> per-rank column ranges
    row: dict  # node -> per-rank row ranges
    attention: list
    mlp: list
    replicated: list
    failures: list  # (anchor, reason, node)
    head: ir.Node | None = None  # the LM head to split by vocabulary (lm_head="vocab-parallel")


def _ranges(size: int, width: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    step = width // size
    return tuple(((r * step, (r + 1) * step),) for r in range(size))


def _attention_split(node: ir.Node, size: int) -> tuple[int, int, int, bool]:
    heads = int(node.attributes["num_heads"].value)
    kv_heads = int(node.attributes["num_kv_heads"].value)
    head_dim = int(node.attributes["head_dim"].value)
    if heads % size:
        raise _Skip(f"num_heads {heads} is not a multiple of --tensor-parallel {size}")
    if kv_heads >= size and kv_heads % size:
        raise _Skip(f"num_kv_heads {kv_heads} is not a multiple of --tensor-parallel {size}")
    if kv_heads < size and size % kv_heads:
        raise _Skip(f"--tensor-parallel {size} is not a multiple of num_kv_heads {kv_heads} (KV heads are "
                    "replicated only evenly)")
    return heads, kv_heads, head_dim, kv_heads < size


def _kv_ranges(size: int, kv_heads: int, head_dim: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    if kv_heads >= size:
        return _ranges(size, kv_heads * head_dim)
    per = size // kv_heads  # ranks sharing one KV head
    return tuple((((r // per) * head_dim, (r // per + 1) * head_dim),) for r in range(size))


def _analyze(model: ir.Model, size: int, lm_head: str) -> _Plan:
    graph = model.graph
    tainted = _tainted(graph)
    plan = _Plan({}, {}, [], [], [], [])
    if lm_head == "vocab-parallel":
        try:
            plan.head = _lm_head(graph)
            _head_weight(plan.head)
        except _Skip as e:
            raise FusionError(f"--lm-head vocab-parallel: the LM head cannot be split by vocabulary: {e.reason}"
                              + (f" (at {e.node})" if e.node else "") + ". Build with --lm-head replicated.") from None
    attention = [n for n in graph if n.domain == DOMAIN and n.op_type == "PagedAttention"]
    for layer, node in enumerate(attention):
        try:
            heads, kv_heads, head_dim, _ = _attention_split(node, size)
            projections = []
            for i, (what, width) in enumerate((("q", heads), ("k", kv_heads), ("v", kv_heads))):
                found, _ = _projection_above(node.inputs[i], tainted, _QKV_PATH_OPS)
                if len(found) != 1:
                    raise _Skip(f"{what} comes from {len(found)} projections, expected one")
                proj = found[0]
                if _weight_shape(proj)[1] != width * head_dim:
                    raise _Skip(f"{what} projection {proj.name} has {_weight_shape(proj)[1]} outputs, expected "
                                f"{width} heads x {head_dim}", proj.name or "")
                projections.append(proj)
            if len({id(p) for p in projections}) != 3:
                raise _Skip("Q, K and V share a projection (a concatenated QKV weight is not split yet)")
            o_proj = _o_projection(node.outputs[0], tainted)
            if _weight_shape(o_proj)[0] != heads * head_dim:
                raise _Skip(f"O projection {o_proj.name} has {_weight_shape(o_proj)[0]} inputs, expected "
                            f"{heads * head_dim}", o_proj.name or "")
        except _Skip as e:
            plan.failures.append((node.name or f"attention {layer}", e.reason, e.node))
            continue
        q, k, v = projections
        plan.column[q] = _ranges(size, heads * head_dim)
        plan.column[k] = plan.column[v] = _kv_ranges(size, kv_heads, head_dim)
        plan.row[o_proj] = _ranges(size, heads * head_dim)
        plan.attention.append({"attention": node.name, "q": q.name, "k": k.name, "v": v.name, "o": o_proj.name})

    claimed = set(plan.column) | set(plan.row)
    why_not: dict[ir.Node, _Skip] = {}
    for node in graph:
        if not _is_projection(node) or node in claimed:
            continue
        width_in = _weight_shape(node)[0]
        try:
            ups, between = _projection_above(node.inputs[0], tainted, _MLP_PATH_OPS, scalar_operands_only=True)
            if not ups:
                raise _Skip("its input is not computed from other projections")
            if any(_weight_shape(up)[1] != width_in or up in claimed for up in ups):
                raise _Skip("its input mixes projections of other widths or of attention")
            inside = set(between) | {node}
            for up in ups:
                if any(use.node not in inside for use in up.outputs[0].uses()) or up.outputs[0].is_graph_output():
                    raise _Skip(f"{up.name}'s output is read outside the MLP", up.name or "")
            if width_in % size:
                raise _Skip(f"intermediate size {width_in} is not a multiple of --tensor-parallel {size}")
        except _Skip as e:
            why_not[node] = e  # it may still turn out to be another MLP's up projection
            continue
        for up in ups:
            plan.column[up] = _ranges(size, width_in)
            claimed.add(up)
        plan.row[node] = _ranges(size, width_in)
        claimed.add(node)
        plan.mlp.append({"up": [u.name for u in ups], "down": node.name})
    for node in graph:  # a head tied to the embedding multiplies by Transpose(embedding): no constant weight
        if node.op_type == "MatMul" and not _is_projection(node) and node.inputs[0] in tainted \
                and node.inputs[1] not in tainted and _feeds_logits(node) and node is not plan.head:
            plan.replicated.append({"node": node.name, "why": "LM head (tied to the embedding): replicated (the "
                                    "driver samples full-vocabulary rows)", "at": ""})
    for node, e in why_not.items():
        if node not in claimed and node is not plan.head:
            why = "LM head: replicated (the driver samples full-vocabulary rows)" if _feeds_logits(node) else e.reason
            plan.replicated.append({"node": node.name, "why": why, "at": e.node})
    return plan


def _lm_head(graph: ir.Graph) -> ir.Node:
    """The MatMul (or MatMulAdd) whose output becomes ``logits`` through Cast/Identity/Squeeze only (the shape
    logits_gather.py leaves: head -> [Cast] -> Squeeze -> [Cast] -> logits)."""
    logits = next((v for v in graph.outputs if v.name == signature.LOGITS.name), None)
    node = logits.producer() if logits is not None else None
    while node is not None and node.domain in ("", "ai.onnx") and node.op_type in ("Cast", "Identity", "Squeeze"):
        node = node.inputs[0].producer()
    if node is None or not (is_op(node, "MatMul") or (node.domain == DOMAIN and node.op_type == "MatMulAdd")):
        found = f"{node.op_type} {node.name}" if node is not None else "a graph input"
        raise _Skip(f"`logits` is computed by {found}, not by a MatMul through Cast/Squeeze")
    if node.outputs[0].is_graph_output():
        raise _Skip("the LM head's output is itself a graph output", node.name or "")
    return node


def _head_weight(head: ir.Node) -> tuple[ir.Value, bool]:
    """(the constant holding the LM head's weight, whether it is stored transposed: [vocab, hidden], the tied
    embedding that the head reads through a Transpose)."""
    weight = head.inputs[1]
    if weight is not None and weight.const_value is not None and len(weight.const_value.shape) == 2:
        return weight, False
    producer = weight.producer() if weight is not None else None
    if producer is not None and producer.op_type == "Transpose" and producer.domain in ("", "ai.onnx"):
        perm = producer.attributes["perm"].value if "perm" in producer.attributes else None
        source = producer.inputs[0]
        if (perm is None or list(perm) == [1, 0]) and source.const_value is not None \
                and len(source.const_value.shape) == 2:
            return source, True
    raise _Skip("its weight is neither a constant [hidden, vocab] matrix nor Transpose([vocab, hidden] constant)",
                head.name or "")


def _feeds_logits(node: ir.Node) -> bool:
    frontier, seen = [node.outputs[0]], set()
    while frontier:
        value = frontier.pop()
        if value.is_graph_output() and value.name == signature.LOGITS.name:
            return True
        for use in value.uses():
            for out in use.node.outputs:
                if out not in seen:
                    seen.add(out)
                    frontier.append(out)
    return False


# ---------------------------------------------------------------------------------------------------------------
# Rewrite.


def _slice(array: np.ndarray, axis: int, ranges: tuple[tuple[int, int], ...]) -> np.ndarray:
    parts = [np.take(array, np.arange(a, b), axis=axis) for a, b in ranges]
    return np.ascontiguousarray(np.concatenate(parts, axis=axis))


def _shard_data(full: np.ndarray, split: WeightSplit, rank: int) -> np.ndarray:
    """Rank ``rank``'s slice of ``full`` (the unsplit source) as ``split`` says: the one contract both the rewritten
    graph (rank 0) and ``rank_weights`` (every rank) use."""
    data = _slice(full.T if split.transpose else full, split.axis, split.ranges[rank])
    missing = split.width - data.shape[split.axis] if split.width else 0
    if missing > 0:  # the last vocabulary shard: zero columns, whose logits the Slice after the gather drops
        pad = list(data.shape)
        pad[split.axis] = missing
        data = np.concatenate([data, np.zeros(pad, dtype=data.dtype)], axis=split.axis)
    return np.ascontiguousarray(data)


class _Rewriter:
    def __init__(self, model: ir.Model, size: int):
        self.graph = model.graph
        self.size = size
        self.splits: dict[tuple[str, int, tuple], WeightSplit] = {}
        self.values: dict[str, ir.Value] = {}
        self.full: dict[str, np.ndarray] = {}

    def shard(self, value: ir.Value, axis: int, ranges, *, transpose: bool = False, width: int = 0) -> ir.Value:
        """The per-rank initializer for ``value`` split so (shared by every user with the same split)."""
        key = (value.name, axis, ranges, transpose, width)
        if key in self.splits:
            return self.values[self.splits[key].target]
        if value.name not in self.full:
            self.full[value.name] = value.const_value.numpy()
        target = f"{value.name}{SHARD_SUFFIX}"
        n = 1
        while target in self.graph.initializers or target in self.values:
            target, n = f"{value.name}{SHARD_SUFFIX}{n}", n + 1
        split = WeightSplit(value.name, target, axis, ranges, transpose, width)
        data = _shard_data(self.full[value.name], split, 0)
        new = ir.Value(name=target, const_value=ir.tensor(data, dtype=value.const_value.dtype, name=target))
        new.type = ir.TensorType(value.const_value.dtype)
        new.shape = ir.Shape(data.shape)
        self.graph.register_initializer(new)
        self.splits[key] = split
        self.values[target] = new
        return new

    def constant(self, name: str, values: list[int]) -> ir.Value:
        array = np.array(values, dtype=np.int64)
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        value.shape, value.type = ir.Shape(array.shape), ir.TensorType(ir.DataType.INT64)
        self.graph.register_initializer(value)
        return value

    def vocab_parallel_head(self, head: ir.Node) -> dict:
        """Split the LM head's weight by output columns, ceil(vocab/size) per rank (the last shard zero-padded), and
        put AllGather(axis=-1) [+ Slice off the padding] between the head and its users. Returns the record."""
        weight, transposed = _head_weight(head)
        hidden, vocab = (weight.const_value.shape[1], weight.const_value.shape[0]) if transposed else \
            tuple(weight.const_value.shape)
        hidden, vocab = int(hidden), int(vocab)
        per_rank = -(-vocab // self.size)
        ranges = tuple(((min(r * per_rank, vocab), min((r + 1) * per_rank, vocab)),) for r in range(self.size))
        table = head.inputs[1].producer() if transposed else None
        head.replace_input_with(1, self.shard(weight, 1, ranges, transpose=transposed, width=per_rank))
        if head.op_type == "MatMulAdd":
            head.replace_input_with(2, self.shard(head.inputs[2], 0, ranges, width=per_rank))
        if table is not None and not table.outputs[0].uses():  # the embedding Gather keeps the table itself
            self.graph.remove(table, safe=True)
        out = head.outputs[0]
        users = list(out.uses())
        gather = ir.Node(DOMAIN, "AllGather", [out], [ir.AttrInt64("world_size", self.size), ir.AttrInt64("axis", -1)],
                         name=f"{head.name}.all_gather")
        new_nodes, result = [gather], gather.outputs[0]
        padding = per_rank * self.size - vocab
        if padding:
            name = f"{head.name}.vocab"
            bounds = [self.constant(f"{name}_{what}", [v]) for what, v in (("starts", 0), ("ends", vocab), ("axes", -1))]
            drop = ir.node("Slice", [result, *bounds], name=f"{head.name}.drop_padding")
            new_nodes.append(drop)
            result = drop.outputs[0]
        for node in new_nodes:
            node.outputs[0].dtype = out.dtype
        self.graph.insert_after(head, new_nodes)
        for use in users:
            use.node.replace_input_with(use.idx, result)
        itemsize = int(self.full[weight.name].itemsize)
        # Against the replicated plan: an untied head drops all but its columns; a tied one had no weight of its own
        # (it read the embedding table), so its shard is new bytes (negative saving).
        shard_bytes = hidden * per_rank * itemsize
        saved = -shard_bytes if transposed else hidden * vocab * itemsize - shard_bytes
        return {"node": head.name, "weight": weight.name, "tied": transposed, "hidden": hidden, "vocab": vocab,
                "vocab_per_rank": per_rank, "padding": padding, "dtype_bytes": itemsize,
                "weight_bytes_saved_per_rank": saved}

    def column(self, node: ir.Node, ranges) -> None:
        node.replace_input_with(1, self.shard(node.inputs[1], 1, ranges))
        if node.op_type == "MatMulAdd":
            node.replace_input_with(2, self.shard(node.inputs[2], 0, ranges))

    def row(self, node: ir.Node, ranges) -> None:
        weight = self.shard(node.inputs[1], 0, ranges)
        out = node.outputs[0]
        matmul = ir.node("MatMul", [node.inputs[0], weight], name=f"{node.name}.tp_row")
        reduced = ir.Node(DOMAIN, "AllReduce", [matmul.outputs[0]],
                          [ir.AttrInt64("world_size", self.size)], name=f"{node.name}.all_reduce")
        new_nodes = [matmul, reduced]
        result = reduced.outputs[0]
        if node.op_type == "MatMulAdd":  # the bias is added once, after the sum
            add = ir.node("Add", [result, node.inputs[2]], name=f"{node.name}.bias")
            new_nodes.append(add)
            result = add.outputs[0]
        matmul.outputs[0].dtype = result.dtype = reduced.outputs[0].dtype = out.dtype
        self.graph.insert_after(node, new_nodes)
        ir.convenience.replace_all_uses_with(out, result, replace_graph_outputs=True)
        if out.is_graph_output():
            name = out.name
            out.name = f"{name}.replaced"
            result.name = name
        self.graph.remove(node, safe=True)


def shard_structure(model: ir.Model, size: int, lm_head: str = "replicated") -> ShardResult:
    """Rewrite ``model`` in place into the tensor-parallel rank graph (rank 0's weights); FusionError when an
    attention layer (or, with ``lm_head="vocab-parallel"``, the LM head) cannot be sharded (the reasons name the
    nodes)."""
    assert size >= 1 and lm_head in LM_HEAD_MODES, (size, lm_head)
    plan = _analyze(model, size, lm_head)
    attention = [n for n in model.graph if n.domain == DOMAIN and n.op_type == "PagedAttention"]
    if not attention:
        raise FusionError("--tensor-parallel needs a paged plan (a causal LM with a KV cache); this graph has no "
                          "attention layers to shard.")
    if plan.failures:
        lines = "\n".join(f"  {anchor}: {reason}" + (f" (at {at})" if at else "") for anchor, reason, at in plan.failures)
        raise FusionError(f"{len(plan.failures)} attention layer(s) cannot be sharded over {size} ranks:\n{lines}\n"
                          "Build without --tensor-parallel, or choose a size that divides the head counts.")
    heads, kv_heads, head_dim, replicated_kv = _attention_split(attention[0], size)
    heads_per_rank = heads // size
    kv_per_rank = max(kv_heads // size, 1)
    rewriter = _Rewriter(model, size)
    for node, ranges in plan.column.items():
        rewriter.column(node, ranges)
    for node, ranges in plan.row.items():
        rewriter.row(node, ranges)
    head_split = rewriter.vocab_parallel_head(plan.head) if plan.head is not None else None
    for node in attention:
        node.attributes["num_heads"] = ir.AttrInt64("num_heads", heads_per_rank)
        node.attributes["num_kv_heads"] = ir.AttrInt64("num_kv_heads", kv_per_rank)
        alibi = node.inputs[8] if len(node.inputs) > 8 else None
        if alibi is not None and alibi.const_value is not None:
            node.replace_input_with(8, rewriter.shard(alibi, 0, _ranges(size, heads)))
    _retype_kv_io(model, kv_per_rank)
    # Shapes recorded for intermediate values describe the unsplit graph; the converter folds static shapes, so
    # stale ones must go (graph inputs, outputs and initializers keep theirs).
    keep = set(model.graph.inputs) | set(model.graph.outputs) | set(model.graph.initializers.values())
    for node in model.graph:
        for out in node.outputs:
            if out not in keep:
                out.shape = None
    for name in [n for n, v in model.graph.initializers.items() if not v.uses() and not v.is_graph_output()]:
        del model.graph.initializers[name]
    layout = ParallelLayout(
        size=size, num_heads=heads, num_kv_heads=kv_heads, heads_per_rank=heads_per_rank,
        kv_heads_per_rank=kv_per_rank, kv_heads_replicated=replicated_kv, attention=tuple(plan.attention),
        mlp=tuple(plan.mlp), replicated=tuple(plan.replicated), lm_head=lm_head, lm_head_split=head_split,
    )
    return ShardResult(layout, tuple(rewriter.splits.values()), rewriter.full)


def _retype_kv_io(model: ir.Model, kv_per_rank: int) -> None:
    """kv_cache.{i} / kv_cache_out.{i} are [num_blocks, 2, Hkv, block, D]: Hkv becomes the per-rank count."""
    for value in [*model.graph.inputs, *model.graph.outputs]:
        if (signature.is_kv_input(value.name) or signature.is_kv_output(value.name)) and value.shape is not None:
            dims = list(value.shape)
            dims[2] = kv_per_rank
            value.shape = ir.Shape(dims)


def rank_weights(result: ShardResult, rank: int) -> dict[str, np.ndarray]:
    """Per-rank initializer name -> rank ``rank``'s slice."""
    return {s.target: _shard_data(result.full_weights[s.source], s, rank) for s in result.splits}


def unsharded_reasons(layout: ParallelLayout) -> list[str]:
    """``--explain`` lines: each projection left whole, and why."""
    return [f"{RULE} | {r['node']}: not sharded: {r['why']}" + (f" (at {r['at']})" if r.get("at") else "")
            for r in layout.replicated]


def lm_head_reason(layout: ParallelLayout) -> str | None:
    """The ``--explain`` line of a vocabulary-parallel LM head (what was split, and what it costs and saves)."""
    split = layout.lm_head_split
    if split is None:
        return None
    padding = f" (the last shard padded by {split['padding']} zero columns, sliced off after the gather)" \
        if split["padding"] else ""
    mib = abs(split["weight_bytes_saved_per_rank"]) / 2**20
    if split["tied"]:
        memory = f"adds {mib:.1f} MiB per rank (tied: the shard is its own initializer, the embedding keeps the table)"
    else:
        memory = (f"saves {mib:.1f} MiB of head weights per rank (hidden {split['hidden']} x vocab x "
                  f"{split['dtype_bytes']} B x (N-1)/N)")
    return (f"{RULE} | {split['node']}: LM head vocab-parallel: {split['vocab_per_rank']} of {split['vocab']} "
            f"vocabulary columns per rank{padding}; one all-gather of the sampled logits rows per step; {memory}")
