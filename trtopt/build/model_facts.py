"""ModelFacts for plan.json: read off the fused graph, completed from config.json / generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import onnx_ir as ir

from trtopt.build.plan import ModelFacts
from trtopt.errors import BuildError
from trtopt.fusion_passes.context import HeadDims
from trtopt.fusion_passes.ops import DOMAIN

_DTYPES = {ir.DataType.FLOAT: "float32", ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16"}


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BuildError(f"{path} is not valid JSON ({e}); fix or delete it.") from e


def head_dims_from_config(config: dict) -> HeadDims:
    """Head counts as HF configs spell them (Llama/Qwen2/Mistral, GPT-2, BERT)."""
    heads = config.get("num_attention_heads") or config.get("n_head")
    kv_heads = config.get("num_key_value_heads") or heads
    hidden = config.get("hidden_size") or config.get("n_embd")
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    return HeadDims(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


def _token_ids(*values) -> tuple[int, ...]:
    for value in values:
        if isinstance(value, int):
            return (value,)
        if isinstance(value, list) and value:
            return tuple(int(v) for v in value)
    return ()


def _attr(node: ir.Node, name: str, default: int = 0) -> int:
    attr = node.attributes.get(name)
    return int(attr.value) if attr is not None else default


def model_facts(model: ir.Model, kind: str, config: dict, generation: dict) -> ModelFacts:
    """The facts the runtime needs, from the fused attention nodes first and the configs second."""
    op_type = "PagedAttention" if kind == "paged" else "FlashAttention"
    nodes = [n for n in model.graph if n.domain == DOMAIN and n.op_type == op_type]
    dims = head_dims_from_config(config)
    first = nodes[0] if nodes else None
    if first is not None:
        dtype = first.inputs[0].dtype
    else:
        dtype = next((v.dtype for v in model.graph.inputs if v.dtype in _DTYPES), ir.DataType.FLOAT)
    vocab = config.get("vocab_size") or 0
    logits = next((v for v in model.graph.outputs if v.name == "logits"), None)
    if logits is not None and logits.shape is not None and isinstance(logits.shape[-1], int):
        vocab = logits.shape[-1]
    return ModelFacts(
        num_layers=len(nodes),
        num_heads=_attr(first, "num_heads") if first else (dims.num_heads or 0),
        num_kv_heads=_attr(first, "num_kv_heads") if first else (dims.num_kv_heads or 0),
        head_dim=_attr(first, "head_dim") if first else (dims.head_dim or 0),
        vocab_size=int(vocab),
        dtype=_DTYPES.get(dtype, "float32"),
        eos_token_ids=_token_ids(generation.get("eos_token_id"), config.get("eos_token_id")),
        bos_token_id=next(iter(_token_ids(generation.get("bos_token_id"), config.get("bos_token_id"))), None),
        model_type=str(config.get("model_type", "")),
        sliding_window=max((_attr(n, "sliding_window") for n in nodes), default=0),
        max_position_embeddings=int(config.get("max_position_embeddings") or config.get("n_positions") or 0),
    )
