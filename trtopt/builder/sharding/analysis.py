"""Tensor-parallel sharding analysis of a fused paged plan (Megatron-style), run after every fusion
(docs/architecture.md §7b); writer.py writes the rank plan dirs it produces.

For ``size`` ranks, every attention layer and every MLP that can be recognised is split so that each rank holds
1/size of its weights and of its KV heads:

    x ─RMSNorm─┬─ Q proj (columns: rank r's H/N query heads)   ─┐
               ├─ K proj (columns: rank r's KV heads)          ─┼─ PagedAttention (per-rank num_heads/num_kv_heads,
               └─ V proj (columns: rank r's KV heads)          ─┘  per-rank KV pool) ─ O proj (rows) ─ AllReduce ─ +x
    h ─RMSNorm─┬─ gate proj (columns: I/N) ─ act ─┐
               └─ up proj   (columns: I/N) ───────┴─ × ─ down proj (rows) ─ AllReduce ─ +h

KV heads are split when num_kv_heads >= N and replicated otherwise (each rank then keeps the one KV head its query
heads read, as vLLM does; N must be a multiple of num_kv_heads). A constant of one row per head that an elementwise
op applies right at a PagedAttention input or output ([1, H, 1, D]: --kv-cache-smoothing's calibrated means) is
split by heads like them, replicated KV heads included. Embedding and norms stay replicated. The LM head is either
replicated (``lm_head="replicated"``, the default: rank 0 computes exactly the sampled rows, nothing is
gathered) or vocabulary-parallel (``"vocab-parallel"``): its weight split by output columns, ceil(vocab/N) per rank
(the last shard padded with zero columns), then a trtopt.AllGather of the sampled logits rows along the vocabulary
axis and a Slice that drops the padding; an untied head saves hidden x vocab x (N-1)/N weights per rank for one
all-gather per step (docs/architecture.md §7b). Tied embeddings stay correct either way: the embedding Gather keeps
the whole table, and a vocab-parallel head tied to it gets its own per-rank initializer (the transposed table's
columns).

The analysis works on the graph structure, not on names: a projection is a MatMul (or trtopt.MatMulAdd) with a
constant 2-D weight, or a trtopt.QMatMul with constant codes, scale and zero point (a quantized projection,
docs/architecture.md §4: column-parallel ones split w_q, w_scale and w_zero_point along N; row-parallel ones split
w_q along K, and INT4 block scales and zero points along K/G, so the K shard must be a multiple of block_size, else
FusionError; FP8 per-channel scales and the activation scale and zero point are replicated); a projection feeds a PagedAttention input when the path between them (followed only through
values that depend on input_ids) holds head-agnostic ops only (Reshape to [.., -1, D], Transpose, the RoPE
arithmetic). An MLP is a projection whose input is an elementwise function (scalar constants only) of projections of
one width. Every check that fails is a value with its reason (a ``MatchFailure`` of rule ``tensor_parallel``, as
the fusion passes record them, STYLE.md 7): attention that cannot be sharded is a FusionError naming them (the KV
pools of all layers must split alike); an MLP that cannot be sharded stays replicated, and ``--explain`` lists why.

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
from trtopt.fusion_passes.qmatmul import ACT_SCALE, W_Q, W_SCALE, W_ZERO_POINT, is_quantized_projection
from trtopt.fusion_passes.trace import MatchFailure, NoMatch
from trtopt.plugins.qmatmul.schema import ACT_DYNAMIC

RULE = "tensor_parallel"
LM_HEAD_MODES = ("replicated", "vocab-parallel")
SHARD_SUFFIX = ".tp_shard"  # per-rank initializers: same name in every rank's plan, rank r's slice as data
LM_HEAD_REPLICATED = "LM head: replicated (the driver samples full-vocabulary rows)"

# Ops a Q/K/V projection's output may pass through on its way to attention (per-head, head-count-agnostic).
_QKV_PATH_OPS = frozenset({"Reshape", "Transpose", "Mul", "Add", "Sub", "Neg", "Slice", "Concat", "Cast",
                           "Identity", "Unsqueeze", "Squeeze", "Div"})
_DATA_INPUT_0 = frozenset({"Reshape", "Slice", "Unsqueeze", "Squeeze", "Transpose", "Cast", "Identity"})
# Ops between attention's output and the O projection.
_O_PATH_OPS = frozenset({"Transpose", "Reshape", "Cast", "Identity"})
# Elementwise ops that may stand right at a PagedAttention input or output with a constant of one row per head,
# [1, H, 1, D] in the op boundary's [1, H, T, D] layout: --kv-cache-smoothing's Sub(k, b_k), Sub(v, b_v) and
# Add(out, b_v per query head) (fusion_passes/kv_smoothing.py). The constant is split by heads like the projection.
_PER_HEAD_OPS = frozenset({"Add", "Sub", "Mul", "Div"})
# Elementwise ops between an MLP's up projections and its down projection.
_MLP_PATH_OPS = frozenset({"Mul", "Add", "Sub", "Div", "Sigmoid", "Tanh", "Relu", "Gelu", "Erf", "Pow", "Neg",
                           "Cast", "Softplus", "Exp", "Identity", "HardSigmoid", "Where"})
# Elementwise trtopt ops an MLP path may hold (SwiGLU / GeGLU, fused by silu_mul.py / gelu_mul.py): each output
# column reads the same column of its inputs, so a column-split gate/up stays split through them.
# Likewise trtopt.Rope on the q/k paths: it rotates within each head's last axis, with tables that broadcast over
# heads (checked like a Mul's operands in _check_head_agnostic).
_POINTWISE_TRTOPT_OPS = {_MLP_PATH_OPS: frozenset({"SiluMul", "GeluMul"}), _QKV_PATH_OPS: frozenset({"Rope"})}

Ranges = tuple[tuple[tuple[int, int], ...], ...]  # per rank: the ((start, stop), ...) index ranges it keeps
_SCALE_CHAIN_NODES = 16  # at most this many ops compute a QMatMul's per-token activation scale from its x
_GROUP_SIZES = (256, 128, 64, 32, 16, 8)  # INT4 block sizes suggested when a row-parallel K shard splits a block


@dataclasses.dataclass(frozen=True)
class WeightSplit:
    """One initializer split along ``axis``: rank r keeps the index ranges ``ranges[r]`` (concatenated)."""

    source: str  # the unsplit initializer's name
    target: str  # the per-rank initializer's name (source + SHARD_SUFFIX + a counter when needed)
    axis: int  # of the (transposed, when ``transpose``) source
    ranges: Ranges  # per rank: ((start, stop), ...)
    transpose: bool = False  # split the source's transpose (a head tied to the [vocab, hidden] embedding)
    width: int = 0  # > 0: every rank's slice is padded with zeros to this length along ``axis`` (the last shard)


@dataclasses.dataclass(frozen=True)
class AttentionShard:
    """One attention layer split by heads: its projections, by node name."""

    attention: str  # the trtopt.PagedAttention node
    q: str  # the query projection (split by columns: rank r's query heads)
    k: str  # the key projection (split by columns, or replicated per KV head when num_kv_heads < size)
    v: str  # the value projection (split like k)
    o: str  # the output projection (split by rows, followed by an AllReduce)


@dataclasses.dataclass(frozen=True)
class MlpShard:
    """One MLP split by its intermediate width."""

    up: tuple[str, ...]  # the projections that compute the intermediate (gate and up; split by columns)
    down: str  # the projection that reads it (split by rows, followed by an AllReduce)


@dataclasses.dataclass(frozen=True)
class ReplicatedProjection:
    """A projection every rank computes whole (the LM head, an MLP that could not be split)."""

    node: str  # the projection node
    why: str  # the reason it was left whole, in words (the failed check for an unsplit MLP)
    at: str = ""  # the node where the failing check looked, when it is not ``node``


@dataclasses.dataclass(frozen=True)
class LmHeadSplit:
    """A vocabulary-parallel LM head (``lm_head="vocab-parallel"``): what was split, and what it costs and saves."""

    node: str  # the LM head's MatMul (or trtopt.MatMulAdd)
    weight: str  # the initializer split by vocabulary columns (the embedding table when tied)
    tied: bool  # the head read the [vocab, hidden] embedding through a Transpose; its shard is a new initializer
    hidden: int  # the head's input width
    vocab: int  # the head's output width (the vocabulary)
    vocab_per_rank: int  # ceil(vocab / size): columns each rank holds
    padding: int  # zero columns padding the last rank's shard (vocab_per_rank * size - vocab)
    dtype_bytes: int  # bytes per weight element
    weight_bytes_saved_per_rank: int  # against the replicated head; negative when tied (the shard is new bytes)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """What the sharding did; plan.json records the summary, fusion_report.json all of it."""

    size: int  # ranks the graph was sharded for
    num_heads: int  # global query heads
    num_kv_heads: int  # global KV heads
    heads_per_rank: int  # num_heads / size
    kv_heads_per_rank: int  # num_kv_heads / size, or 1 when the KV heads are replicated
    kv_heads_replicated: bool  # num_kv_heads < size: each KV head lives on size/num_kv_heads ranks
    attention: tuple[AttentionShard, ...]  # per attention layer, in graph order
    mlp: tuple[MlpShard, ...]  # per sharded MLP, in graph order
    replicated: tuple[ReplicatedProjection, ...]  # projections every rank computes whole (LM head, unsplit MLPs)
    lm_head: str = "replicated"  # one of LM_HEAD_MODES
    embedding: str = "replicated"  # the embedding table is never split
    lm_head_split: LmHeadSplit | None = None  # vocab-parallel only

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
            "lm_head_vocab_per_rank": self.lm_head_split.vocab_per_rank if self.lm_head_split else None,
            "embedding": self.embedding,
        }

    def to_dict(self) -> dict:
        """fusion_report.json's "parallel" object."""
        return {**self.summary(), "attention": [dataclasses.asdict(a) for a in self.attention],
                "mlp": [{"up": list(m.up), "down": m.down} for m in self.mlp],
                "replicated": [dataclasses.asdict(r) for r in self.replicated],
                "lm_head_split": dataclasses.asdict(self.lm_head_split) if self.lm_head_split else None}


