"""ALiBi (tiny random BLOOM): the dynamo export attends in BLOOM's heads-folded bmm layout with slope·kpos added
inside baddbmm; it fuses 2/2 with the slopes recovered by the mask probe, and the plan equals the original on ORT
through the paged multi-step harness. A bias made non-linear in kpos and the legacy export are refused."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from paged_harness import compare_generation, session

from trtopt.errors import FusionError

LAYERS, HEADS, HIDDEN, VOCAB = 2, 4, 32, 128
HEAD_DIM = HIDDEN // HEADS


def _export_bloom(out, exporter: str):
    """A random-weight 2-layer BLOOM in the optimum-style cache signature (trtopt export does not take BLOOM)."""
    import torch
    import transformers

    class Wrapper(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
            cache = transformers.DynamicCache(ddp_cache_data=pairs, config=self.model.config)
            result = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                past_key_values=cache, use_cache=True)
            presents = [t for layer in result.past_key_values.layers for t in (layer.keys, layer.values)]
            return (result.logits, *presents)

    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS)
    model = Wrapper(transformers.BloomForCausalLM(config).eval()).eval()
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    past_names = [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]
    names = {
        "input_names": ["input_ids", "attention_mask", "position_ids", *past_names],
        "output_names": ["logits", *[n.replace("past_key_values", "present") for n in past_names]],
    }
    args = (
        torch.randint(0, VOCAB, (2, 4)),
        torch.ones(2, 7, dtype=torch.int64),
        torch.arange(3, 7)[None].expand(2, 4).contiguous(),
        *[torch.randn(2, HEADS, 3, HEAD_DIM) for _ in past_names],
    )
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings about HF's Python-side checks
        if exporter == "dynamo":
            dim = torch.export.Dim
            batch, seq, past, total = dim("batch"), dim("seq"), dim("past"), dim("total")
            shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq},
                      tuple({0: batch, 2: past} for _ in past_names))
            torch.onnx.export(model, args, dynamo=True, opset_version=18, dynamic_shapes=shapes, **names).save(
                str(out / "model.onnx")
            )
        else:
            axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
                    "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
            axes |= {n: {0: "batch", 2: "past"} for n in past_names}
            torch.onnx.export(model, args, str(out / "model.onnx"), dynamo=False, opset_version=17,
                              dynamic_axes=axes, **names)
    return out


@pytest.fixture(scope="module")
def bloom_dir(module_tmp):
    cache = {}

    def get(exporter: str):
        if exporter not in cache:
            cache[exporter] = _export_bloom(module_tmp / f"bloom-{exporter}", exporter)
        return cache[exporter]

    return get


def _optimize(graph: ir.Model, source):
    from trtopt.builder.model_facts import head_dims_from_config
    from trtopt.fusion_passes import optimize

    config = json.loads((source / "config.json").read_text())
    return optimize(graph, dims=head_dims_from_config(config), block_size=4, vocab_size=VOCAB)


def _bloom_slopes() -> np.ndarray:
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    return _get_alibi_slopes(HEADS, "cpu").numpy()


def test_bloom_dynamo_fuses_with_alibi_and_matches_original(bloom_dir):
    from trtopt.plugins import attach_functions

    source = bloom_dir("dynamo")
    graph = ir.load(str(source / "model.onnx"))
    report = _optimize(graph, source)
    assert report.counts["paged_attention"] == LAYERS and not report.unfused
    proto = attach_functions(ir.to_proto(graph))
    onnx.checker.check_model(proto, full_check=True)
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    nodes = [n for n in proto.graph.node if n.op_type == "PagedAttention"]
    assert len(nodes) == LAYERS
    for node in nodes:
        slopes = initializers[node.input[8]]  # the op's optional alibi_slopes input
        assert slopes.dtype == np.float32 and np.array_equal(slopes, _bloom_slopes())
    err = compare_generation(
        session(proto.SerializeToString()),
        session(str(source / "model.onnx")),
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        block_size=4,
        prompts=[[5, 17, 33, 2, 90, 11, 7, 41, 3], [3, 4, 99]],
        decode_steps=4,
        chunk=4,
    )
    assert err <= 1e-4


def test_bloom_with_a_bias_not_linear_in_kpos_is_refused(bloom_dir):
    """Square BLOOM's slope·kpos in the graph: still a per-head bias, but no ALiBi slope can express it."""
    from trtopt.fusion_passes.attention_match import match_attention

    source = bloom_dir("dynamo")
    graph = ir.load(str(source / "model.onnx"))
    softmax = next(n for n in graph.graph if n.op_type == "Softmax")
    bias = match_attention(softmax).mask.folded_bias
    square = ir.Node("", "Mul", [bias, bias], name="square_alibi")
    graph.graph.insert_after(bias.producer(), square)
    for use in list(bias.uses()):
        if use.node is not square:
            use.node.replace_input_with(use.idx, square.outputs[0])
    with pytest.raises(FusionError, match="not linear in the key position"):
        _optimize(graph, source)


def test_bloom_legacy_is_refused_with_a_reason(bloom_dir):
    """The legacy trace drops BLOOM's unused position_ids (the build now adds the input: BLOOM reads no positions)
    and carries no intermediate shapes; even with the inferred ones (which prove optimum's BLOOM export) the head
    folds of its bmm attention are not proven, so it is refused with that reason."""
    source = bloom_dir("legacy")
    with pytest.raises(FusionError, match=r"not provably (a )?\[B, H, [^\]]*\] → \[B·H, [^\]]*\]"):
        _optimize(ir.load(str(source / "model.onnx")), source)


def test_bloom_through_export_build_and_generate_equals_hf(tmp_path):
    """The public path end to end: `export_model` (eager attention: BLOOM has no SDPA path), `build_plan` (ALiBi
    recovered into the PagedAttention op), `LLM.generate` greedy = HF `generate` token for token, prompts of 1 to 3
    KV blocks batched together. initializer_range=1.0 makes the random model's continuations vary, so that a wrong
    bias cannot hide behind a repeated token."""
    import torch
    import transformers

    from trtopt import LLM, SamplingParams
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits
    from trtopt.export import export_model

    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                      initializer_range=1.0)
    hf = transformers.BloomForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    exported = export_model(tmp_path / "hf", tmp_path / "onnx")
    built = build_plan(exported.out_dir, tmp_path / "plan", progress=False,
                       limits=Limits(block_size=16, max_num_tokens=256, max_num_seqs=4, max_model_len=128))
    assert built.report.counts["paged_attention"] == LAYERS
    prompts = [[5, 17, 99, 3, 120, 7], list(range(10, 50)), [1]]
    outs = LLM(built.plan_dir).generate([{"prompt_token_ids": p} for p in prompts],
                                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    distinct = set()
    for prompt, out in zip(prompts, outs):
        x = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, min_new_tokens=16,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, (prompt, out.outputs[0].token_ids, ref)
        distinct |= set(ref)
    assert len(distinct) > 6  # the continuations really vary
