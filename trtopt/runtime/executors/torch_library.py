"""torch.compile (Inductor) of the torch executor's converted graph: opt-in (`compile_mode`).

Two pieces, both imported only when a compile mode is asked for, so the default executor never loads them:

1. **The trtopt ops as torch.library custom ops** (namespace ``trtopt``). Their implementations are the functions of
   ``trtopt_ops`` (the Triton kernels on CUDA, the references elsewhere), unchanged; each gets a fake
   implementation so Dynamo traces through it without running it. PagedAttention declares the KV pool as mutated
   (``mutates_args``) and returns only its attention output: a custom op may not return an alias of an input, so
   the graph's ``kv_cache_out`` is rewired to the pool the op writes (which is what the executor reads anyway).
   Every output is returned contiguous, and the fake implementations say so, so Inductor's view of strides is
   the real one.

2. **One compiled graph per step shape** (``CompiledGraph``). The converted graph computes shapes on the host
   (``Shape`` → int64 CPU tensors → Python lists for Reshape, Slice...). Compiled as is, Dynamo (fullgraph, which
   turns on capture_scalar_outputs) reads each ``.tolist()`` as unbacked SymInts, and the ``-1`` of an ONNX Reshape
   shape then fails their ``u >= 0`` size assertion at run time (``RuntimeError: u2 >= 0`` on tiny-llama; without
   fullgraph it would be a graph break per read). A step shape fixes every one of those values, so for each new shape (a CUDA-graph
   bucket on the GPU) the graph is specialised: the values that depend only on input shapes are computed once
   (one eager run) and baked into a copy of the graph as Python constants, and that copy is compiled with
   ``torch.compile(fullgraph=True, dynamic=False)``. ``fullgraph`` makes anything Dynamo cannot trace an error
   (GraphCompileError), never a silent fallback to eager. Each copy has its own code object, hence its own Dynamo
   cache: no recompile limit is shared between buckets.

The executor's fx-level RoPE fusion (fx_fusions.fuse_rope) is not applied under compile: Inductor is the one doing
elementwise fusion there (the plan-level Rope op, when the plan has it, is a custom op like the others).
"""
# No `from __future__ import annotations` here: torch.library.custom_op reads the annotations as types.

import dataclasses
import logging
import operator
import time
from typing import Any, Callable, Optional

import torch
import torch.fx

from trtopt.errors import ConfigError
from trtopt.runtime.executors import onnx_ops, trtopt_ops

log = logging.getLogger(__name__)

Tensor = torch.Tensor

# torch.compile modes the executor accepts. Inductor's own CUDA graphs ("reduce-overhead", "max-autotune") are
# left out: the executor captures its own graphs per bucket (cuda_graphs.py), around the compiled callable.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


class GraphCompileError(ConfigError):
    """torch.compile could not compile the step graph (a graph break, or an error inside Inductor)."""


# ---- the custom ops ------------------------------------------------------------------------------------------------

@torch.library.custom_op("trtopt::paged_attention", mutates_args=("kv_cache",))
def paged_attention(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                    query_start_loc: Tensor, slot_mapping: Tensor, alibi_slopes: Optional[Tensor] = None, *,
                    num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: int = 1,
                    sliding_window: int = 0, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
                    v_scale: float = 1.0) -> Tensor:
    """trtopt::PagedAttention: writes kv_cache in place, returns out [1, Hq, T, D] (q's dtype, contiguous). Its
    launch state is the running executor's (trtopt_ops.CURRENT_PAGED_STATE, read when the op runs: eagerly, in
    Inductor's code, or while a CUDA graph captures it); a custom op's arguments cannot carry it. An FP8 pool's
    kv_cache_dtype and scales are the node's attributes, as in the eager graph."""
    out, _ = trtopt_ops.paged_attention(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
                                        alibi_slopes, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                        head_dim=head_dim, scale=scale, causal=causal, sliding_window=sliding_window,
                                        state=trtopt_ops.CURRENT_PAGED_STATE.get(), kv_cache_dtype=kv_cache_dtype,
                                        k_scale=k_scale, v_scale=v_scale)
    return out.contiguous()


