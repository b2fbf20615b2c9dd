"""`trtopt build --tensor-parallel N`: the rank plans' layout and weights, and a plan sharded for one rank equal to
the original graph on onnxruntime and torch (trtopt.AllReduce and trtopt.AllGather run as their Identity bodies
there); `--lm-head vocab-parallel`: the head's vocabulary columns per rank (padded when the vocabulary does not
divide), tied embeddings kept whole."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from test_executors import NUM_BLOCKS, generate_and_compare
from trtopt.builder.pipeline import build_plan
from trtopt.builder.plan import Limits, rank_dir, read_plan
from trtopt.errors import ConfigError, FusionError
from trtopt.runtime.executors import create_executor

LIMITS = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=256)


@pytest.fixture(scope="module")
def tp_plan(export_dir, module_tmp):
    cache = {}

    def get(model: str, size: int, lm_head: str = "replicated"):
        if (model, size, lm_head) not in cache:
            out = module_tmp / f"tp{size}-{model}-{lm_head}"
            cache[(model, size, lm_head)] = build_plan(export_dir(model), out, limits=LIMITS, force=True,
                                                       progress=False, tensor_parallel=size, lm_head=lm_head)
        return cache[(model, size, lm_head)]

    return get


def initializers(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path / "model.onnx").graph.initializer}


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_plan_sharded_for_one_rank_equals_the_original_graph(model, tp_plan, export_dir):
    result = tp_plan(model, 1)
    rank0 = rank_dir(result.plan_dir, 0)
    proto = onnx.load(rank0 / "model.onnx")
    plan = read_plan(rank0)
    all_reduces = [n for n in proto.graph.node if n.domain == "trtopt" and n.op_type == "AllReduce"]
    assert len(all_reduces) == 2 * plan.model.num_layers  # after O and after down, in every layer
    # onnxruntime runs AllReduce as its ONNX function body (Identity); the torch face is exercised at N = 1 and 2
    # by tests/runtime/test_tensor_parallel.py.
    executors = {"onnxruntime": create_executor("onnxruntime", rank0, plan, num_blocks=NUM_BLOCKS)}
    worst = generate_and_compare(rank0, export_dir(model), executors)
    assert worst["onnxruntime"] <= 1e-4, worst


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_vocab_parallel_plan_for_one_rank_equals_the_original_graph(model, tp_plan, export_dir):
    """The AllGather's Identity body (onnxruntime) and the torch face at N = 1 (torch) leave the logits exact."""
    result = tp_plan(model, 1, "vocab-parallel")
    rank0 = rank_dir(result.plan_dir, 0)
    plan = read_plan(rank0)
    assert plan.parallel.lm_head == "vocab-parallel"
    gathers = [n for n in onnx.load(rank0 / "model.onnx").graph.node if n.op_type == "AllGather"]
    assert len(gathers) == 1 and gathers[0].domain == "trtopt"
    executors = {backend: create_executor(backend, rank0, plan, num_blocks=NUM_BLOCKS)
                 for backend in ("onnxruntime", "torch")}
    worst = generate_and_compare(rank0, export_dir(model), executors)
    assert worst["onnxruntime"] <= 1e-4 and worst["torch"] <= 1e-4, worst


def head_shards(plan_dir, size: int) -> tuple[str, list[np.ndarray]]:
    """(the head's per-rank initializer, each rank's slice of it), found as the weight input of the MatMul that
    feeds the AllGather."""
    slices = []
    for r in range(size):
        proto = onnx.load(rank_dir(plan_dir, r) / "model.onnx")
        gather = next(n for n in proto.graph.node if n.op_type == "AllGather")
        head = next(n for n in proto.graph.node if gather.input[0] in n.output)
        assert head.op_type == "MatMul"
        slices.append(initializers(rank_dir(plan_dir, r))[head.input[1]])
    return head.input[1], slices