@dataclasses.dataclass(frozen=True)
class Join:
    """An initializer of the rank graph that concatenates others along ``axis`` (horizontal fusion after sharding:
    rank r's Q/K/V or gate/up weights side by side are its own slices side by side)."""

    members: tuple[str, ...]  # per-rank initializers (WeightSplit targets) or constants every rank shares, in order
    axis: int
    shape: tuple[int, ...]  # rank 0's (every rank's: the members' widths are equal on every rank)
    shared: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # members that are not split


@dataclasses.dataclass(frozen=True)
class ShardResult:
    """The rewritten rank graph's layout, and what ``rank_weights`` needs to give any rank its slices."""

    layout: ParallelLayout
    splits: tuple[WeightSplit, ...]  # every per-rank initializer of the rewritten graph
    full_weights: dict[str, np.ndarray]  # source name -> the unsplit weight
    joins: dict[str, Join] = dataclasses.field(default_factory=dict)  # joined initializer name -> its members
    joined_away: frozenset[str] = frozenset()  # split targets only a join reads (no longer in the graph)


# ---------------------------------------------------------------------------------------------------------------
# Graph helpers.


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def _is_projection(node: ir.Node) -> bool:
    return projection_weight(node) is not None or is_quantized_projection(node)


def _attr(node: ir.Node, name: str) -> int:
    return int(node.attributes[name].value) if name in node.attributes else 0


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
        elif (piece is not None and piece.shape is not None and len(piece.shape) == 1
              and isinstance(piece.shape[0], int)):
            out.extend([None] * int(piece.shape[0]))
        else:
            return None
    return out


