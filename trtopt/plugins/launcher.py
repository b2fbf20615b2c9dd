"""Launch the ops' Triton kernels without Triton's per-call dispatcher (the eager host cost per call).

`kernel[grid](*args, **kw)` runs JITFunction.run on every call: bind the arguments to the signature, work out each
one's specialisation, format a cache key, look the compiled kernel up, check the globals it used, then launch. On an
H200 that is 13-22 µs per launch for our kernels, against 7-9 µs for launching the very CompiledKernel the
dispatcher returned (docs/benchmarks/launch_host_session9_f13a442_h200.json); PagedAttention launches two or three kernels per layer.

`launch(kernel, grid, *args, **kw)` keeps that CompiledKernel, keyed by everything that decides which one Triton
would pick (specialization_key): the current device; the constexprs and launch options (num_warps, ...) by name,
type and value (True and 1 compare equal in Python, not in Triton); every runtime argument's type; a tensor's dtype
and whether its address is 16-byte aligned; and the value of every other runtime argument (an int, float, bool, str
or None). Triton specialises a tensor on its dtype and alignment and an int on its width, on being 1 and on 16
dividing it, so this key is at least as fine as Triton's own: a hit is the kernel the dispatcher would have launched. An int that changes every call (a token count) costs
one dispatcher launch per new value. A miss launches through the dispatcher (compiling if needed) and remembers
what it returned. Anything this module does not know goes through the dispatcher every time, which is always
right: the CPU interpreter (TRITON_INTERPRET=1: its kernels are not JITFunctions), autotuned or heuristics-wrapped
kernels, callable grids, arguments of other types, kernels with pre-run hooks, and every launch when
TRTOPT_TRITON_DISPATCH=1 at import (ruling this module out when debugging), or when the installed Triton is not one
whose runner convention was checked (_CHECKED_TRITON).

Who launches decides, not a module switch (STYLE.md §12): `launch`/`prepare` here follow TRTOPT_TRITON_DISPATCH as
read at import, and a `Launcher` is the same two calls with its own `dispatcher_only` switch (read from the variable
when it is made), held by the object that owns a call site's state: the torch executor's PagedAttention launch
state (paged_attention/planning.py `PagedLaunchState.launcher`), which same-run A/B measurements and tests flip. The
compiled kernels kept per kernel are a memo of Triton's answer for a specialisation (`_info`), shared by every
caller: which one is launched never depends on who asks.

Measured on an H200 (session 9, same run, docs/benchmarks/launch_host_session9_f13a442_h200.json): host time per
call −12% to −20% for the KV-write launches, −8% to −10% for argmax, Add+RMSNorm and SiLU·mul. What is left of such
a call is Triton's runner and C launcher (~7 µs per launch), this key (~3-4 µs), and the wrapper's work.

`prepare(kernel, grid, args, kwargs)` goes one step further for a call site that launches the same kernel many times
per step with other tensors (PagedAttention, once per layer: kernel.py `_PagedPlan`, STYLE.md §10): a DriverLaunch
packs the compiled kernel's parameter buffer once and each call writes only the tensors' addresses and calls
cuLaunchKernel (cuda-python); where that cannot be prepared, a Relaunch repeats the launch through `launch`. With it
an eager PagedAttention call costs 68-77% less host time than through the dispatcher (26-44 µs against 83-185 µs,
same-run pairs over four noisy runs in session 10: docs/benchmarks/GPU_E2E.md), of which ~13 µs is the driver's own cuLaunchKernel for its three launches.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import os
from typing import Any, Callable, Sequence

import torch
import triton

_MAX_ENTRIES = 4096  # per kernel; a cache that outgrows it (shapes without end) is dropped and refilled
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# Runtime argument types the key knows; a tensor subclass or any other object goes to the dispatcher (keying it by
# identity would also keep it alive in the cache).
_KEYED_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)})

# The Triton versions whose CompiledKernel runner convention this module relies on (`compiled[grid](*every
# parameter in signature order, constexprs included)`, what JITFunction.run itself passes): 3.6 is the GPU image's,
# run by the GPU tests (tests/plugins/test_launcher.py, direct == dispatcher bit for bit); 3.9 is this repository's
# CPU environment, whose source was read and whose cache logic the CPU test runs. Any other version goes through the
# dispatcher until it has been checked the same way.
_CHECKED_TRITON = {(3, 6), (3, 9)}


def _triton_checked() -> bool:
    try:
        return tuple(int(p) for p in triton.__version__.split(".")[:2]) in _CHECKED_TRITON
    except ValueError:
        return False


def _dispatch_only_from_env() -> bool:
    return os.environ.get("TRTOPT_TRITON_DISPATCH") == "1" or not _triton_checked()


# Read once: a per-launch environment lookup would cost more than the rest of the key. Never reassigned: a caller
# that switches holds a Launcher.
_DISPATCH_ONLY = _dispatch_only_from_env()


class _KernelInfo:
    """Per-kernel facts read once: parameter names in order, and the compiled kernels launched so far."""

    __slots__ = ("names", "cache", "hits", "misses")

    def __init__(self, names: list[str]) -> None:
        self.names = tuple(names)
        # key → ({None: CompiledKernel, grid: its runner, ...}, the constexprs in signature order)
        self.cache: dict[tuple, tuple[dict, tuple]] = {}
        self.hits = 0
        self.misses = 0


@functools.cache
def _info(kernel: Any) -> _KernelInfo | None:
    """The kernel's facts, or None when it is not a plain JITFunction this module can launch directly (the CPU
    interpreter's InterpretedFunction, an Autotuner or Heuristics wrapper, a kernel with pre-run hooks). A memo
    keyed by the kernel object: its compiled kernels are Triton's answers, the same for every caller."""
    plain = (type(kernel) is triton.runtime.jit.JITFunction and not getattr(kernel, "pre_run_hooks", None)
             and isinstance(getattr(kernel, "arg_names", None), list))
    return _KernelInfo(kernel.arg_names) if plain else None


