"""ModelFacts for plan.json: read off the fused graph, completed from config.json / generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import onnx_ir as ir

from trtopt.builder.plan import ModelFacts
from trtopt.errors import BuildError
from trtopt.fusion_passes.context import HeadDims
from trtopt.fusion_passes.ops import DOMAIN
from trtopt.signature import LOGITS

_DTYPES = {ir.DataType.FLOAT: "float32", ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16"}


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BuildError(f"{path} is not valid JSON ({e}); fix or delete it.") from e


def _first(config: dict, *keys: str):
    return next((config[k] for k in keys if config.get(k)), None)


def _kv_heads(config: dict, heads: int | None) -> int | None:
    """KV heads of the cache as each family spells them. Falcon: with ``new_decoder_architecture`` HF broadcasts
    the ``num_kv_heads`` groups to every query head *before* the cache, so the cache has the query heads' count;
    otherwise ``multi_query`` means one KV head (its config still carries ``num_kv_heads`` = the query heads)."""
    if config.get("new_decoder_architecture"):
        return heads
    if config.get("multi_query"):
        return 1
    return _first(config, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num") or heads


def head_dims_from_config(config: dict) -> HeadDims:
    """Head counts as HF configs spell them (Llama/Qwen2/Mistral, GPT-2/BLOOM, Falcon, GPT-NeoX, OPT, BERT...)."""
    heads = _first(config, "num_attention_heads", "n_head", "num_heads", "n_heads")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    return HeadDims(num_heads=heads, num_kv_heads=_kv_heads(config, heads), head_dim=head_dim)


def context_length(config: dict) -> int:
    """The model's trained context as config.json states it (0 = unknown)."""
    return int(_first(config, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length") or 0)


def config_disagreements(facts: ModelFacts, config: dict) -> list[str]:
    """Where config.json and the fused graph disagree on the attention shape; the graph wins (the runtime sizes
    its KV pools from the graph), and the build report says so."""
    dims = head_dims_from_config(config)
    notes = []
    for field, from_config in (("num_heads", dims.num_heads), ("num_kv_heads", dims.num_kv_heads),
                               ("head_dim", dims.head_dim)):
        from_graph = getattr(facts, field)
        if from_config and from_graph and from_config != from_graph:
            notes.append(f"{field}: config.json says {from_config}, the graph's attention has {from_graph}; "
                         "using the graph's")
    return notes


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
    logits = next((v for v in model.graph.outputs if v.name == LOGITS.name), None)
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
        layer_sliding_windows=tuple(_attr(n, "sliding_window") for n in nodes),
        max_position_embeddings=context_length(config),
    )
