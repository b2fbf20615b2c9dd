"""The trt_plugin modules' register and aot_impl functions, run end to end against a stand-in of tensorrt.plugin
(tests/plugins/trt_fake.py): the code that TensorRT would call at engine build, minus TensorRT.

Each case runs in a fresh process: the stand-in takes the place of ``tensorrt`` in sys.modules, and the Triton
interpreter mode of this process would make the kernels un-compilable. aot_impl compiles for sm_90 (there is no
GPU here to ask); everything else is the module's own code.
"""

import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent("""
    import functools, sys
    sys.path.insert(0, "tests/plugins")
    import trt_fake
    trtp = trt_fake.install()
    from trt_fake import TensorDesc
    from trtopt.errors import BuildError
    from trtopt.plugins import trt_common
    from trtopt.plugins.trt_common import check_aot_signature, check_register_signature, ptx_param_count

    def expect_build_error(fn, *args, match):
        try:
            fn(*args)
        except BuildError as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError("no BuildError")
""")

PAGED = PRELUDE + textwrap.dedent("""
    from trtopt.plugins.paged_attention import schema, trt_plugin as plugin
    plugin.compile_ptx = functools.partial(trt_common.compile_ptx, target=("cuda", 90, 32))
    assert set(trt_fake.REGISTERED) == set(trt_fake.AOT_IMPLS) == {"trtopt::PagedAttention"}
    check_register_signature(plugin.paged_attention_desc, schema.SCHEMA)
    check_aot_signature(plugin.paged_attention_aot, schema.SCHEMA)

    T, S, width, Hq, Hkv, D, bs = 37, 3, 9, 8, 2, 128, 16  # T, S, width dynamic; the rest fixed in the ONNX
    def inputs(cache_block_dim=(bs, True), slot_dtype="INT64", pool="HALF"):
        return [TensorDesc("HALF", [(1, True), (Hq, True), (T, False), (D, True)]),
                TensorDesc("HALF", [(1, True), (Hkv, True), (T, False), (D, True)]),
                TensorDesc("HALF", [(1, True), (Hkv, True), (T, False), (D, True)]),
                TensorDesc(pool, [(50, False), (2, True), (Hkv, True), cache_block_dim, (D, True)]),
                TensorDesc("INT32", [(S, False), (width, False)]),
                TensorDesc("INT32", [(S, False)]),
                TensorDesc("INT32", [(S + 1, False)]),
                TensorDesc(slot_dtype, [(T, False)]),
                TensorDesc("FLOAT", [(Hq, True)])]
    attrs = [Hq, Hkv, D, D ** -0.5, 1, 0, "auto\\0", 1.0, 1.0]  # a STRING attribute may keep its NUL
    descs = inputs()
    out, cache_out = plugin.paged_attention_desc(*descs, *attrs)
    assert cache_out.aliased_to is descs[3] and out.aliased_to is None
    assert [d.value for d in out.shape_expr] == [1, Hq, T, D] and out.dtype.name == "HALF"
    name, ptx, params, extra = plugin.paged_attention_aot(*descs, *attrs, (out, cache_out), 0)
    block_q = 16 // 4  # GQA group 4: 16 rows of 4 tokens x 4 heads
    assert name == "paged_attention_aot_kernel" and f".entry {name}" in ptx
    assert (params.grid_x.value, params.grid_y.value, params.grid_z.value) == (T // block_q + S, Hkv, 1)
    assert params.block_x.value == 128 and 0 < params.shared_mem.value <= 48 * 1024
    assert [e.value for e in extra] == [T, S, width]
    assert ptx_param_count(ptx, name) == 9 + 3 + 2
    expect_build_error(plugin.paged_attention_aot, *inputs(cache_block_dim=(bs, False)), *attrs, (out, cache_out), 0,
                       match="block size")
    expect_build_error(plugin.paged_attention_aot, *inputs(slot_dtype="INT32"), *attrs, (out, cache_out), 0,
                       match="slot_mapping")

    # FP8 pools: the kv_cache desc is TensorRT's FP8 and the node says kv_cache_dtype="fp8", with its scales
    fp8_attrs = [Hq, Hkv, D, D ** -0.5, 1, 0, "fp8", 0.05, 0.02]
    fp8_descs = inputs(pool="FP8")
    out, cache_out = plugin.paged_attention_desc(*fp8_descs, *fp8_attrs)
    assert cache_out.dtype.name == "FP8" and out.dtype.name == "HALF"
    name, fp8_ptx, params, extra = plugin.paged_attention_aot(*fp8_descs, *fp8_attrs, (out, cache_out), 0)
    assert ptx_param_count(fp8_ptx, name) == 9 + 3 + 2 and fp8_ptx != ptx and "e4m3" in fp8_ptx
    assert [e.value for e in extra] == [T, S, width] and params.grid_x.value == T // block_q + S
    expect_build_error(plugin.paged_attention_aot, *inputs(), *fp8_attrs, (out, cache_out), 0,
                       match="kv_cache_dtype is 'fp8'")  # an fp16 pool on an FP8 node
    expect_build_error(plugin.paged_attention_aot, *fp8_descs, *attrs, (out, cache_out), 0,
                       match="kv_cache is DataType.FP8")  # an FP8 pool on a node without FP8 attributes
    expect_build_error(plugin.paged_attention_aot, *fp8_descs, *fp8_attrs[:7], 0.0, 0.02, (out, cache_out), 0,
                       match="scales are finite and positive")
    expect_build_error(plugin.paged_attention_aot, *descs, *attrs[:6], "int8", 1.0, 1.0, (out, cache_out), 0,
                       match="kv_cache_dtype='int8'")
    print("ok")
""")