def _check_head_agnostic(node: ir.Node, tainted: set[ir.Value]) -> None:
    """NoMatch unless ``node`` computes the same per head whatever the number of heads."""
    if node.op_type == "Reshape":
        target = _shape_elements(node.inputs[1])
        if target is None:
            raise NoMatch("its target shape is not a constant or a Concat of known pieces", node.name or "")
        if len(target) == 4 and target[2] != -1:
            raise NoMatch(f"it reshapes to a fixed head count {target[2]} (expected -1)", node.name or "")
        if len(target) == 3 and target[2] not in (-1,):
            raise NoMatch(f"it reshapes to a fixed width {target[2]} (expected -1)", node.name or "")
        if len(target) not in (3, 4):
            raise NoMatch(f"it reshapes to rank {len(target)} (expected [B, T, -1, D] or [B, T, -1])", node.name or "")
    elif node.op_type in ("Slice",):
        axes = _const(node.inputs[3]) if len(node.inputs) > 3 else None
        if axes is None or any(int(a) not in (-1, 3) for a in axes.reshape(-1)):
            raise NoMatch("it slices an axis other than the head dim", node.name or "")
    elif node.op_type == "Concat":
        axis = node.attributes["axis"].value if "axis" in node.attributes else 0
        if axis not in (-1, 3):
            raise NoMatch(f"it concatenates along axis {axis}, not the head dim", node.name or "")
    elif node.op_type in ("Mul", "Add", "Sub", "Div", "Rope"):
        for operand in node.inputs:
            if operand is None or operand in tainted:
                continue
            shape = operand.shape
            if shape is None:
                raise NoMatch(f"operand {operand.name} has no known shape", node.name or "")
            # A table broadcast over heads (RoPE's cos/sin [1, 1, T, D]): everything before the last two axes is 1.
            if any(d != 1 for d in list(shape)[:-2]):
                raise NoMatch(f"operand {operand.name} {list(shape)} may vary per head", node.name or "")


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
            raise NoMatch(f"{v.name} is a graph input, not a projection's output")
        if _is_projection(node):
            if node not in found:
                found.append(node)
            continue
        trtopt_pointwise = node.domain == DOMAIN and node.op_type in _POINTWISE_TRTOPT_OPS.get(allowed, ())
        if not trtopt_pointwise and (node.domain not in ("", "ai.onnx") or node.op_type not in allowed):
            raise NoMatch(f"{node.domain + '.' if node.domain else ''}{node.op_type} lies on the path", node.name or "")
        if scalar_operands_only:
            for operand in node.inputs:
                array = _const(operand)
                if operand is not None and operand not in tainted and (array is None or array.size != 1):
                    raise NoMatch(f"operand {operand.name} is not a scalar constant", node.name or "")
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