def test_vocab_parallel_llama_splits_the_untied_head_by_columns(tp_plan):
    """tiny-llama: untied [64, 49152] head; N = 2 gives each rank 24576 columns, nothing padded, and the ranks'
    columns side by side are the whole head of the one-rank plan."""
    result = tp_plan("tiny-llama", 2, "vocab-parallel")
    for path in (result.plan_dir, rank_dir(result.plan_dir, 0), rank_dir(result.plan_dir, 1)):
        assert read_plan(path).parallel.lm_head == "vocab-parallel"
    report = json.loads((result.plan_dir / "fusion_report.json").read_text())["parallel"]
    assert report["lm_head"] == "vocab-parallel" and report["all_gathers_per_step"] == 1
    assert report["replicated"] == []  # the head is no longer whole on every rank
    split = report["lm_head_split"]
    assert (split["vocab"], split["vocab_per_rank"], split["padding"], split["tied"]) == (49152, 24576, 0, False)
    assert split["weight_bytes_saved_per_rank"] == 64 * 24576 * 4  # hidden x vocab x fp32 x (N-1)/N
    name, (a, b) = head_shards(result.plan_dir, 2)
    assert a.shape == b.shape == (64, 24576)
    proto = onnx.load(rank_dir(result.plan_dir, 0) / "model.onnx")
    assert not [n for n in proto.graph.node if n.op_type == "Slice" and n.name.endswith(".drop_padding")]
    whole = next(v for k, v in initializers(rank_dir(tp_plan("tiny-llama", 1).plan_dir, 0)).items()
                 if v.shape == (64, 49152))
    np.testing.assert_array_equal(np.concatenate([a, b], axis=1), whole)


def test_vocab_parallel_tied_head_gets_its_own_shard_and_the_embedding_stays_whole(tp_plan):
    """tiny-qwen2 ties the head to the [49152, 64] embedding: each rank keeps the whole table for the embedding
    Gather and holds its columns of the transposed table as the head's own initializer."""
    result = tp_plan("tiny-qwen2", 2, "vocab-parallel")
    assert result.parallel.lm_head_split.tied
    name, (a, b) = head_shards(result.plan_dir, 2)
    shards = [initializers(rank_dir(result.plan_dir, r)) for r in range(2)]
    embedding = [k for k in shards[0] if shards[0][k].shape == (49152, 64)]
    assert len(embedding) == 1 and np.array_equal(shards[0][embedding[0]], shards[1][embedding[0]])
    table = shards[0][embedding[0]]
    np.testing.assert_array_equal(a, table[:24576].T)
    np.testing.assert_array_equal(b, table[24576:].T)
    proto = onnx.load(rank_dir(result.plan_dir, 1) / "model.onnx")
    assert not [n for n in proto.graph.node if n.op_type == "Transpose" and embedding[0] in n.input]


def test_vocab_parallel_pads_the_last_shard_of_an_odd_vocabulary(odd_vocab_model, tmp_path):
    """50257 = 2 x 25128 - 1: rank 1's last column is zero padding, sliced off after the gather (logits stay
    [N, 50257])."""
    _, export = odd_vocab_model()
    result = build_plan(export, tmp_path / "p", limits=LIMITS, progress=False, tensor_parallel=2,
                        lm_head="vocab-parallel")
    split = result.parallel.lm_head_split
    assert (split.vocab, split.vocab_per_rank, split.padding, split.tied) == (50257, 25129, 1, True)
    _, (a, b) = head_shards(result.plan_dir, 2)
    table = next(v for v in initializers(rank_dir(result.plan_dir, 0)).values() if v.shape == (50257, 64))
    np.testing.assert_array_equal(a, table[:25129].T)
    np.testing.assert_array_equal(b[:, :25128], table[25129:].T)
    assert not b[:, 25128:].any()
    proto = onnx.load(rank_dir(result.plan_dir, 0) / "model.onnx")
    drop = next(n for n in proto.graph.node if n.op_type == "Slice" and n.name.endswith(".drop_padding"))
    consts = {t.name: numpy_helper.to_array(t).tolist() for t in proto.graph.initializer}
    assert [consts[i] for i in drop.input[1:]] == [[0], [50257], [-1]]
    logits = next(o for o in proto.graph.output if o.name == "logits")
    assert logits.type.tensor_type.shape.dim[1].dim_value == 50257