FLASH = PRELUDE + textwrap.dedent("""
    from trtopt.plugins.flash_attention import schema, trt_plugin as plugin
    plugin.compile_ptx = functools.partial(trt_common.compile_ptx, target=("cuda", 90, 32))
    assert set(trt_fake.REGISTERED) == set(trt_fake.AOT_IMPLS) == {"trtopt::FlashAttention"}
    check_register_signature(plugin.flash_attention_desc, schema.SCHEMA)
    check_aot_signature(plugin.flash_attention_aot, schema.SCHEMA)

    B, Hq, S, D = 3, 12, 21, 64  # B and S dynamic
    def inputs(bias_dtype="FLOAT", bias_dims=((B, False), (1, True), (1, True), (S, False))):
        qkv = [TensorDesc("HALF", [(B, False), (Hq, True), (S, False), (D, True)]) for _ in range(3)]
        return [*qkv, TensorDesc(bias_dtype, list(bias_dims))]
    attrs = [Hq, Hq, D, 0.125, 0]
    descs = inputs()
    out = plugin.flash_attention_desc(*descs, *attrs)
    assert [d.value for d in out.shape_expr] == [B, Hq, S, D]
    name, ptx, params, extra = plugin.flash_attention_aot(*descs, *attrs, (out,), 0)
    assert name == "flash_attention_aot_kernel" and ptx_param_count(ptx, name) == 4 + 6 + 1
    assert (params.grid_x.value, params.grid_y.value, params.grid_z.value) == (1, B * Hq, 1)
    assert [e.value for e in extra] == [S, S, S, 0, 0, 1], [e.value for e in extra]  # key-padding mask strides
    zero_bias = inputs(bias_dims=((1, True),) * 4)
    _, _, _, extra = plugin.flash_attention_aot(*zero_bias, *attrs, (out,), 0)
    assert [e.value for e in extra] == [S, S, 0, 0, 0, 0]
    expect_build_error(plugin.flash_attention_aot, *inputs(bias_dtype="BF16"), *attrs, (out,), 0, match="attn_bias")
    print("ok")
""")


@pytest.mark.parametrize("script", [PAGED, FLASH], ids=["PagedAttention", "FlashAttention"])
def test_aot_impl_runs_against_the_documented_api(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=root)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]