def _scale_chain(scale: ir.Value, source: ir.Value) -> set[ir.Node] | None:
    """The nodes computing ``scale`` from ``source`` (a per-token activation scale: Abs, ReduceMax, Div, Max...),
    when no more than _SCALE_CHAIN_NODES ops above ``scale`` reach back to ``source``; else None."""
    chain: set[ir.Node] = set()
    frontier = [scale]
    while frontier:
        node = frontier.pop().producer()
        if node is None or node in chain:
            continue
        chain.add(node)
        if len(chain) > _SCALE_CHAIN_NODES:
            return None
        frontier += [v for v in node.inputs if v is not None and v is not source and v.const_value is None]
    return chain


def _dynamic_reader(value: ir.Value, users: set[ir.Node]) -> ir.Node | None:
    """The one dynamic QMatMul among ``users`` that reads ``value`` as x, when every other user only computes that
    QMatMul's per-token activation scale from ``value`` (the absorbed Q/DQ reads x twice); else None."""
    readers = [n for n in users if is_quantized_projection(n) and n.inputs[0] is value
               and _attr(n, "act_mode") == ACT_DYNAMIC]
    if len(readers) != 1 or value.is_graph_output():
        return None
    reader = readers[0]
    chain = _scale_chain(reader.inputs[ACT_SCALE], value)
    if chain is None or not users - {reader} <= chain:
        return None
    for node in chain:
        for out in node.outputs:
            if out.is_graph_output() or any(u.node not in chain and not (u.node is reader and u.idx == ACT_SCALE)
                                            for u in out.uses()):
                return None
    return reader


def _single_consumer(value: ir.Value) -> ir.Node:
    users = {use.node for use in value.uses()}
    reader = _dynamic_reader(value, users) if len(users) > 1 else None
    if reader is not None:
        return reader
    if len(users) != 1 or value.is_graph_output():
        raise NoMatch(f"{value.name} is read by {len(users)} nodes; the per-head values would escape the shard")
    return next(iter(users))


def _per_head_operand(node: ir.Node | None, heads: int, tainted: set[ir.Value]) -> int | None:
    """The index of ``node``'s constant [1, heads, 1, D] operand when ``node`` is an elementwise _PER_HEAD_OPS op of
    one hidden-state value and that constant; else None. Only meaningful at a PagedAttention input or output, where
    the layout is [1, H, T, D] (docs/architecture.md §3), so axis 1 is the head axis."""
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _PER_HEAD_OPS \
            or len(node.inputs) != 2 or sum(v in tainted for v in node.inputs) != 1:
        return None
    index = 1 if node.inputs[0] in tainted else 0
    const = node.inputs[index].const_value
    if const is None or len(const.shape) != 4:
        return None
    shape = tuple(int(d) for d in const.shape)
    return index if shape[0] == 1 and shape[1] == heads and shape[2] == 1 else None


def _per_head_above(value: ir.Value, heads: int, tainted: set[ir.Value]) -> tuple[ir.Value, list[tuple[ir.Node, int]]]:
    """(the value above the per-head constant ops that end at a PagedAttention input ``value``, those ops with their
    constant's input index)."""
    ops, node = [], value.producer()
    while (index := _per_head_operand(node, heads, tainted)) is not None:
        ops.append((node, index))
        value = node.inputs[1 - index]
        node = value.producer()
    return value, ops


def _per_head_below(out: ir.Value, heads: int, tainted: set[ir.Value]) -> tuple[ir.Value, list[tuple[ir.Node, int]]]:
    """(the value below the per-head constant ops that a PagedAttention output ``out`` passes through alone, those
    ops with their constant's input index)."""
    ops, value = [], out
    while not value.is_graph_output() and len(users := {use.node for use in value.uses()}) == 1:
        node = next(iter(users))
        index = _per_head_operand(node, heads, tainted)
        if index is None:
            break
        ops.append((node, index))
        value = node.outputs[0]
    return value, ops


def _o_projection(out: ir.Value, tainted: set[ir.Value]) -> ir.Node:
    value = out
    while True:
        node = _single_consumer(value)
        if _is_projection(node):
            if node.inputs[0] is not value:
                raise NoMatch("attention's output is a projection's weight", node.name or "")
            return node
        if node.op_type not in _O_PATH_OPS or node.domain not in ("", "ai.onnx"):
            raise NoMatch(f"{node.op_type} lies between attention and the O projection", node.name or "")
        _check_head_agnostic(node, tainted)
        value = node.outputs[0]


# ---------------------------------------------------------------------------------------------------------------
# Analysis.