def test_lm_head_option_is_checked(export_dir, tmp_path):
    with pytest.raises(ConfigError, match="--lm-head 'vocab': choose one of replicated, vocab-parallel"):
        build_plan(export_dir("tiny-llama"), tmp_path / "a", limits=LIMITS, progress=False, tensor_parallel=2,
                   lm_head="vocab")
    with pytest.raises(ConfigError, match="add --tensor-parallel N"):
        build_plan(export_dir("tiny-llama"), tmp_path / "b", limits=LIMITS, progress=False, lm_head="vocab-parallel")


def test_all_gather_schema_lengthens_the_gathered_axis():
    from trtopt.errors import BuildError
    from trtopt.plugins.all_gather.schema import SCHEMA

    assert SCHEMA.infer_shapes([(1, "N", 24576)], {"world_size": 2, "axis": -1}) == [(1, "N", 49152)]
    assert SCHEMA.infer_shapes([(1, "N", 7)], {"world_size": 1, "axis": 1}) == [(1, "N", 7)]
    assert SCHEMA.infer_shapes([(1, "N", 7)], {"world_size": 2, "axis": 1}) == [(1, None, 7)]
    with pytest.raises(BuildError, match="axis 3 is out of range"):
        SCHEMA.infer_shapes([(1, "N", 7)], {"world_size": 2, "axis": 3})


def test_all_gather_torch_face_checks_the_group_size_and_is_the_identity_for_one_rank():
    from trtopt.plugins.all_gather.reference import all_gather_ref

    x = torch.randn(1, 3, 4)
    assert all_gather_ref(x, world_size=1) is x
    with pytest.raises(RuntimeError, match="sharded for 2 ranks but runs in a group of 1"):
        all_gather_ref(x, world_size=2)


