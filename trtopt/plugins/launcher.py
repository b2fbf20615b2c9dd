"""Launch the ops' Triton kernels without Triton's per-call dispatcher (issue 11: the eager host cost per call).

`kernel[grid](*args, **kw)` runs JITFunction.run on every call: bind the arguments to the signature, work out each
one's specialisation, format a cache key, look the compiled kernel up, check the globals it used, then launch. On an
H200 that is 13-22 µs per launch for our kernels, against 7-9 µs for launching the very CompiledKernel the
dispatcher returned (docs/benchmarks/launch_host_h200.json); PagedAttention launches two or three kernels per layer.

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
TRTOPT_TRITON_DISPATCH=1 (or set_dispatcher_only(True): same-run A/B measurements, and ruling this module out when
debugging), or when the installed Triton is not one whose runner convention was checked (_CHECKED_TRITON).

Measured on an H200 (session 9, same run, docs/benchmarks/launch_host_h200.json): host time per call −13% for
PagedAttention (85 vs 97 µs), −14% with the RoPE fold (107 vs 124 µs), −12% to −20% for the KV-write launches, −8%
to −10% for argmax, Add+RMSNorm and SiLU·mul. An eager batch-1 decode step of the 1.24B plan is unchanged (13.3 ms
either way): its host time is torch's own ops (GEMM launches, allocations, views), and CUDA graphs replay every
served step anyway. What is left of a call is Triton's runner and C launcher (~7 µs per launch), this key (~3-4
µs), and the wrapper's checks and allocations; docs/benchmarks/GPU_E2E.md has the breakdown.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton

_MAX_ENTRIES = 4096  # per kernel; a cache that outgrows it (shapes without end) is dropped and refilled
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# Runtime argument types the key knows; a tensor subclass or any other object goes to the dispatcher (keying it by
# identity would also keep it alive in the cache).
_KEYED_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)})
_known_type_tuples: set[tuple] = set()

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


# Read once: a per-launch environment lookup would cost more than the rest of the key.
_dispatch_only = os.environ.get("TRTOPT_TRITON_DISPATCH") == "1" or not _triton_checked()


def set_dispatcher_only(flag: bool) -> bool:
    """Send every launch through Triton's dispatcher (True) or not; returns the previous setting. For same-run
    A/B measurements (benchmarks/bench_launch_host.py) and tests; TRTOPT_TRITON_DISPATCH=1 sets it at import."""
    global _dispatch_only
    previous, _dispatch_only = _dispatch_only, bool(flag) or not _triton_checked()
    return previous


class _KernelInfo:
    """Per-kernel facts read once: parameter names in order, and the compiled kernels launched so far."""

    __slots__ = ("names", "cache", "hits", "misses")

    def __init__(self, names: list[str]) -> None:
        self.names = tuple(names)
        # key → ({None: CompiledKernel, grid: its runner, ...}, the constexprs in signature order)
        self.cache: dict[tuple, tuple[dict, tuple]] = {}
        self.hits = 0
        self.misses = 0


_INFO: dict[Any, _KernelInfo | None] = {}


def _info(kernel: Any) -> _KernelInfo | None:
    """The kernel's facts, or None when it is not a plain JITFunction this module can launch directly (the CPU
    interpreter's InterpretedFunction, an Autotuner or Heuristics wrapper, a kernel with pre-run hooks)."""
    info = _INFO.get(kernel, False)
    if info is False:
        plain = (type(kernel) is triton.runtime.jit.JITFunction and not getattr(kernel, "pre_run_hooks", None)
                 and isinstance(getattr(kernel, "arg_names", None), list))
        info = _INFO[kernel] = _KernelInfo(kernel.arg_names) if plain else None
    return info


def specialization_key(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """The cache key of one launch (the module docstring says what it holds and why it is fine enough). Raises
    TypeError for an argument type it does not know or an unhashable constexpr; the launch then goes to the
    dispatcher."""
    types = tuple(map(type, args))
    if types not in _known_type_tuples:
        if not _KEYED_TYPES.issuperset(types):
            unknown = sorted({t.__name__ for t in types if t not in _KEYED_TYPES})
            raise TypeError(f"no launch key for arguments of type {unknown}")
        _known_type_tuples.add(types)
    return (types, tuple([(v.dtype, v.data_ptr() % 16 == 0) if v.__class__ in _TENSOR_TYPES else v for v in args]),
            tuple(kwargs.items()), tuple(map(type, kwargs.values())), torch.cuda.current_device())


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, with the compiled kernel launched directly when this call site launched it
    before with arguments of the same specialisation. Runtime arguments are positional, constexprs and options by
    name: the way every kernel of trtopt is called (a constexpr passed positionally is keyed by value, which is
    also right)."""
    info = None if _dispatch_only else _info(kernel)
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
    info = _INFO.get(kernel)
    return (info.hits, info.misses) if info else (0, 0)