@dataclasses.dataclass
class _Analysis:
    """What to split, found before anything is rewritten (filled by _analyze, applied by shard_structure)."""

    column: dict[ir.Node, Ranges] = dataclasses.field(default_factory=dict)  # projection -> its output columns
    row: dict[ir.Node, Ranges] = dataclasses.field(default_factory=dict)  # projection -> its input rows (AllReduce)
    attention: list[AttentionShard] = dataclasses.field(default_factory=list)
    mlp: list[MlpShard] = dataclasses.field(default_factory=list)
    replicated: list[ReplicatedProjection] = dataclasses.field(default_factory=list)
    failures: list[MatchFailure] = dataclasses.field(default_factory=list)  # attention layers that cannot split
    # (elementwise op, its constant's input index) -> the head ranges each rank keeps of that [1, H, 1, D] constant
    per_head: dict[tuple[ir.Node, int], Ranges] = dataclasses.field(default_factory=dict)
    head: ir.Node | None = None  # the LM head to split by vocabulary (lm_head="vocab-parallel")


@dataclasses.dataclass(frozen=True)
class _Heads:
    """A PagedAttention node's head counts, checked to split over ``size`` ranks."""

    heads: int  # query heads
    kv_heads: int  # key/value heads
    head_dim: int
    size: int  # ranks

    @property
    def kv_replicated(self) -> bool:
        """Fewer KV heads than ranks: each KV head lives on size/kv_heads ranks."""
        return self.kv_heads < self.size


def _ranges(size: int, width: int) -> Ranges:
    step = width // size
    return tuple(((r * step, (r + 1) * step),) for r in range(size))


def _attention_split(node: ir.Node, size: int) -> _Heads:
    heads = int(node.attributes["num_heads"].value)
    kv_heads = int(node.attributes["num_kv_heads"].value)
    head_dim = int(node.attributes["head_dim"].value)
    if heads % size:
        raise NoMatch(f"num_heads {heads} is not a multiple of --tensor-parallel {size}")
    if kv_heads >= size and kv_heads % size:
        raise NoMatch(f"num_kv_heads {kv_heads} is not a multiple of --tensor-parallel {size}")
    if kv_heads < size and size % kv_heads:
        raise NoMatch(f"--tensor-parallel {size} is not a multiple of num_kv_heads {kv_heads} (KV heads are "
                      "replicated only evenly)")
    return _Heads(heads, kv_heads, head_dim, size)