def test_llama_rank_plans_split_heads_and_mlp(tp_plan, export_dir):
    """tiny-llama: 4 query / 2 KV heads of 16, intermediate 128, untied head: N = 2 gives 2/1 heads per rank."""
    result = tp_plan("tiny-llama", 2)
    top = read_plan(result.plan_dir)
    assert top.parallel.size == 2 and top.parallel.rank is None and (top.model.num_heads, top.model.num_kv_heads) == (4, 2)
    assert not (result.plan_dir / "model.onnx").exists()
    ranks = [rank_dir(result.plan_dir, r) for r in range(2)]
    for r, path in enumerate(ranks):
        plan = read_plan(path)
        assert plan.parallel.rank == r and (plan.model.num_heads, plan.model.num_kv_heads) == (2, 1)
        kv = next(i for i in onnx.load(path / "model.onnx").graph.input if i.name == "kv_cache.0")
        assert kv.type.tensor_type.shape.dim[2].dim_value == 1
    layout = json.loads((result.plan_dir / "fusion_report.json").read_text())["parallel"]
    assert layout["sharded_attention_layers"] == 2 and layout["sharded_mlps"] == 2
    assert [r["why"].split(":")[0] for r in layout["replicated"]] == ["LM head"]
    # Every sharded weight: the ranks' slices put back together are the unsplit weight of the unsharded plan.
    full = initializers(rank_dir(tp_plan("tiny-llama", 1).plan_dir, 0))
    shards = [initializers(p) for p in ranks]
    sharded = [name for name in shards[0] if name.endswith(".tp_shard")]
    assert len(sharded) == 2 * 2  # o and down in each layer (q, k, v and gate, up are joined, below)
    for name in sharded:
        a, b = shards[0][name], shards[1][name]
        whole = full[name]  # the one-rank plan keeps the whole weight under the same name
        axis = 0 if a.shape[1] == whole.shape[1] else 1
        assert a.shape[axis] * 2 == whole.shape[axis]
        np.testing.assert_array_equal(np.concatenate([a, b], axis=axis), whole)
    # Q/K/V and gate/up joined on each rank after sharding: rank r's join is its own slices side by side, so each
    # member's slices of the two ranks put back together are that member of the one-rank plan's join.
    joined = [name[:-len(".weight")] for name in shards[0] if name.endswith(".hfused.weight")]
    assert len(joined) == 2 * 2  # QKV and gate/up in each layer
    for prefix in joined:
        sizes = full[f"{prefix}.split"]
        assert list(sizes) in ([64, 32, 32], [128, 128])  # q 4x16, k and v 2x16; gate and up 128
        for r in range(2):
            np.testing.assert_array_equal(shards[r][f"{prefix}.split"], sizes // 2)
        ranks = [np.split(s[f"{prefix}.weight"], np.cumsum(sizes // 2)[:-1], axis=1) for s in shards]
        for i, whole in enumerate(np.split(full[f"{prefix}.weight"], np.cumsum(sizes)[:-1], axis=1)):
            np.testing.assert_array_equal(np.concatenate([ranks[0][i], ranks[1][i]], axis=1), whole)


def test_rank_graphs_get_the_decode_gemv_fusions_of_one_gpu(tp_plan, plan_dir):
    """The joined Q/K/V and gate/up let the torch executor's decode rewrites (runtime/executors/gemv.py, forced on
    here: they rewrite the graph only) fuse every rank's layers as they fuse the unsharded plan's: per layer one
    GEMV with RoPE and the KV write, one gate/up GEMV with SiLU·mul, O and down (measured before the join on
    4xH200: 57 GEMVs a step on every rank of the 8-layer 8B shape against 25 on one GPU)."""
    from trtopt.runtime.executors.torch_executor import TorchExecutor

    whole = TorchExecutor(plan_dir("tiny-llama"), read_plan(plan_dir("tiny-llama")), decode_gemv=True)
    layers = whole.plan.model.num_layers
    result = tp_plan("tiny-llama", 2)
    for rank in range(2):
        path = rank_dir(result.plan_dir, rank)
        ex = TorchExecutor(path, read_plan(path), decode_gemv=True)
        counts = (ex.num_gemv_weights, ex.num_gemv_rope_kv, ex.num_gemv_silu_mul)
        assert counts == (whole.num_gemv_weights, whole.num_gemv_rope_kv, whole.num_gemv_silu_mul)
        assert counts == (4 * layers + 1, layers, layers)


def test_rank_plans_with_external_weights_match_inline_ones(tp_plan, export_dir, tmp_path, monkeypatch):
    """A plan over the external-data threshold (the 1.24B benchmark shape) has its weights moved out of the proto
    when rank 0 is saved: every later rank must still get all of its weights, its own slices included."""
    import trtopt.builder.plan_files as plan_files

    monkeypatch.setattr(plan_files, "EXTERNAL_DATA_THRESHOLD", 0)
    result = build_plan(export_dir("tiny-llama"), tmp_path / "plan", limits=LIMITS, force=True, progress=False,
                        tensor_parallel=2)
    inline = tp_plan("tiny-llama", 2)
    for r in range(2):
        path = rank_dir(result.plan_dir, r)
        assert (path / plan_files.EXTERNAL_DATA_FILE).exists()
        got, want = initializers(path), initializers(rank_dir(inline.plan_dir, r))
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_qwen2_kv_head_is_replicated_when_fewer_than_ranks(tp_plan):
    """tiny-qwen2: 4 query heads, ONE KV head (MQA), QKV bias, tied embeddings: N = 2 keeps the KV head on both."""
    result = tp_plan("tiny-qwen2", 2)
    assert result.parallel.kv_heads_replicated and result.parallel.kv_heads_per_rank == 1
    shards = [initializers(rank_dir(result.plan_dir, r)) for r in range(2)]
    proto = onnx.load(rank_dir(result.plan_dir, 0) / "model.onnx")
    attention = [n for n in proto.graph.node if n.op_type == "PagedAttention"]
    for node in attention:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["num_heads"], attrs["num_kv_heads"]) == (2, 1)
    names = [n for n in shards[0] if n.endswith(".tp_shard")]
    kv_like = [n for n in names if shards[0][n].ndim == 2 and shards[0][n].shape[1] == 16]  # [hidden, 1 head x 16]
    assert kv_like, names
    for name in kv_like:  # the one KV head lives whole on both ranks
        np.testing.assert_array_equal(shards[0][name], shards[1][name])
    q_like = [n for n in names if shards[0][n].shape == (64, 32)]
    assert q_like and all(not np.array_equal(shards[0][n], shards[1][n]) for n in q_like)
    # Tied embeddings: the embedding matrix is not split and both ranks hold it whole.
    embedding = [n for n in shards[0] if shards[0][n].shape == (49152, 64)]
    assert len(embedding) == 1 and np.array_equal(shards[0][embedding[0]], shards[1][embedding[0]])


def test_head_count_not_divisible_is_a_fusion_error(export_dir, tmp_path):
    with pytest.raises(FusionError, match="num_heads 4 is not a multiple of --tensor-parallel 3"):
        build_plan(export_dir("tiny-llama"), tmp_path / "p", limits=LIMITS, progress=False, tensor_parallel=3)
    assert not (tmp_path / "p").exists()


def test_runtimes_refuse_mismatched_sizes(tp_plan, plan_dir):
    sharded = tp_plan("tiny-llama", 2).plan_dir
    with pytest.raises(ConfigError, match="torch backend only"):
        create_executor("onnxruntime", sharded, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="sharded for 2 ranks"):
        create_executor("torch", sharded, tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="not sharded"):
        create_executor("torch", plan_dir("tiny-llama"), tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="runs one device"):
        create_executor("torch", sharded, compile_mode="default")


def test_factory_opens_a_plan_sharded_for_one_rank_as_its_rank0_alone(tp_plan):
    """create_executor with no plan reads the dir: a plan sharded for one rank runs rank0/ in this process."""
    from trtopt.runtime.executors.torch_executor import TorchExecutor

    top = tp_plan("tiny-llama", 1).plan_dir
    ex = create_executor("torch", top, tensor_parallel_size=1)
    assert type(ex) is TorchExecutor and ex.plan == read_plan(rank_dir(top, 0))


def test_all_reduce_torch_face_checks_the_group_size():
    from trtopt.plugins.all_reduce.reference import all_reduce_ref

    x = torch.randn(3, 4)
    assert all_reduce_ref(x, world_size=1) is x  # a group of one: the sum is the value
    with pytest.raises(RuntimeError, match="sharded for 2 ranks but runs in a group of 1"):
        all_reduce_ref(x, world_size=2)


def test_cli_build_prints_the_layout_and_explains_what_stayed_whole(export_dir, tmp_path):
    from typer.testing import CliRunner

    from trtopt.cli.main import app

    result = CliRunner().invoke(app, ["build", str(export_dir("tiny-llama")), "-o", str(tmp_path / "p"),
                                      "--tensor-parallel", "2", "--explain"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "sharded for 2 rank(s): 2/1 heads per rank" in out and "4 all-reduces per step" in out
    assert "tensor_parallel | " in out and "not sharded: LM head: replicated" in out
    result = CliRunner().invoke(app, ["build", str(export_dir("tiny-llama")), "-o", str(tmp_path / "v"),
                                      "--tensor-parallel", "2", "--lm-head", "vocab-parallel", "--explain"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "LM head vocab-parallel (1 all-gather per step)" in out and "not sharded" not in out
    assert "LM head vocab-parallel: 24576 of 49152 vocabulary columns per rank" in out and "saves 6.0 MiB" in out
    assert read_plan(tmp_path / "v").parallel.lm_head == "vocab-parallel"
    result = CliRunner().invoke(app, ["build", str(export_dir("tiny-llama")), "-o", str(tmp_path / "q"), "--tp", "3"])
    assert result.exit_code != 0 and "num_heads 4 is not a multiple of --tensor-parallel 3" in result.output
    assert "Traceback" not in result.output
