"""`trtopt build --draft-layers N`: the self-draft plan of a built plan (LayerSkip / draft-and-verify).

The draft is the target's first N layers followed by the target's final norm and LM head: the hidden state that
enters layer N goes straight into the final norm. plan/draft_N/model.onnx is the target graph cut there, so it
has the same §3 signature with N KV layers. On disk it holds a copy of the weights it uses (onnx and onnx-ir refuse
external data shared through links); at run time the self_draft method drops that copy and runs on the target's
own tensors, so it costs no memory. Because the first N layers compute the same K/V for the same tokens, the
runtime's self_draft method runs it on the target's own first N KV pools (runtime/spec_decode/draft_model.py).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import onnx

from trtopt.builder.plan import MODEL_FILE, PlanConfig, read_plan, write_plan
from trtopt.builder.plan_files import copy_side_files, save_model
from trtopt.errors import BuildError, ConfigError
from trtopt.signature import LOGITS, LOGITS_INDICES, kv_input, kv_output

DRAFT_DIR_PREFIX = "draft_"  # plan/draft_N holds the self-draft plan of the first N layers
_NORMS = ("RMSNorm", "LayerNormalization", "SimplifiedLayerNormalization")


def self_draft_dir(plan_dir: str | Path, num_layers: int) -> Path:
    """Where `trtopt build --draft-layers N` writes the self-draft plan, and where the self_draft method looks."""
    return Path(plan_dir) / f"{DRAFT_DIR_PREFIX}{num_layers}"


def build_draft_plan(plan_dir: str | Path, num_layers: int, out_dir: str | Path | None = None) -> Path:
    """Write the N-layer self-draft plan of `plan_dir` (default: plan_dir/draft_N). Returns its dir."""
    plan_dir = Path(plan_dir)
    plan = read_plan(plan_dir)
    total = plan.model.num_layers
    if not isinstance(num_layers, int) or not 1 <= num_layers < total:
        raise ConfigError(f"--draft-layers {num_layers} must be in [1, {total - 1}] (the target has {total} layers).")
    out = Path(out_dir) if out_dir is not None else self_draft_dir(plan_dir, num_layers)
    model = onnx.load(str(plan_dir / MODEL_FILE))
    _cut(model.graph, num_layers, total)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_model(model, out)  # the builder's writer: external data when large, then the full ONNX checker
    draft = dataclasses.replace(plan, model=dataclasses.replace(plan.model, num_layers=num_layers))
    write_plan(out, PlanConfig(model=draft.model, limits=plan.limits, kind=plan.kind, **plan.kv_options()))
    copy_side_files(plan_dir, out)
    return out


def _cut(graph: onnx.GraphProto, n: int, total: int) -> None:
    producer = {out: node for node in graph.node for out in node.output}
    layer_input = _layer_input(graph, producer, n)
    final_norm = _final_norm(graph, producer)
    final_norm.input[0] = layer_input
    keep_out = {LOGITS.name, *(kv_output(i) for i in range(n))}
    outputs = [o for o in graph.output if o.name in keep_out]
    del graph.output[:]
    graph.output.extend(outputs)
    # Backward reachability from the kept outputs; node order stays topological.
    needed = set(keep_out)
    kept = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    kept.reverse()
    del graph.node[:]
    graph.node.extend(kept)
    dropped = {kv_input(i) for i in range(n, total)}
    inputs = [i for i in graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(inputs)
    inits = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    names = {v.name for v in graph.value_info if v.name in needed}
    vi = [v for v in graph.value_info if v.name in names]
    del graph.value_info[:]
    graph.value_info.extend(vi)


def _layer_input(graph: onnx.GraphProto, producer: dict, n: int) -> str:
    """The residual stream entering layer n: the input of the norm that feeds layer n's attention."""
    attn = next((node for node in graph.node if node.op_type == "PagedAttention" and kv_input(n) in node.input), None)
    if attn is None:
        raise BuildError(f"the plan has no PagedAttention node reading {kv_input(n)}; rebuild it with `trtopt build`.")
    frontier, seen = [attn.input[0]], set()
    while frontier:  # breadth-first up the query path until the layer's input norm
        name = frontier.pop(0)
        node = producer.get(name)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type in _NORMS:
            return node.input[0]
        if node.op_type == "AddRMSNorm":  # fusion_passes/add_rms_norm.py: its second output is the residual stream
            return node.output[1]
        frontier.extend(node.input)
    raise BuildError(f"no norm found in front of layer {n}'s attention; --draft-layers needs a pre-norm transformer.")


def _final_norm(graph: onnx.GraphProto, producer: dict) -> onnx.NodeProto:
    gather = next((node for node in graph.node if node.op_type == "Gather" and LOGITS_INDICES.name in node.input), None)
    node = producer.get(gather.input[0]) if gather is not None else None
    if node is not None and node.op_type == "AddRMSNorm" and gather.input[0] == node.output[0]:
        # The last residual add is fused into the final norm; the draft norms layer n's residual stream alone, so the
        # node becomes the plain trtopt.RMSNorm (same scale and epsilon; the caller sets its input).
        x, _residual, scale = node.input
        del node.input[:]
        node.input.extend([x, scale])
        del node.output[1:]
        node.op_type = "RMSNorm"
        return node
    if node is None or node.op_type not in _NORMS:
        raise BuildError("the plan's LM head is not fed by a final norm; --draft-layers needs a pre-norm transformer.")
    return node
