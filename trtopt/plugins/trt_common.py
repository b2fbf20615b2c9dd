"""What the TensorRT registrations (face 5 of docs/architecture.md §4) share, with no `tensorrt` import: testable here.

Each op's ``trt_plugin.py`` registers ``trtopt::<OpType>`` with ``tensorrt.plugin`` and, in its ``aot_impl``,
compiles a Triton kernel to PTX. TensorRT launches that PTX with a fixed argument order (``tensorrt/plugin/_lib.py``,
``aot_impl`` docstring; ``_plugin_class.py`` ``get_launch_params``):

    input pointers (node order) · extra scalar args (SymInt32 only, in the order returned) · output pointers

so every AOT kernel entry point is written with exactly that parameter order, followed by its constexprs.

What this module holds: the dtype mapping, the PTX compile step (``triton.compile`` on an ``ASTSource`` with an
explicit or the current GPU target), a check of the kernel's PTX parameter count, and the check that a register
function's parameters are the schema's inputs then its attributes, in order.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from trtopt.plugins.common import OpSchema

FP8_TYPE = "fp8e4nv"  # an FP8 KV pool (TensorRT's FP8, ONNX's float8e4m3fn, torch's float8_e4m3fn)
# trt.DataType member name → Triton's type string (TensorDesc.dtype is a trt.DataType; `.name` is e.g. "HALF").
TRITON_TYPES: dict[str, str] = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16", "INT32": "i32", "INT64": "i64",
                                "FP8": FP8_TYPE}
# The dtypes the attention kernels take for q/k/v/kv_cache.
FLOAT_TYPES = ("fp32", "fp16", "bf16")
# Triton ≥3.3 appends hidden pointer parameters (global scratch, profile scratch) to every kernel; compile_ptx
# removes them (strip_hidden_params). NVIDIA's quickly_deployable_plugins sample pins triton 3.5, which has them too.
HIDDEN_TRITON_PARAMS = 2
# Dynamic shared memory a launch may use without cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES), which
# TensorRT's AOT launch is not documented to set.
MAX_LAUNCH_SHARED_BYTES = 48 * 1024


def require_aot(trtp: Any) -> None:
    """ImportError (which the TensorRT executor turns into a BuildError) unless ``tensorrt.plugin`` has AOT plugins
    (``aot_impl`` and ``KernelLaunchParams``, TensorRT 10.9+)."""
    if not all(hasattr(trtp, name) for name in ("aot_impl", "KernelLaunchParams", "SymInt32", "SymIntExprs")):
        raise ImportError(
            "this TensorRT has no AOT Python plugins (tensorrt.plugin.aot_impl, TensorRT 10.9+); trtopt's engines "
            "embed the plugins' PTX and need them. Install TensorRT >= 10.9."
        )


def trt_plugin_module(op_type: str) -> str:
    """The module whose import registers ``op_type`` with TensorRT: trt_plugin.py in the op's own folder.

    Taken from the op's registered function builder, not from the op's name: folder names do not follow one rule
    (MatMulAdd → matmul_add, RMSNorm → rms_norm).
    """
    from trtopt.plugins import FUNCTION_BUILDERS

    if op_type not in FUNCTION_BUILDERS:
        raise ValueError(f"unknown trtopt op {op_type!r}; registered: {sorted(FUNCTION_BUILDERS)}")
    package = FUNCTION_BUILDERS[op_type].__module__.rsplit(".", 1)[0]
    return f"{package}.trt_plugin"


def plugin_modules(model_path) -> list[str]:
    """The TensorRT registration modules of the trtopt ops in a model that have a plugin, each once.

    Ops without one (``tensorrt_plugin=False``: RMSNorm, MatMulAdd) reach TensorRT as their inlined function bodies.
    """
    import onnx

    from trtopt.plugins import DOMAIN, OP_SCHEMAS

    model = onnx.load(str(model_path), load_external_data=False)
    ops = sorted({n.op_type for n in model.graph.node if n.domain == DOMAIN})
    return [trt_plugin_module(op) for op in ops if op in OP_SCHEMAS and OP_SCHEMAS[op].tensorrt_plugin]


def triton_type(trt_dtype_name: str) -> str:
    """Triton's pointer element type for a TensorRT dtype name ("HALF" → "fp16")."""
    if trt_dtype_name not in TRITON_TYPES:
        raise ValueError(f"no Triton type for TensorRT dtype {trt_dtype_name}; supported: {sorted(TRITON_TYPES)}")
    return TRITON_TYPES[trt_dtype_name]


def dot_precision(float_type: str) -> str:
    """The kernels' tl.dot precision: exact fp32 for fp32 models, tensor cores otherwise (as their launchers do)."""
    return "ieee" if float_type == "fp32" else "tf32"