@paged_attention.register_fake
def _(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, slot_mapping, alibi_slopes=None, *, num_heads,
      num_kv_heads, head_dim, scale, causal=1, sliding_window=0, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    return q.new_empty(q.shape)


@torch.library.custom_op("trtopt::flash_attention", mutates_args=())
def flash_attention(q: Tensor, k: Tensor, v: Tensor, attn_bias: Optional[Tensor] = None, *, num_heads: int,
                    num_kv_heads: int, head_dim: int, scale: float, causal: int = 0) -> Tensor:
    """trtopt::FlashAttention: out [B, Hq, S, D] in q's dtype."""
    return trtopt_ops.flash_attention(q, k, v, attn_bias, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_dim=head_dim, scale=scale, causal=causal).contiguous()


@flash_attention.register_fake
def _(q, k, v, attn_bias=None, *, num_heads, num_kv_heads, head_dim, scale, causal=0):
    return q.new_empty(q.shape)


# The ops below are pure torch in their references, so their fakes ARE the references (run on fake tensors): the
# shapes and dtypes (type promotion included) cannot drift from what the real op returns.

@torch.library.custom_op("trtopt::rms_norm", mutates_args=())
def rms_norm(x: Tensor, scale: Tensor, *, epsilon: float) -> Tensor:
    return trtopt_ops.rms_norm(x, scale, epsilon=epsilon).contiguous()


@rms_norm.register_fake
def _(x, scale, *, epsilon):
    from trtopt.plugins.rms_norm.reference import rms_norm_ref

    return rms_norm_ref(x, scale, epsilon=epsilon).contiguous()


@torch.library.custom_op("trtopt::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, scale: Tensor, *, epsilon: float) -> tuple[Tensor, Tensor]:
    y, total = trtopt_ops.add_rms_norm(x, residual, scale, epsilon=epsilon)
    return y.contiguous(), total.contiguous()


@add_rms_norm.register_fake
def _(x, residual, scale, *, epsilon):
    from trtopt.plugins.add_rms_norm.reference import add_rms_norm_ref

    y, total = add_rms_norm_ref(x, residual, scale, epsilon=epsilon)
    return y.contiguous(), total.contiguous()


@torch.library.custom_op("trtopt::silu_mul", mutates_args=())
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return trtopt_ops.silu_mul(gate, up).contiguous()


@silu_mul.register_fake
def _(gate, up):
    from trtopt.plugins.silu_mul.reference import silu_mul_ref

    return silu_mul_ref(gate, up).contiguous()


@torch.library.custom_op("trtopt::gelu_mul", mutates_args=())
def gelu_mul(gate: Tensor, up: Tensor, *, tanh: int) -> Tensor:
    return trtopt_ops.gelu_mul(gate, up, tanh=tanh).contiguous()


@gelu_mul.register_fake
def _(gate, up, *, tanh):
    from trtopt.plugins.gelu_mul.reference import gelu_mul_ref

    return gelu_mul_ref(gate, up, tanh=tanh).contiguous()


@torch.library.custom_op("trtopt::rope", mutates_args=())
def rope(x: Tensor, cos: Tensor, sin: Tensor, *, half: int = 0) -> Tensor:
    return trtopt_ops.rope(x, cos, sin, half=half).contiguous()


@rope.register_fake
def _(x, cos, sin, *, half=0):
    from trtopt.plugins.rope.reference import rope_ref

    return rope_ref(x, cos, sin, half=half).contiguous()


@torch.library.custom_op("trtopt::matmul_add", mutates_args=())
def matmul_add(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return trtopt_ops.matmul_add(x, weight, bias).contiguous()


@matmul_add.register_fake
def _(x, weight, bias):
    from trtopt.plugins.matmul_add.reference import matmul_add_ref

    return matmul_add_ref(x, weight, bias).contiguous()


@torch.library.custom_op("trtopt::qmatmul", mutates_args=())
def qmatmul(x: Tensor, w_q: Tensor, w_scale: Tensor, w_zero_point: Tensor, act_scale: Tensor, act_zero_point: Tensor,
            act_quantized: Tensor, act_static: Tensor, *, axis: int, block_size: int = 0, act_mode: int = 0,
            act_block_size: int = 0, weight_dtype: int = 0) -> Tensor:
    return trtopt_ops.qmatmul(x, w_q, w_scale, w_zero_point, act_scale, act_zero_point, axis=axis,
                              block_size=block_size, act_mode=act_mode, act_block_size=act_block_size,
                              weight_dtype=weight_dtype).contiguous()


@qmatmul.register_fake
def _(x, w_q, w_scale, w_zero_point, act_scale, act_zero_point, act_quantized, act_static, *, axis, block_size=0,
      act_mode=0, act_block_size=0, weight_dtype=0):
    return x.new_empty((*x.shape[:-1], w_q.shape[1]))


@torch.library.custom_op("trtopt::all_reduce", mutates_args=())
def all_reduce(x: Tensor, *, world_size: int) -> Tensor:
    y = trtopt_ops.all_reduce(x, world_size=world_size)
    return y.clone() if y is x else y.contiguous()  # one rank: the identity, but an op may not return its input


@all_reduce.register_fake
def _(x, *, world_size):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("trtopt::all_gather", mutates_args=())
def all_gather(x: Tensor, *, world_size: int, axis: int = -1) -> Tensor:
    y = trtopt_ops.all_gather(x, world_size=world_size, axis=axis)
    return y.clone() if y is x else y.contiguous()  # one rank: the identity, but an op may not return its input


@all_gather.register_fake
def _(x, *, world_size, axis=-1):
    shape = list(x.shape)
    shape[axis] *= world_size
    return x.new_empty(shape)


# trtopt_ops function (what the converter's graph calls) → its custom op.
CUSTOM_OPS: dict[Callable[..., Any], Any] = {
    trtopt_ops.paged_attention: torch.ops.trtopt.paged_attention.default,
    trtopt_ops.flash_attention: torch.ops.trtopt.flash_attention.default,
    trtopt_ops.rms_norm: torch.ops.trtopt.rms_norm.default,
    trtopt_ops.add_rms_norm: torch.ops.trtopt.add_rms_norm.default,
    trtopt_ops.silu_mul: torch.ops.trtopt.silu_mul.default,
    trtopt_ops.gelu_mul: torch.ops.trtopt.gelu_mul.default,
    trtopt_ops.rope: torch.ops.trtopt.rope.default,
    trtopt_ops.matmul_add: torch.ops.trtopt.matmul_add.default,
    trtopt_ops.qmatmul: torch.ops.trtopt.qmatmul.default,
    trtopt_ops.all_reduce: torch.ops.trtopt.all_reduce.default,
    trtopt_ops.all_gather: torch.ops.trtopt.all_gather.default,
}
# A trtopt op added to trtopt_ops needs its custom op here (test_torch_library checks this at import).
assert set(CUSTOM_OPS) == {spec.fn for spec in trtopt_ops.TRTOPT_OPS.values()}, (
    f"trtopt ops without a custom op in torch_library.py: "
    f"{sorted(name for name, spec in trtopt_ops.TRTOPT_OPS.items() if spec.fn not in CUSTOM_OPS)}")


def use_custom_ops(gm: torch.fx.GraphModule) -> int:
    """Retarget every trtopt op call of `gm` to its custom op, in place; returns how many were retargeted.

    PagedAttention's second output (the pool, aliased) is replaced by the pool input itself."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in CUSTOM_OPS:
            continue
        if node.target is trtopt_ops.paged_attention:
            pool = node.args[3]
            for user in list(node.users):
                assert user.target is operator.getitem and user.args[1] in (0, 1), f"unexpected use {user.format_node()}"
                if user.args[1] == 1:
                    user.replace_all_uses_with(pool)
                    gm.graph.erase_node(user)
            with gm.graph.inserting_before(node):
                out = gm.graph.call_function(CUSTOM_OPS[node.target], node.args, node.kwargs)
            for user in list(node.users):  # the getitem(…, 0) nodes
                user.replace_all_uses_with(out)
                gm.graph.erase_node(user)
            gm.graph.erase_node(node)
        else:
            node.target = CUSTOM_OPS[node.target]
        count += 1
    gm.graph.lint()
    gm.recompile()
    return count


# ---- specialising the graph to one step shape ----------------------------------------------------------------------

_SHAPE_SOURCES = (onnx_ops.shape, onnx_ops.size)
_CUSTOM_OP_SET = frozenset(CUSTOM_OPS.values())
# Inputs the standard ops take as Python values when constant (their OpSpec says which).
_SPEC_OF = {spec.fn: spec for spec in onnx_ops.STANDARD_OPS.values()}
_MAX_FOLDED_NUMEL = 64  # shape arithmetic is a few ints; a bigger value is data (a mask) and stays in the graph


def shape_derived_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes whose value depends only on the graph inputs' shapes: Shape/Size, then every pure call whose node
    inputs are all such nodes or constants (get_attr), with at least one such node."""
    derived: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _SHAPE_SOURCES:
            derived.add(node)
            continue
        if node.target in _CUSTOM_OP_SET:
            continue  # trtopt ops compute on data (and PagedAttention writes the pools)
        inputs = node.all_input_nodes
        if inputs and any(n in derived for n in inputs) and all(n in derived or n.op == "get_attr" for n in inputs):
            derived.add(node)
    return derived


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, wanted: set[torch.fx.Node]):
        super().__init__(gm)
        self.wanted, self.values = wanted, {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if n in self.wanted:
            self.values[n] = result
        return result


def _foldable(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "cpu" and value.numel() <= _MAX_FOLDED_NUMEL
    return isinstance(value, (int, float, bool))


def _as_arg(value: Any, user: torch.fx.Node, position: int | None, graph: torch.fx.Graph) -> Any:
    """How a folded value is passed to `user`: a Python list/number where the op takes one, else a small tensor
    made in the graph (torch.tensor of Python numbers, which Dynamo traces as a constant)."""
    if not isinstance(value, torch.Tensor):
        return value
    spec = _SPEC_OF.get(user.target)
    if spec is not None and position is not None:
        if position in spec.list_inputs:
            return value.reshape(-1).tolist()
        if position in spec.scalar_inputs and value.dim() == 0:
            return value.item()
    with graph.inserting_before(user):
        return graph.call_function(torch.tensor, (value.tolist(),), {"dtype": value.dtype})


def specialise(gm: torch.fx.GraphModule, args: tuple) -> tuple[torch.fx.GraphModule, dict[int, int]]:
    """A copy of `gm` for inputs of `args`' shapes, with the shape-derived values folded in as constants.

    Runs `gm` once on `args` (eagerly: the step's own work, repeated by the compiled graph; PagedAttention's pool
    writes are idempotent). Returns the copy and {output index: input index} for outputs that are graph inputs
    (the pools): the copy returns None there and the caller passes the input back (a compiled graph would
    otherwise return an alias it has to regenerate)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    outputs = graph.graph_copy(gm.graph, env)  # every node but the output; returns the output's value
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    passthrough = {i: placeholders.index(v) for i, v in enumerate(outputs)
                   if isinstance(v, torch.fx.Node) and v.op == "placeholder"}
    graph.output(tuple(None if i in passthrough else v for i, v in enumerate(outputs)))
    derived = shape_derived_nodes(graph)
    recorder = _Recorder(gm, {n for n in gm.graph.nodes if env.get(n) in derived})
    with torch.inference_mode():
        recorder.run(*args)
    values = {env[n]: v for n, v in recorder.values.items() if _foldable(v)}
    for node, value in values.items():
        for user in list(node.users):
            if user in values:
                continue  # folded too
            user.args = tuple(_as_arg(value, user, i, graph) if a is node else a for i, a in enumerate(user.args))
            user.kwargs = {k: (_as_arg(value, user, None, graph) if a is node else a) for k, a in user.kwargs.items()}
    graph.eliminate_dead_code()
    graph.lint()
    return torch.fx.GraphModule(gm, graph), passthrough  # shares gm's weights (get_attr targets by reference)


# ---- the compiled callable ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """One specialisation: the step input shapes it was compiled for, and what compiling it cost."""

    shapes: dict[str, tuple[int, ...]]  # graph input name → shape (the step inputs; the pools are left out)
    seconds: float  # specialise + Dynamo + Inductor + the first (compiled) run


class CompiledGraph:
    """Calls like the converted GraphModule (`module(*inputs)`), through one compiled copy per input shape.

    The module is retargeted to the custom ops here (in place: the executor that asks for compile runs only this)."""

    def __init__(self, module: torch.fx.GraphModule, input_names: list[str], *, mode: str = "default",
                 shape_inputs: tuple[str, ...] = (), options: dict[str, Any] | None = None):
        if mode not in COMPILE_MODES:
            raise ConfigError(f"compile mode {mode!r} is not supported; choose one of {', '.join(COMPILE_MODES)} "
                              "(the executor captures its own CUDA graphs around the compiled step).")
        self.module = module
        self.num_custom_ops = use_custom_ops(module)
        self.input_names = input_names
        self.mode = mode
        self.options = dict(options or {})
        self._shape_positions = [input_names.index(n) for n in shape_inputs]  # what a CompileRecord names
        self._compiled: dict[tuple, Callable[..., tuple]] = {}
        self.records: list[CompileRecord] = []

    @staticmethod
    def _key(args: tuple) -> tuple:
        return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a
                     for a in args)

    def __call__(self, *args: Tensor | None) -> tuple:
        key = self._key(args)
        run = self._compiled.get(key)
        if run is None:
            run = self._compiled[key] = self._compile(args)
        return run(*args)

    def _compile(self, args: tuple) -> Callable[..., tuple]:
        shapes = {self.input_names[i]: tuple(args[i].shape) for i in self._shape_positions}
        started = time.perf_counter()
        gm, passthrough = specialise(self.module, args)
        if self.options:  # torch.compile takes a mode or options, not both: the mode's options, then ours
            from torch._inductor import list_mode_options

            how: dict[str, Any] = {"options": {**list_mode_options(self.mode), **self.options}}
        else:
            how = {"mode": self.mode}
        compiled = torch.compile(gm, dynamic=False, fullgraph=True, **how)

        def run(*inputs):
            outputs = list(compiled(*inputs))
            for out, i in passthrough.items():
                outputs[out] = inputs[i]
            return tuple(outputs)

        try:
            with torch.inference_mode():
                run(*args)  # compiles now, so that the cost lands here and not inside a CUDA-graph capture
        except Exception as e:  # Dynamo's Unsupported, Inductor's lowering errors...: each means "cannot compile"
            raise GraphCompileError(
                f"torch.compile(mode={self.mode!r}, fullgraph=True) failed for the step of shapes {shapes}: "
                f"{type(e).__name__}: {e}. Run the executor without compile_mode (the default)."
            ) from e
        if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
            torch.cuda.synchronize(args[0].device)
        record = CompileRecord(shapes, time.perf_counter() - started)
        self.records.append(record)
        log.info("compiled the step for %s in %.1f s (torch.compile mode=%s)", shapes, record.seconds, self.mode)
        return run
