"""`trtopt build --tensor-parallel N`: the rank plan dirs of a sharded plan (docs/architecture.md §1, §7b).

    plan/plan.json            global ModelFacts + "parallel": {"size": N, "rank": null, ...}
    plan/fusion_report.json   fusions + the full parallel layout (which projection went which way, and why not)
    plan/tokenizer files
    plan/rank{r}/model.onnx   rank r's graph: the same structure for every rank, rank r's weight slices
    plan/rank{r}/plan.json    rank r's ModelFacts (its head counts) + "parallel": {"rank": r, ...}

Every rank graph is the one graph ``shard_structure`` (analysis.py) rewrote; only the per-rank initializers
(``*.tp_shard``) differ, so the proto is built once and its sharded tensors are swapped rank by rank (a
vocab-parallel LM head's shard among them: every rank's is ceil(vocab/N) columns, the last one zero-padded, so all
ranks' shapes agree).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx
import onnx_ir as ir

from trtopt.builder.plan import ParallelConfig, PlanConfig, rank_dir, write_plan
from trtopt.builder.plan_files import save_model
from trtopt.builder.sharding.analysis import ParallelLayout, ShardResult, rank_weights

_PACKED_4BIT = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)


def parallel_config(layout: ParallelLayout, rank: int | None) -> ParallelConfig:
    """plan.json's "parallel" object for ``rank`` (None: the top-level plan.json)."""
    return ParallelConfig(
        size=layout.size, rank=rank, heads_per_rank=layout.heads_per_rank,
        kv_heads_per_rank=layout.kv_heads_per_rank, kv_heads_replicated=layout.kv_heads_replicated,
        all_reduces_per_step=layout.num_all_reduces, lm_head=layout.lm_head,
    )


def _set_tensor(proto: onnx.ModelProto, name: str, data) -> None:
    tensor = next(t for t in proto.graph.initializer if t.name == name)
    assert tensor.data_location != onnx.TensorProto.EXTERNAL, f"{name} must be loaded before it is replaced"
    del tensor.dims[:]
    tensor.dims.extend(data.shape)
    if tensor.data_type in _PACKED_4BIT:  # a QMatMul's INT4/UINT4 codes or zero points: two values a byte
        tensor.raw_data = ir.tensor(data, dtype=ir.DataType(tensor.data_type)).tobytes()
    else:
        tensor.raw_data = data.tobytes()


def write_rank_plans(proto: onnx.ModelProto, shard: ShardResult, out_dir: Path, rank_config: PlanConfig) -> list[Path]:
    """Write rank{r}/model.onnx and rank{r}/plan.json for every rank; ``proto`` holds rank 0's slices on entry and
    is changed in place (rank by rank, so no second copy of the weights is held)."""
    dirs = []
    for rank in range(shard.layout.size):
        path = rank_dir(out_dir, rank)
        path.mkdir(parents=True, exist_ok=True)
        if rank > 0:
            for name, data in rank_weights(shard, rank).items():
                _set_tensor(proto, name, data)
        save_model(proto, path)
        # A plan over the external-data threshold is saved with its weights moved out of the proto (onnx converts
        # in place); read them back so the next rank's slices can be swapped in and its other weights are written.
        onnx.external_data_helper.load_external_data_for_model(proto, str(path))
        write_plan(path, dataclasses.replace(rank_config, parallel=parallel_config(shard.layout, rank)))
        dirs.append(path)
    return dirs