@functools.cache
def _keyed_types(types: tuple[type, ...]) -> tuple[type, ...]:
    """`types` when the key knows every one of them (remembered), else TypeError (not remembered)."""
    if not _KEYED_TYPES.issuperset(types):
        unknown = sorted({t.__name__ for t in types if t not in _KEYED_TYPES})
        raise TypeError(f"no launch key for arguments of type {unknown}")
    return types


def specialization_key(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """The cache key of one launch (the module docstring says what it holds and why it is fine enough). Raises
    TypeError for an argument type it does not know or an unhashable constexpr; the launch then goes to the
    dispatcher."""
    types = _keyed_types(tuple(map(type, args)))
    return (types, tuple([(v.dtype, v.data_ptr() % 16 == 0) if v.__class__ in _TENSOR_TYPES else v for v in args]),
            tuple(kwargs.items()), tuple(map(type, kwargs.values())), torch.cuda.current_device())


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, with the compiled kernel launched directly when this call site launched it
    before with arguments of the same specialisation. Runtime arguments are positional, constexprs and options by
    name: the way every kernel of trtopt is called (a constexpr passed positionally is keyed by value, which is
    also right). Through the dispatcher only when TRTOPT_TRITON_DISPATCH=1 was set at import."""
    if _DISPATCH_ONLY:
        kernel[grid](*args, **kwargs)
        return
    _launch_kept(kernel, grid, args, kwargs)


def _launch_kept(kernel: Any, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
    """`launch` without the switch: the kept CompiledKernel where there is one."""
    info = _info(kernel)
    if info is None or grid.__class__ is not tuple:
        kernel[grid](*args, **kwargs)
        return
    try:
        key = specialization_key(args, kwargs)
        entry = info.cache.get(key)
    except TypeError:
        kernel[grid](*args, **kwargs)
        return
    if entry is not None:
        info.hits += 1
        runners, tail = entry
        runner = runners.get(grid)
        if runner is None:  # CompiledKernel[grid] binds the grid into a runner (and may load the module): once
            if len(runners) > 64:
                runners = {None: runners[None]}
                info.cache[key] = (runners, tail)
            runner = runners[grid] = runners[None][grid if len(grid) == 3 else grid + (1,) * (3 - len(grid))]
        runner(*args, *tail)
        return
    info.misses += 1
    compiled = kernel[grid](*args, **kwargs)
    # The runner takes every parameter in signature order, constexprs included (the dispatcher passes them so).
    # A kernel with a defaulted parameter left out, or a Triton whose dispatcher returns no CompiledKernel, is not
    # cached and keeps going through the dispatcher.
    names = info.names[len(args):]
    if callable(getattr(compiled, "__getitem__", None)) and all(name in kwargs for name in names):
        if len(info.cache) >= _MAX_ENTRIES:
            info.cache.clear()
        info.cache[key] = ({None: compiled}, tuple(kwargs[name] for name in names))


def launch_stats(kernel: Any) -> tuple[int, int]:
    """(direct launches, dispatcher launches that filled the cache) of one kernel so far, for tests and benches."""
    info = _info(kernel)
    return (info.hits, info.misses) if info else (0, 0)


class Launcher:
    """`launch` and `prepare` with a switch of its own: `dispatcher_only` sends every launch through Triton's
    dispatcher and prepares only Relaunches (then callers plan nothing either: the A/B baseline is the path with no
    launcher at all). Made with TRTOPT_TRITON_DISPATCH's setting (read now) unless told; always on under a Triton
    whose runner convention was not checked. Its owner (paged_attention/planning.py `PagedLaunchState`) passes it to
    the launches it makes; same-run A/B measurements and tests flip the attribute."""

    __slots__ = ("_dispatcher_only",)

    def __init__(self, *, dispatcher_only: bool | None = None) -> None:
        self.dispatcher_only = _dispatch_only_from_env() if dispatcher_only is None else dispatcher_only

    @property
    def dispatcher_only(self) -> bool:
        return self._dispatcher_only

    @dispatcher_only.setter
    def dispatcher_only(self, flag: bool) -> None:
        self._dispatcher_only = bool(flag) or not _triton_checked()

    def launch(self, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        """Module `launch`, under this launcher's switch."""
        if self._dispatcher_only:
            kernel[grid](*args, **kwargs)
            return
        _launch_kept(kernel, grid, args, kwargs)

    def prepare(self, kernel: Any, grid: tuple[int, ...], args: Sequence[Any], kwargs: dict[str, Any], *,
                direct: bool = True) -> DriverLaunch | Relaunch:
        """Module `prepare`, under this launcher's switch (a Relaunch relaunches through this launcher)."""
        prepared = (_prepare_direct(kernel, grid, args, kwargs) if direct and not self._dispatcher_only
                    else None)
        return prepared if prepared is not None else Relaunch(kernel, grid, args, kwargs, launch_with=self.launch)


# ---------------------------------------------------------------------------------------------------------------------
# Prepared launches: everything but the tensors' addresses fixed once (STYLE.md §10: plan once per step, run per layer).
# ---------------------------------------------------------------------------------------------------------------------
# Scalar parameter types → the C type Triton's launcher packs them as (its ty_to_cpp and float storage types).
_SCALAR_CTYPES = {"i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32,
                  "i64": ctypes.c_int64, "u1": ctypes.c_uint8, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16,
                  "u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "f32": ctypes.c_float,
                  "fp64": ctypes.c_double}
# Triton >= 3.3 appends hidden pointers (global scratch, profile scratch) after the kernel's own parameters; a
# kernel that allocates neither gets null pointers there, as Triton's launcher passes.
_MAX_HIDDEN_PARAMS = 2


@functools.cache
def _driver() -> tuple[Any, Any, Any] | None:
    """(cuda-python's cuLaunchKernel, CUDA_SUCCESS, CUfunction), or None without cuda-python (then nothing launches
    directly).

    cuda-python (`cuda.bindings.driver`, the `gpu` extra) rather than ctypes: on an H200 host the same
    cuLaunchKernel costs 4.5 µs per launch through it against 6.0 µs through ctypes, of which the driver itself is
    4.4 µs (session 10 probe, docs/benchmarks/GPU_E2E.md)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver.cuLaunchKernel, driver.CUresult.CUDA_SUCCESS, driver.CUfunction


def _pdl_config(dims: tuple[int, ...]) -> tuple[Any, Any, Any]:
    """(a cuLaunchKernelEx configuration of these dims with programmatic stream serialization allowed, whose stream
    is set per launch; cuLaunchKernelEx; CUstream), read once, not per launch."""
    from cuda.bindings import driver

    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    (config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX, config.blockDimY, config.blockDimZ,
     config.sharedMemBytes) = dims
    config.attrs = [attribute]
    config.numAttrs = 1
    return config, driver.cuLaunchKernelEx, driver.CUstream


@functools.cache
def _stream_getter() -> Any:
    return triton.runtime.driver.active.get_current_stream


def current_stream(device: int) -> int:
    """The raw handle of torch's current stream on `device`: what Triton's own launcher launches on."""
    return _stream_getter()(device)


class DriverLaunch:
    """One compiled kernel and grid, launched through the CUDA driver (cuLaunchKernel, cuda-python) with its
    parameter buffer (a ctypes array of pointers to the values: cuLaunchKernel's kernelParams) built once: the
    scalars are fixed, and each call writes only the tensors' addresses, as TensorRT launches a plugin's kernel.
    Prepared from a Triton kernel (`prepare`): what `kernel[grid](*args)` would launch, for any tensors of the
    prepared dtypes and 16-byte alignment (the call checks the alignment: it is part of the kernel's
    specialisation; the caller keeps the dtypes and everything else the same). Or from a kernel compiled by NVRTC
    (paged_attention/decode_cuda.py), with the same contract."""

    __slots__ = ("name", "device", "num_tensors", "_launch_kernel", "_success", "_function", "_dims", "_addresses",
                 "_aligned", "_all_aligned", "_params", "_params_address", "_values", "_scalar_at", "_config")

    def __init__(self, name: str, function: int, dims: tuple[int, ...], device: int, kinds: list[tuple[str, Any]],
                 aligned: list[bool], hidden: int = 0, scalar_positions: Sequence[int] = (), *,
                 pdl: bool = False) -> None:
        """function: the raw CUfunction handle; dims: (grid x, y, z, threads x, y, z, dynamic shared bytes); kinds:
        each parameter in order, ("*", None) for a pointer or (type, its ctypes value) for a scalar; aligned: each
        pointer's 16-byte alignment as prepared; hidden: null pointers appended (Triton's scratch parameters).

        pdl: launch as a programmatic dependent launch (cuLaunchKernelEx with programmatic stream serialization):
        the kernel may start before the previous kernel on the stream has finished, so it must execute
        `griddepcontrol.wait` before it reads anything that kernel wrote (decode_cuda.py's kernels do, first)."""
        self.name = name
        self.device = device
        self._launch_kernel, self._success, function_type = _driver()
        self._function = function_type(function)
        self._dims = dims
        self._config = _pdl_config(dims) if pdl else None
        self.num_tensors = num_pointers = len(aligned)
        self._addresses = (ctypes.c_uint64 * max(num_pointers, 1))()  # rewritten per call, one slice assignment
        self._aligned = aligned
        self._all_aligned = all(aligned)
        slots, values, pointer = [], [], 0
        for kind, value in kinds:
            if kind == "*":
                slots.append(ctypes.addressof(self._addresses) + 8 * pointer)
                pointer += 1
            else:
                values.append(value)
                slots.append(ctypes.addressof(value))
        for _ in range(hidden):  # null global/profile scratch
            values.append(ctypes.c_uint64(0))
            slots.append(ctypes.addressof(values[-1]))
        self._values = values  # keeps the scalars' storage alive
        # argument position → its ctypes storage, for set_scalar (the scalars in `kinds` order)
        self._scalar_at = dict(zip(scalar_positions, [v for kind, v in kinds if kind != "*"]))
        self._params = (ctypes.c_void_p * len(slots))(*slots)
        self._params_address = ctypes.addressof(self._params)

    def __call__(self, stream: int, *tensors: torch.Tensor) -> bool:
        """Launch on `stream` with these tensors in the kernel's order of tensor parameters; False (nothing
        launched) when an address's 16-byte alignment differs from the prepared one's."""
        return self.launch(stream, [t.data_ptr() for t in tensors])

    def set_scalar(self, position: int, value: int | float) -> None:
        """The runtime scalar at argument `position` (its index in the prepared call's args) takes `value` for the
        launches that follow. cuLaunchKernel copies the parameters at each launch, so launches already queued or
        captured into a CUDA graph keep theirs. For scalars that vary per call but not the kernel's specialisation
        (an FP8 pool's per-layer scales: a float is never specialised on)."""
        self._scalar_at[position].value = value

    def launch(self, stream: int, addresses: list[int]) -> bool:
        """`self(stream, *tensors)` with the tensors' addresses (data_ptr) already read: a caller that passes one
        tensor to several launches, or views of one allocation, reads each address once."""
        if len(addresses) != self.num_tensors:
            raise TypeError(f"{self.name} takes {self.num_tensors} tensor addresses; got {len(addresses)}")
        if (functools.reduce(operator.or_, addresses, 0) % 16 if self._all_aligned
                else [a % 16 == 0 for a in addresses] != self._aligned):
            return False
        self._addresses[:len(addresses)] = addresses
        if self._config is not None:
            config, launch_ex, stream_type = self._config
            config.hStream = stream_type(stream)
            (result,) = launch_ex(config, self._function, self._params_address, 0)
        else:
            (result,) = self._launch_kernel(self._function, *self._dims, stream, self._params_address, 0)
        if result != self._success:
            raise RuntimeError(f"cuLaunchKernel failed for {self.name}: {result!r}")
        return True


class Relaunch:
    """The fallback of `prepare`: the same launch through `launch` (the dispatcher or the kept CompiledKernel; a
    Launcher's own `launch` when it prepared this) with the call's tensors put in place of the prepared ones. Taken
    on the CPU interpreter and wherever a direct driver launch cannot be prepared."""

    __slots__ = ("kernel", "grid", "args", "kwargs", "_tensor_at", "_launch")

    def __init__(self, kernel: Any, grid: tuple[int, ...], args: Sequence[Any], kwargs: dict[str, Any], *,
                 launch_with: Callable[..., None] | None = None) -> None:
        self._tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        # The tensors are the call's, put in per launch; holding the first call's (a KV pool) would keep it alive.
        self.kernel, self.grid, self.kwargs = kernel, grid, kwargs
        self.args = [None if isinstance(a, torch.Tensor) else a for a in args]
        self._launch = launch_with if launch_with is not None else launch

    def set_scalar(self, position: int, value: int | float) -> None:
        """As DriverLaunch.set_scalar: the launches that follow pass `value` at argument `position`."""
        self.args[position] = value

    def __call__(self, stream: int, *tensors: torch.Tensor) -> bool:
        args = self.args.copy()
        for i, t in zip(self._tensor_at, tensors):
            args[i] = t
        self._launch(self.kernel, self.grid, *args, **self.kwargs)
        return True


def prepare(kernel: Any, grid: tuple[int, ...], args: Sequence[Any], kwargs: dict[str, Any], *,
            direct: bool = True) -> DriverLaunch | Relaunch:
    """A launch of `kernel[grid](*args, **kwargs)` to repeat with other tensors: call it as `run(stream, *tensors)`
    with the tensor arguments in their order in `args`. Call it after `launch` made the same launch once (that
    launch compiled the kernel and left it in this module's cache).

    A DriverLaunch when this module knows the compiled kernel and its parameter layout is checked: the kernel's
    non-constexpr parameters in signature order (pointers, then scalars packed as Triton packs them) plus Triton's
    hidden scratch pointers must be exactly the parameters its PTX entry declares, and the kernel must need no
    scratch memory, clusters, cooperative or programmatic-dependent launch; and cuda-python must be installed.
    Anything else, `direct=False`, or TRTOPT_TRITON_DISPATCH=1 at import, gets a Relaunch."""
    prepared = _prepare_direct(kernel, grid, args, kwargs) if direct and not _DISPATCH_ONLY else None
    return prepared if prepared is not None else Relaunch(kernel, grid, args, kwargs)


def _prepare_direct(kernel: Any, grid: tuple[int, ...], args: Sequence[Any],
                    kwargs: dict[str, Any]) -> DriverLaunch | None:
    info = _info(kernel)
    if info is None or grid.__class__ is not tuple or not 1 <= len(grid) <= 3:
        return None
    try:
        entry = info.cache.get(specialization_key(tuple(args), kwargs))
    except TypeError:
        return None
    if entry is None or _driver() is None:
        return None
    compiled = entry[0][None]
    metadata = getattr(compiled, "metadata", None)
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if (metadata is None or not isinstance(signature, dict) or tuple(signature) != info.names
            or getattr(compiled, "function", None) is None or not isinstance(compiled.function, int)
            or getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "launch_cooperative_grid", False)
            or getattr(metadata, "launch_pdl", False) or getattr(metadata, "global_scratch_size", 0)
            or getattr(metadata, "profile_scratch_size", 0)
            or any(d != 1 for d in getattr(metadata, "cluster_dims", (1, 1, 1)))):
        return None
    kinds, aligned, positions = [], [], []
    for i, (name, kind) in enumerate(signature.items()):
        value = args[i] if i < len(args) else kwargs.get(name)
        if kind == "constexpr":
            continue
        if not isinstance(kind, str):
            return None  # a tuple parameter
        if kind.startswith("*"):
            if not isinstance(value, torch.Tensor):
                return None
            kinds.append(("*", None))
            aligned.append(value.data_ptr() % 16 == 0)
        elif kind in _SCALAR_CTYPES and isinstance(value, (int, float)):
            kinds.append((kind, _SCALAR_CTYPES[kind](value)))
            positions.append(i)
        else:
            return None
    if sum(isinstance(a, torch.Tensor) for a in args) != len(aligned):
        return None  # a tensor passed where Triton saw no pointer: not a layout this module knows
    from trtopt.plugins.trt_common import ptx_param_count

    try:
        hidden = ptx_param_count(compiled.asm["ptx"], metadata.name) - len(kinds)
    except (KeyError, AssertionError):
        return None
    if not 0 <= hidden <= _MAX_HIDDEN_PARAMS:
        return None
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    threads = metadata.num_warps * getattr(metadata, "warp_size", 32)
    return DriverLaunch(metadata.name, compiled.function, (*grid3, threads, 1, 1, metadata.shared),
                        torch.cuda.current_device(), kinds, aligned, hidden, positions)