@dataclass(frozen=True)
class PtxKernel:
    """One compiled kernel, as aot_impl returns it to TensorRT."""

    name: str  # the PTX entry name (TensorRT looks the kernel up by it)
    ptx: str
    num_warps: int  # block_x = num_warps · 32
    shared_mem: int  # dynamic shared memory in bytes, KernelLaunchParams.shared_mem

    @property
    def block_x(self) -> int:
        return self.num_warps * 32


def compile_ptx(fn: Any, signature: Mapping[str, str], constexprs: Mapping[str, Any], *, num_warps: int,
                num_stages: int, target: tuple[str, int, int] | None = None) -> PtxKernel:
    """triton.compile(ASTSource(fn, signature, constexprs)) → PTX whose entry takes exactly ``signature``.

    ``signature`` maps every runtime parameter of ``fn`` to its Triton type ("*fp16", "i32"), in ``fn``'s order;
    constexpr parameters get "constexpr" added here. ``target`` is (backend, arch, warp_size), e.g. ("cuda", 90, 32);
    None compiles for the current GPU (what aot_impl does at engine build time, on the GPU the engine is for).

    Two adjustments make the PTX fit TensorRT's launch: Triton's hidden scratch parameters are removed from the
    entry (see strip_hidden_params), and software-pipeline stages are dropped one at a time while the kernel needs
    more than MAX_LAUNCH_SHARED_BYTES of shared memory, which a launch gets without an opt-in attribute.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
    assert list(signature) + [p for p in params if p in constexprs] == params, (
        f"signature + constexprs must name every parameter of {params} in order; got {list(signature)} and "
        f"{list(constexprs)}"
    )
    full_signature = {name: signature.get(name, "constexpr") for name in params}
    gpu = GPUTarget(*target) if target is not None else None
    for stages in range(num_stages, 0, -1):
        src = ASTSource(fn=fn, signature=full_signature, constexprs=dict(constexprs))
        compiled = triton.compile(src, target=gpu, options={"num_warps": num_warps, "num_stages": stages})
        if compiled.metadata.shared <= MAX_LAUNCH_SHARED_BYTES:
            break
    assert compiled.metadata.shared <= MAX_LAUNCH_SHARED_BYTES, (
        f"{compiled.metadata.name} needs {compiled.metadata.shared} B of shared memory even with 1 stage; pick "
        "smaller tiles"
    )
    name = compiled.metadata.name
    ptx = strip_hidden_params(compiled.asm["ptx"], name, len(signature))
    return PtxKernel(name=name, ptx=ptx, num_warps=compiled.metadata.num_warps, shared_mem=compiled.metadata.shared)


def strip_hidden_params(ptx: str, kernel_name: str, num_params: int) -> str:
    """The PTX with the entry's parameters past the first ``num_params`` removed.

    Triton ≥3.3 appends hidden pointers (global and profile scratch) to every kernel; TensorRT launches with
    exactly inputs + extra args + outputs, so a PTX entry declaring more would make the driver read kernel-parameter
    slots TensorRT never filled. Removing them is only sound when the body never reads them, which is asserted:
    kernels that need global scratch (device-side TMA descriptors, split-KV partials) cannot be AOT plugins.
    """
    entry = re.search(rf"(\.entry\s+{re.escape(kernel_name)}\s*\()(.*?)(\))", ptx, flags=re.S)
    assert entry, f"no .entry {kernel_name} in the PTX"
    decls = [d.strip() for d in entry.group(2).split(",") if d.strip()]
    assert len(decls) >= num_params, f"{kernel_name} declares {len(decls)} parameters, fewer than {num_params}"
    if len(decls) == num_params:
        return ptx
    body = ptx[entry.end():]
    for decl in decls[num_params:]:
        param = decl.split()[-1]
        assert not re.search(rf"\b{re.escape(param)}\b", body), (
            f"{kernel_name} reads Triton's hidden parameter {param}: it needs global scratch"
        )
    kept = "\n".join(f"\t{d}," for d in decls[:num_params]).rstrip(",")
    return ptx[: entry.start(2)] + "\n" + kept + "\n" + ptx[entry.end(2):]


def ptx_param_count(ptx: str, kernel_name: str) -> int:
    """How many parameters the PTX entry ``kernel_name`` declares (ours + Triton's hidden ones)."""
    match = re.search(rf"\.entry\s+{re.escape(kernel_name)}\s*\((.*?)\)", ptx, flags=re.S)
    assert match, f"no .entry {kernel_name} in the PTX"
    return len(re.findall(r"\.param\s", match.group(1)))


def register_parameter_names(schema: OpSchema) -> list[str]:
    """What ``@trtp.register`` must take, in order: every input (optional ones are always present), then every
    attribute. The parser passes the node's attributes by name, so the names must match the node's exactly. The
    plugin allows no defaults, so an omittable attribute (AttrSpec.omittable) must be on the node all the same:
    TensorRT parses a copy whose trtopt nodes carry them (`fill_plugin_attributes`)."""
    return [*schema.inputs, *(a.name for a in schema.attributes)]


def fill_plugin_attributes(model: Any) -> int:
    """Give every trtopt node of an op with a TensorRT plugin the omittable attributes it lacks, at their schema
    defaults (PagedAttention's kv_cache_dtype="auto", k_scale=v_scale=1.0 on a plan without FP8 pools), in place;
    returns how many were added. A plugin declares every attribute and TensorRT has no defaults to fill them."""
    import onnx

    from trtopt.plugins import DOMAIN, OP_SCHEMAS

    added = 0
    for node in model.graph.node:
        spec = OP_SCHEMAS.get(node.op_type) if node.domain == DOMAIN else None
        if spec is None or not spec.tensorrt_plugin:
            continue
        present = {a.name for a in node.attribute}
        for attr in spec.attributes:
            if attr.omittable and attr.name not in present:
                node.attribute.append(onnx.helper.make_attribute(attr.name, attr.kind(attr.default)))
                added += 1
    return added


def check_register_signature(func: Callable[..., Any], schema: OpSchema) -> None:
    """AssertionError unless ``func``'s parameters are the schema's inputs then attributes, none with a default,
    attribute annotations equal to the schema's kinds (int/float), and annotations are real types, not strings.

    ``tensorrt.plugin`` validates with ``issubclass(param.annotation, ...)``, so a module with
    ``from __future__ import annotations`` (string annotations) cannot be registered.
    """
    params = inspect.signature(func).parameters
    assert list(params) == register_parameter_names(schema), (
        f"{func.__name__} takes {list(params)}; {schema.op_type}'s schema needs {register_parameter_names(schema)}"
    )
    kinds = {a.name: a.kind for a in schema.attributes}
    for name, param in params.items():
        assert param.default is inspect.Parameter.empty, f"{name}: tensorrt.plugin allows no defaults"
        assert not isinstance(param.annotation, str), f"{name}: annotation is a string; drop `from __future__`"
        if name in kinds:
            assert param.annotation is kinds[name], f"{name} is {param.annotation}, the schema says {kinds[name]}"


def check_aot_signature(func: Callable[..., Any], schema: OpSchema) -> None:
    """AssertionError unless ``func`` is (inputs..., attributes..., outputs, tactic), as TensorRT calls it:
    ``aot_impl_function(*input_descs, *attribute_values, output_descs, tactic)``, attributes positionally."""
    params = list(inspect.signature(func).parameters)
    expected = [*register_parameter_names(schema), "outputs", "tactic"]
    assert params == expected, f"{func.__name__} takes {params}; TensorRT calls it with {expected}"


def launch_ptx(kernel: PtxKernel, signature: Mapping[str, str], args: list[int], grid: tuple[int, int, int],
               stream: int = 0) -> None:
    """Load ``kernel``'s PTX with the CUDA driver and launch it with exactly ``args`` (pointers as ints, then
    scalars), the way TensorRT's AOT path does: no Triton launcher, no hidden parameters.

    For checking an AOT artifact on a GPU without TensorRT. Needs an initialised CUDA context on this thread
    (e.g. any torch CUDA op first). It waits for the kernel (cuStreamSynchronize on ``stream``) and then unloads
    the module, so a test that launches many kernels does not pile up modules for the life of the process.

    The driver is called through ctypes, not cuda-python's ``cuda.bindings``: a test-side helper (GPU only) that must
    also run where cuda-python (the `gpu` extra, used by launcher.DriverLaunch's per-call launches) is not installed.
    """
    import ctypes

    assert len(args) == len(signature), f"{kernel.name} takes {len(signature)} arguments, got {len(args)}"
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(result: int, what: str) -> None:
        if result != 0:
            message = ctypes.c_char_p()
            cuda.cuGetErrorString(result, ctypes.byref(message))
            reason = message.value.decode() if message.value else str(result)
            raise RuntimeError(f"{what} failed for {kernel.name}: {reason}")

    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    check(cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(kernel.ptx.encode() + b"\0")),
          "cuModuleLoadData")
    try:
        check(cuda.cuModuleGetFunction(ctypes.byref(function), module, kernel.name.encode()), "cuModuleGetFunction")
        values = [ctypes.c_uint64(a) if kind.startswith("*") else ctypes.c_int32(a)
                  for a, kind in zip(args, signature.values())]
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        check(cuda.cuLaunchKernel(function, *map(ctypes.c_uint, grid), ctypes.c_uint(kernel.block_x),
                                  ctypes.c_uint(1), ctypes.c_uint(1), ctypes.c_uint(kernel.shared_mem),
                                  ctypes.c_void_p(stream), params, None), "cuLaunchKernel")
        # The module must outlive the kernel: wait for it before unloading.
        check(cuda.cuStreamSynchronize(ctypes.c_void_p(stream)), "cuStreamSynchronize")
    finally:
        check(cuda.cuModuleUnload(module), "cuModuleUnload")