def _check_row_blocks(node: ir.Node, size: int) -> None:
    """FusionError unless a blocked (INT4/UINT4) QMatMul split by rows over ``size`` ranks keeps whole blocks: each
    rank's K/size rows must be a multiple of block_size, since a block's scale cannot be shared by two ranks."""
    block = _attr(node, "block_size") if is_quantized_projection(node) else 0
    k = _weight_shape(node)[0]
    if not block or (k // size) % block == 0:
        return
    fits = [g for g in _GROUP_SIZES if (k // size) % g == 0]
    sizes = [n for n in range(1, size + 1) if k % n == 0 and (k // n) % block == 0]
    raise FusionError(
        f"{node.name}: --tensor-parallel {size} splits this row-parallel INT4 projection's K={k} into {k // size} "
        f"rows per rank, not a multiple of its block_size {block}. Re-quantize with a --group-size that divides "
        f"{k // size}" + (f" (e.g. {fits[0]})" if fits else "") + ", or build with --tensor-parallel "
        + " or ".join(map(str, [n for n in sizes if n > 1] or [1])) + ".")


def _kv_ranges(size: int, kv_heads: int, head_dim: int) -> Ranges:
    if kv_heads >= size:
        return _ranges(size, kv_heads * head_dim)
    per = size // kv_heads  # ranks sharing one KV head
    return tuple((((r // per) * head_dim, (r // per + 1) * head_dim),) for r in range(size))


def _analyze(model: ir.Model, size: int, lm_head: str) -> _Analysis:
    graph = model.graph
    tainted = _tainted(graph)
    found = _Analysis()
    if lm_head == "vocab-parallel":
        try:
            found.head = _lm_head(graph)
            _head_weight(found.head)
        except NoMatch as e:
            raise FusionError(f"--lm-head vocab-parallel: the LM head cannot be split by vocabulary: {e.reason}"
                              + (f" (at {e.node_name})" if e.node_name else "")
                              + ". Build with --lm-head replicated.") from None
    attention = [n for n in graph if n.domain == DOMAIN and n.op_type == "PagedAttention"]
    for layer, node in enumerate(attention):
        try:
            _split_attention(found, node, size, tainted)
        except NoMatch as e:
            found.failures.append(MatchFailure(RULE, node.name or f"attention {layer}", e.reason, e.node_name))
    why_not = _split_mlps(found, graph, size, tainted)
    for node in graph:  # a head tied to the embedding multiplies by Transpose(embedding): no constant weight
        if node.op_type == "MatMul" and not _is_projection(node) and node.inputs[0] in tainted \
                and node.inputs[1] not in tainted and _feeds_logits(node) and node is not found.head:
            found.replicated.append(ReplicatedProjection(node.name, "LM head (tied to the embedding): replicated (the "
                                                         "driver samples full-vocabulary rows)"))
    for node, failure in why_not.items():
        if node is not found.head:
            why = LM_HEAD_REPLICATED if _feeds_logits(node) else failure.reason
            found.replicated.append(ReplicatedProjection(node.name, why, failure.node))
    return found


def _split_attention(found: _Analysis, node: ir.Node, size: int, tainted: set[ir.Value]) -> None:
    """Record the split of one attention layer's q/k/v/o projections; NoMatch (nothing recorded) when it cannot."""
    heads = _attention_split(node, size)
    projections = []
    q_heads, kv_heads = _ranges(size, heads.heads), _kv_ranges(size, heads.kv_heads, 1)  # rank r's heads
    per_head: dict[tuple[ir.Node, int], Ranges] = {}
    for i, (what, width) in enumerate((("q", heads.heads), ("k", heads.kv_heads), ("v", heads.kv_heads))):
        value, ops = _per_head_above(node.inputs[i], width, tainted)
        per_head.update((op, q_heads if what == "q" else kv_heads) for op in ops)
        above, _ = _projection_above(value, tainted, _QKV_PATH_OPS)
        if len(above) != 1:
            raise NoMatch(f"{what} comes from {len(above)} projections, expected one")
        proj = above[0]
        if _weight_shape(proj)[1] != width * heads.head_dim:
            raise NoMatch(f"{what} projection {proj.name} has {_weight_shape(proj)[1]} outputs, expected "
                          f"{width} heads x {heads.head_dim}", proj.name or "")
        projections.append(proj)
    if len({id(p) for p in projections}) != 3:
        raise NoMatch("Q, K and V share a projection (a concatenated QKV weight is not split yet)")
    value, ops = _per_head_below(node.outputs[0], heads.heads, tainted)
    per_head.update((op, q_heads) for op in ops)
    o_proj = _o_projection(value, tainted)
    if _weight_shape(o_proj)[0] != heads.heads * heads.head_dim:
        raise NoMatch(f"O projection {o_proj.name} has {_weight_shape(o_proj)[0]} inputs, expected "
                      f"{heads.heads * heads.head_dim}", o_proj.name or "")
    _check_row_blocks(o_proj, size)
    q, k, v = projections
    found.column[q] = _ranges(size, heads.heads * heads.head_dim)
    found.column[k] = found.column[v] = _kv_ranges(size, heads.kv_heads, heads.head_dim)
    found.row[o_proj] = _ranges(size, heads.heads * heads.head_dim)
    found.per_head.update(per_head)
    found.attention.append(AttentionShard(node.name, q.name, k.name, v.name, o_proj.name))


def _split_mlps(found: _Analysis, graph: ir.Graph, size: int, tainted: set[ir.Value]) -> dict[ir.Node, MatchFailure]:
    """Record the split of every MLP outside attention; returns each projection left whole and the check it failed
    (a projection that failed as a down projection may still turn out to be another MLP's up projection)."""
    claimed = set(found.column) | set(found.row)
    why_not: dict[ir.Node, MatchFailure] = {}
    for node in graph:
        if not _is_projection(node) or node in claimed:
            continue
        width_in = _weight_shape(node)[0]
        try:
            ups, between = _projection_above(node.inputs[0], tainted, _MLP_PATH_OPS, scalar_operands_only=True)
            if not ups:
                raise NoMatch("its input is not computed from other projections")
            if any(_weight_shape(up)[1] != width_in or up in claimed for up in ups):
                raise NoMatch("its input mixes projections of other widths or of attention")
            inside = set(between) | {node}
            for up in ups:
                if any(use.node not in inside for use in up.outputs[0].uses()) or up.outputs[0].is_graph_output():
                    raise NoMatch(f"{up.name}'s output is read outside the MLP", up.name or "")
            if width_in % size:
                raise NoMatch(f"intermediate size {width_in} is not a multiple of --tensor-parallel {size}")
        except NoMatch as e:
            why_not[node] = MatchFailure(RULE, node.name or "", e.reason, e.node_name)
            continue
        _check_row_blocks(node, size)
        for up in ups:
            found.column[up] = _ranges(size, width_in)
            claimed.add(up)
        found.row[node] = _ranges(size, width_in)
        claimed.add(node)
        found.mlp.append(MlpShard(tuple(u.name for u in ups), node.name))
    return {node: failure for node, failure in why_not.items() if node not in claimed}


def _lm_head(graph: ir.Graph) -> ir.Node:
    """The MatMul (or MatMulAdd) whose output becomes ``logits`` through Cast/Identity/Squeeze only (the shape
    logits_gather.py leaves: head -> [Cast] -> Squeeze -> [Cast] -> logits)."""
    logits = next((v for v in graph.outputs if v.name == signature.LOGITS.name), None)
    node = logits.producer() if logits is not None else None
    while node is not None and node.domain in ("", "ai.onnx") and node.op_type in ("Cast", "Identity", "Squeeze"):
        node = node.inputs[0].producer()
    if node is None or not (is_op(node, "MatMul") or (node.domain == DOMAIN and node.op_type == "MatMulAdd")):
        found = f"{node.op_type} {node.name}" if node is not None else "a graph input"
        raise NoMatch(f"`logits` is computed by {found}, not by a MatMul through Cast/Squeeze")
    if node.outputs[0].is_graph_output():
        raise NoMatch("the LM head's output is itself a graph output", node.name or "")
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
    raise NoMatch("its weight is neither a constant [hidden, vocab] matrix nor Transpose([vocab, hidden] constant)",
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

    def vocab_parallel_head(self, head: ir.Node) -> LmHeadSplit:
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
            bounds = [self.constant(f"{name}_{what}", [v])
                      for what, v in (("starts", 0), ("ends", vocab), ("axes", -1))]
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
        return LmHeadSplit(node=head.name, weight=weight.name, tied=transposed, hidden=hidden, vocab=vocab,
                           vocab_per_rank=per_rank, padding=padding, dtype_bytes=itemsize,
                           weight_bytes_saved_per_rank=saved)

    def column(self, node: ir.Node, ranges) -> None:
        node.replace_input_with(1, self.shard(node.inputs[1], 1, ranges))
        if node.op_type == "MatMulAdd":
            node.replace_input_with(2, self.shard(node.inputs[2], 0, ranges))
        if is_quantized_projection(node):  # scale and zero point: [N] or [K/G, N], N last like the codes'
            for i in (W_SCALE, W_ZERO_POINT):
                node.replace_input_with(i, self.shard(node.inputs[i], len(node.inputs[i].const_value.shape) - 1,
                                                      ranges))

    def _row_qmatmul(self, node: ir.Node, ranges) -> ir.Node:
        """The rank's QMatMul of ``node`` split by rows: its K rows of the codes and, blocked, their K/G block rows
        of scale and zero point (whole blocks: _check_row_blocks); per-channel scales and the activation's scale
        and zero point whole. A per-token activation scale is then the rank's own (the max over its K/N)."""
        block = _attr(node, "block_size")
        inputs = list(node.inputs)
        inputs[W_Q] = self.shard(node.inputs[W_Q], 0, ranges)
        if block:
            blocks = tuple(tuple((a // block, b // block) for a, b in rank) for rank in ranges)
            inputs[W_SCALE], inputs[W_ZERO_POINT] = (self.shard(node.inputs[i], 0, blocks)
                                                     for i in (W_SCALE, W_ZERO_POINT))
        rows = sum(b - a for a, b in ranges[0])
        attrs = [ir.AttrInt64(a.name, rows) if a.name == "act_block_size" and a.value  # per token: K/N wide
                 else ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
        return ir.Node(DOMAIN, node.op_type, inputs, attrs, name=f"{node.name}.tp_row")

    def row(self, node: ir.Node, ranges) -> None:
        out = node.outputs[0]
        if is_quantized_projection(node):
            matmul = self._row_qmatmul(node, ranges)
        else:
            matmul = ir.node("MatMul", [node.inputs[0], self.shard(node.inputs[1], 0, ranges)],
                             name=f"{node.name}.tp_row")
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
    found = _analyze(model, size, lm_head)
    attention = [n for n in model.graph if n.domain == DOMAIN and n.op_type == "PagedAttention"]
    if not attention:
        raise FusionError("--tensor-parallel needs a paged plan (a causal LM with a KV cache); this graph has no "
                          "attention layers to shard.")
    if found.failures:
        lines = "\n".join(f"  {f.anchor}: {f.reason}" + (f" (at {f.node})" if f.node else "") for f in found.failures)
        raise FusionError(f"{len(found.failures)} attention layer(s) cannot be sharded over {size} ranks:\n{lines}\n"
                          "Build without --tensor-parallel, or choose a size that divides the head counts.")
    split = _attention_split(attention[0], size)
    heads_per_rank = split.heads // size
    kv_per_rank = max(split.kv_heads // size, 1)
    rewriter = _Rewriter(model, size)
    for node, ranges in found.column.items():
        rewriter.column(node, ranges)
    for node, ranges in found.row.items():
        rewriter.row(node, ranges)
    for (node, index), ranges in found.per_head.items():
        node.replace_input_with(index, rewriter.shard(node.inputs[index], 1, ranges))
    head_split = rewriter.vocab_parallel_head(found.head) if found.head is not None else None
    for node in attention:
        node.attributes["num_heads"] = ir.AttrInt64("num_heads", heads_per_rank)
        node.attributes["num_kv_heads"] = ir.AttrInt64("num_kv_heads", kv_per_rank)
        alibi = node.inputs[8] if len(node.inputs) > 8 else None
        if alibi is not None and alibi.const_value is not None:
            node.replace_input_with(8, rewriter.shard(alibi, 0, _ranges(size, split.heads)))
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
        size=size, num_heads=split.heads, num_kv_heads=split.kv_heads, heads_per_rank=heads_per_rank,
        kv_heads_per_rank=kv_per_rank, kv_heads_replicated=split.kv_replicated, attention=tuple(found.attention),
        mlp=tuple(found.mlp), replicated=tuple(found.replicated), lm_head=lm_head, lm_head_split=head_split,
    )
    return ShardResult(layout, tuple(rewriter.splits.values()), rewriter.full)


def _retype_kv_io(model: ir.Model, kv_per_rank: int) -> None:
    """kv_cache.{i} / kv_cache_out.{i} are [num_blocks, 2, Hkv, block, D]: Hkv becomes the per-rank count."""
    for value in [*model.graph.inputs, *model.graph.outputs]:
        if (signature.is_kv_input(value.name) or signature.is_kv_output(value.name)) and value.shape is not None:
            dims = list(value.shape)
            dims[2] = kv_per_rank
            value.shape = ir.Shape(dims)


def join_fused(result: ShardResult, model: ir.Model,
               sources: dict[str, tuple[tuple[str, ...], int, tuple[int, ...]]]) -> ShardResult:
    """``result`` for the rank graph after fuse_horizontal_matmul (fusion_passes/horizontal_matmul.py, run on the
    rewritten graph with ``sources``): each joined initializer with a split member becomes a Join, so
    ``rank_weights`` gives rank r the concatenation of its own slices (a member every rank holds whole is cut out of
    rank 0's join). A join of whole members only is the same on every rank and stays as it is. Every rank's Split
    cuts the same widths: a column split gives every rank the same width (Q/K/V by heads, gate/up by I/N)."""
    targets = {s.target for s in result.splits}
    joins: dict[str, Join] = {}
    for name, (members, axis, widths) in sources.items():
        if not any(m in targets for m in members):
            continue
        joined = model.graph.initializers[name].const_value
        offsets = np.cumsum((0,) + widths)
        shared = {m: np.take(joined.numpy(), np.arange(offsets[i], offsets[i + 1]), axis=axis)
                  for i, m in enumerate(members) if m not in targets}
        joins[name] = Join(members, axis, tuple(joined.shape), shared)
    away = frozenset(m for j in joins.values() for m in j.members
                     if m in targets and m not in model.graph.initializers)
    return dataclasses.replace(result, joins={**result.joins, **joins}, joined_away=result.joined_away | away)


def rank_weights(result: ShardResult, rank: int) -> dict[str, np.ndarray]:
    """Per-rank initializer name -> rank ``rank``'s slice (a join: its members' slices, concatenated)."""
    parts = {s.target: _shard_data(result.full_weights[s.source], s, rank) for s in result.splits}
    for name, join in result.joins.items():
        data = np.concatenate([parts[m] if m in parts else join.shared[m] for m in join.members], axis=join.axis)
        assert data.shape == join.shape, f"{name}: rank {rank}'s join is {data.shape}, rank 0's {join.shape}"
        parts[name] = np.ascontiguousarray(data)
    return {name: data for name, data in parts.items() if name not in result.joined_away}


def unsharded_reasons(layout: ParallelLayout) -> list[str]:
    """``--explain`` lines: each projection left whole, and why."""
    return [f"{RULE} | {r.node}: not sharded: {r.why}" + (f" (at {r.at})" if r.at else "") for r in layout.replicated]


def lm_head_reason(layout: ParallelLayout) -> str | None:
    """The ``--explain`` line of a vocabulary-parallel LM head (what was split, and what it costs and saves)."""
    split = layout.lm_head_split
    if split is None:
        return None
    padding = f" (the last shard padded by {split.padding} zero columns, sliced off after the gather)" \
        if split.padding else ""
    mib = abs(split.weight_bytes_saved_per_rank) / 2**20
    if split.tied:
        memory = f"adds {mib:.1f} MiB per rank (tied: the shard is its own initializer, the embedding keeps the table)"
    else:
        memory = (f"saves {mib:.1f} MiB of head weights per rank (hidden {split.hidden} x vocab x "
                  f"{split.dtype_bytes} B x (N-1)/N)")
    return (f"{RULE} | {split.node}: LM head vocab-parallel: {split.vocab_per_rank} of {split.vocab} "
            f"vocabulary columns per rank{padding}; one all-gather of the sampled logits rows per step; {memory}")
