"""What the TensorRT registrations share (trtopt/plugins/trt_common.py), and which ops get a plugin at all.

No ``from __future__ import annotations`` here: the stand-in register functions need real annotation types, as
tensorrt.plugin does.
"""

import importlib
import importlib.util
from typing import Tuple

import pytest

from trtopt.plugins import OP_SCHEMAS
from trtopt.plugins.common import make_node
from trtopt.plugins.trt_common import (
    check_aot_signature,
    check_register_signature,
    ptx_param_count,
    register_parameter_names,
    require_aot,
    strip_hidden_params,
    triton_type,
    trt_plugin_module,
)

PLUGIN_OPS = {"PagedAttention", "FlashAttention"}  # ops with a Triton kernel, hence an AOT plugin
# ops TensorRT should import through their ONNX function body
BODY_OPS = {"RMSNorm", "MatMulAdd", "AllReduce", "AllGather", "SiluMul", "GeluMul", "AddRMSNorm", "Rope",
            "QMatMul"}  # QMatMul: TensorRT sees plain Q/DQ and picks its own quantized kernels


def test_every_op_is_classified() -> None:
    assert set(OP_SCHEMAS) == PLUGIN_OPS | BODY_OPS


@pytest.mark.parametrize("op", sorted(PLUGIN_OPS | BODY_OPS))
def test_trt_plugin_module_is_the_file_in_the_ops_folder(op: str) -> None:
    module = trt_plugin_module(op)
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin.endswith("/trt_plugin.py"), module
    if op in BODY_OPS:
        assert importlib.import_module(module).HAS_TENSORRT_PLUGIN is False


def test_trt_plugin_module_names_do_not_follow_the_op_name() -> None:
    assert trt_plugin_module("MatMulAdd") == "trtopt.plugins.matmul_add.trt_plugin"
    assert trt_plugin_module("RMSNorm") == "trtopt.plugins.rms_norm.trt_plugin"
    with pytest.raises(ValueError, match="unknown trtopt op"):
        trt_plugin_module("Softmax")


def test_triton_types() -> None:
    assert [triton_type(n) for n in ("FLOAT", "HALF", "BF16", "INT32", "INT64")] == ["fp32", "fp16", "bf16", "i32",
                                                                                       "i64"]
    with pytest.raises(ValueError, match="INT8"):
        triton_type("INT8")


class TensorDesc:
    """Stands in for trtp.TensorDesc: only names and attribute annotations are checked."""


def good(x: TensorDesc, weight: TensorDesc, bias: TensorDesc, epsilon: float) -> TensorDesc: ...
def wrong_order(x: TensorDesc, bias: TensorDesc, weight: TensorDesc, epsilon: float) -> TensorDesc: ...
def with_default(x: TensorDesc, weight: TensorDesc, bias: TensorDesc, epsilon: float = 1e-5) -> TensorDesc: ...
def int_epsilon(x: TensorDesc, weight: TensorDesc, bias: TensorDesc, epsilon: int) -> TensorDesc: ...


def test_register_signature_check_catches_order_defaults_and_kinds() -> None:
    from trtopt.plugins.common import AttrSpec, OpSchema

    schema = OpSchema("Toy", ("x", "weight", "bias"), {}, ("y",), (AttrSpec("epsilon", float),), lambda s, a: [])
    assert register_parameter_names(schema) == ["x", "weight", "bias", "epsilon"]
    check_register_signature(good, schema)
    for bad, why in ((wrong_order, "needs"), (with_default, "no defaults"), (int_epsilon, "schema says")):
        with pytest.raises(AssertionError, match=why):
            check_register_signature(bad, schema)
    # `from __future__ import annotations` would make every annotation a string, which tensorrt.plugin rejects.
    namespace: dict = {}
    exec("def f(x: 'TensorDesc', weight: 'TensorDesc', bias: 'TensorDesc', epsilon: 'float'): ...", namespace)
    stringly = namespace["f"]
    with pytest.raises(AssertionError, match="string"):
        check_register_signature(stringly, schema)

    def aot(x, weight, bias, epsilon, outputs: Tuple[TensorDesc], tactic: int): ...
    def aot_missing_tactic(x, weight, bias, epsilon, outputs): ...

    check_aot_signature(aot, schema)
    with pytest.raises(AssertionError, match="tactic"):
        check_aot_signature(aot_missing_tactic, schema)


def test_ptx_param_count_reads_the_entry() -> None:
    ptx = """
    .visible .entry k(
        .param .u64 .ptr .global .align 1 k_param_0,
        .param .u32 k_param_1,
        .param .u64 .ptr .global .align 1 k_param_2
    )
    { ld.param.b64 %rd1, [k_param_0]; }
    """
    assert ptx_param_count(ptx, "k") == 3


def test_hidden_params_are_stripped_only_when_unread() -> None:
    ptx = """
    .visible .entry k(
        .param .u64 .ptr .global .align 1 k_param_0,
        .param .u32 k_param_1,
        .param .u64 .ptr .global .align 1 k_param_2,
        .param .u64 .ptr .global .align 1 k_param_3
    )
    { ld.param.b64 %rd1, [k_param_0]; ld.param.b32 %r1, [k_param_1]; }
    """
    stripped = strip_hidden_params(ptx, "k", 2)
    assert ptx_param_count(stripped, "k") == 2 and "k_param_2" not in stripped and "[k_param_1]" in stripped
    assert strip_hidden_params(ptx, "k", 4) == ptx
    with pytest.raises(AssertionError, match="k_param_1"):
        strip_hidden_params(ptx, "k", 1)  # param 1 is read: it is not Triton's hidden scratch


@pytest.mark.parametrize("op,inputs,attrs", [("RMSNorm", ["x", "s"], {"epsilon": 1e-6}),
                                             ("MatMulAdd", ["x", "w", "b"], {}), ("SiluMul", ["g", "u"], {}),
                                             ("GeluMul", ["g", "u"], {"tanh": 1})])
def test_ops_without_a_plugin_do_not_ask_tensorrt_for_one(op: str, inputs: list[str], attrs: dict) -> None:
    node = make_node(op, inputs, ["y"], **attrs)
    assert "plugin_namespace" not in {a.name for a in node.attribute}


def test_a_tensorrt_without_aot_plugins_is_an_import_error() -> None:
    class OldPluginModule:  # tensorrt.plugin before 10.9: register/impl only
        register = impl = autotune = staticmethod(lambda *a: None)

    with pytest.raises(ImportError, match="10.9"):
        require_aot(OldPluginModule)

    class NewPluginModule(OldPluginModule):
        aot_impl = KernelLaunchParams = SymInt32 = SymIntExprs = object

    require_aot(NewPluginModule)
