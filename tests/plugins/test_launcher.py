"""plugins/launcher.py: the ops' Triton kernels launched straight through the CompiledKernel Triton returned.

On the CPU: the key separates every argument change Triton specialises on; interpreted kernels (TRITON_INTERPRET)
always go through the dispatcher; and, in a fresh process where the kernels are real JITFunctions but no GPU exists,
the cache logic itself (Triton's JITFunction.run replaced by a recorder, since nothing can launch here): a first
launch goes to the dispatcher, a repeat with the same specialisation goes to the compiled kernel with every
parameter in signature order, and a changed alignment, int or constexpr goes to the dispatcher again.

On a GPU (`gpu`): every kernel the launcher serves gives bit for bit the dispatcher's output when launched directly,
across alignment and int-equal-to-1 switches, and the direct path is the one taken.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from trtopt.plugins import launcher

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def on_device_zero(monkeypatch):
    """specialization_key reads the current CUDA device; on a CPU-only machine, pretend it is 0."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def key(*args, **kwargs):
    return launcher.specialization_key(args, kwargs)


def test_key_separates_what_triton_specialises_on(on_device_zero):
    base = torch.zeros(64, dtype=torch.float16)
    # Tensors: dtype and 16-byte alignment matter, the address and the shape do not.
    assert key(base, 3) == key(torch.ones(32, dtype=torch.float16), 3)
    assert key(base, 3) != key(base[1:], 3), "a 2-byte offset view is not 16-byte aligned"
    assert key(base, 3) == key(base[8:], 3), "a 16-byte offset view is"
    assert key(base, 3) != key(base.float(), 3)
    # Ints: 1 (a constexpr to Triton), multiples of 16, widths; bools and floats are other types than ints.
    keys = [key(base, x) for x in (1, 2, 16, 32, 2 ** 31, True, 1.0)]
    assert len(set(keys)) == len(keys)
    # Constexprs and options by name and value.
    assert key(base, BLOCK=16) != key(base, BLOCK=32)
    assert key(base, A=1, B=2) != key(base, A=2, B=1)
    assert key(base, num_warps=4) != key(base, num_warps=8)
    assert key(base, FLAG=True) != key(base, FLAG=1) and key(base, BLOCK=16) != key(base, BLOCK=16.0)


def test_key_refuses_what_it_cannot_key(on_device_zero):
    class Sub(torch.Tensor):
        pass

    with pytest.raises(TypeError, match="Sub"):
        key(torch.zeros(4).as_subclass(Sub))
    with pytest.raises(TypeError, match="list"):
        key([1, 2])
    with pytest.raises(TypeError):  # an unhashable constexpr: the dict lookup refuses the key
        hash(key(torch.zeros(4), BLOCK=[16]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter case (this machine has a GPU)")
def test_interpreted_kernels_go_through_the_dispatcher():
    from trtopt.plugins.silu_mul.kernel import _silu_mul_kernel, silu_mul_triton

    g, u = torch.randn(3, 40), torch.randn(3, 40)
    for _ in range(2):
        torch.testing.assert_close(silu_mul_triton(g, u), g * torch.sigmoid(g) * u, atol=1e-5, rtol=1e-5)
    assert launcher._info(_silu_mul_kernel) is None
    assert launcher.launch_stats(_silu_mul_kernel) == (0, 0)


CACHE_SCRIPT = textwrap.dedent("""
    import os
    import torch, triton, triton.language as tl
    from trtopt.plugins import launcher

    torch.cuda.current_device = lambda: 0

    @triton.jit
    def k(X, Y, n, stride, BLOCK: tl.constexpr, FLAG: tl.constexpr):
        pass

    calls = []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *values: calls.append(("direct", grid, values))

    def run(self, *args, grid, warmup, **kwargs):
        calls.append(("dispatcher", grid, args, kwargs))
        return Compiled()

    triton.runtime.jit.JITFunction.run = run
    x, y = torch.zeros(64), torch.zeros(64)

    def go(*args, grid=(4,), via=launcher, **kw):
        calls.clear()
        via.launch(k, grid, *args, **kw)
        return calls[0]

    first = go(x, y, 5, 64, BLOCK=16, FLAG=True, num_warps=4)
    assert first == ("dispatcher", (4,), (x, y, 5, 64), dict(BLOCK=16, FLAG=True, num_warps=4)), first
    # Same specialisation, other tensors and grid: the compiled kernel, every parameter in signature order.
    again = go(torch.ones(8), y, 5, 64, grid=(7, 2), BLOCK=16, FLAG=True, num_warps=4)
    assert again[0] == "direct" and again[1] == (7, 2, 1), again
    assert again[2][1:] == (y, 5, 64, 16, True) and again[2][0].shape == (8,), again
    # Anything Triton specialises on differently goes back to the dispatcher once.
    assert go(x[1:], y, 5, 64, BLOCK=16, FLAG=True, num_warps=4)[0] == "dispatcher"
    assert go(x, y, 1, 64, BLOCK=16, FLAG=True, num_warps=4)[0] == "dispatcher"
    assert go(x, y, 5, 64, BLOCK=32, FLAG=True, num_warps=4)[0] == "dispatcher"
    assert go(x, y, 5, 64, BLOCK=16, FLAG=True, num_warps=8)[0] == "dispatcher"
    assert go(x, y, 5, 64, BLOCK=16, FLAG=True, num_warps=8)[0] == "direct"
    # A prepared launch (launcher.prepare) of a kernel whose compiled form this module cannot drive through the CUDA
    # driver (here: the recorder's, with no metadata) relaunches through `launch` with the call's tensors in place.
    prepared = launcher.prepare(k, (4,), (x, y, 5, 64), dict(BLOCK=16, FLAG=True, num_warps=4))
    assert isinstance(prepared, launcher.Relaunch), prepared
    x2, y2 = torch.ones(16), torch.ones(16)
    calls.clear()
    assert prepared(0, x2, y2) is True
    assert calls[0][0] == "direct" and calls[0][2][0] is x2 and calls[0][2][1] is y2, calls
    assert calls[0][2][2:] == (5, 64, 16, True), calls
    # A callable grid, or a Launcher's switch: always the dispatcher (and a Relaunch through that Launcher).
    assert go(x, y, 5, 64, grid=lambda meta: (1,), BLOCK=16, FLAG=True)[0] == "dispatcher"
    own = launcher.Launcher(dispatcher_only=True)
    assert go(x, y, 5, 64, BLOCK=16, FLAG=True, num_warps=4, via=own)[0] == "dispatcher"
    relaunch = own.prepare(k, (4,), (x, y, 5, 64), dict(BLOCK=16, FLAG=True, num_warps=4))
    assert isinstance(relaunch, launcher.Relaunch)
    calls.clear()
    relaunch(0, x2, y2)
    assert calls[0][0] == "dispatcher", calls
    own.dispatcher_only = False
    assert go(x, y, 5, 64, BLOCK=16, FLAG=True, num_warps=4, via=own)[0] == "direct"
    assert go(x, y, 5, 64, BLOCK=16, FLAG=True, num_warps=4)[0] == "direct"
    # TRTOPT_TRITON_DISPATCH=1 when a Launcher is made: its switch starts on.
    os.environ["TRTOPT_TRITON_DISPATCH"] = "1"
    assert launcher.Launcher().dispatcher_only and not launcher.Launcher(dispatcher_only=False).dispatcher_only
    del os.environ["TRTOPT_TRITON_DISPATCH"]
    # A Triton whose runner convention was not checked: the dispatcher, whatever the switch says.
    triton.__version__ = "9.1.0"
    own.dispatcher_only = False
    assert own.dispatcher_only
    assert go(x, y, 5, 64, BLOCK=16, FLAG=True, num_warps=4, via=own)[0] == "dispatcher"
    print(launcher.launch_stats(k))
""")


def test_cache_logic_with_real_jit_functions(tmp_path):
    """A fresh process without TRITON_INTERPRET (so `k` is a real JITFunction; @triton.jit wants a file);
    JITFunction.run, the part that needs a GPU, records its calls instead of launching."""
    assert run_without_interpreter(tmp_path / "cache_logic.py", CACHE_SCRIPT) == "(5, 5)"


def run_without_interpreter(script, text: str) -> str:
    """Run `text` as a script in a fresh process without TRITON_INTERPRET and TRTOPT_TRITON_DISPATCH (so its
    kernels are real JITFunctions and the launcher is on); its stdout, stripped, once it exits cleanly."""
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRTOPT_TRITON_DISPATCH")}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


PREPARE_SCRIPT = textwrap.dedent("""
    import ctypes, types
    import torch, triton, triton.language as tl
    from trtopt.plugins import launcher

    torch.cuda.current_device = lambda: 0

    @triton.jit
    def k(X, Y, n, scale, one, BLOCK: tl.constexpr, FLAG: tl.constexpr):
        pass

    # What Triton's dispatcher returns, as far as prepare reads it: the signature (the int equal to 1 is a
    # constexpr to Triton), the metadata, the loaded function handle and the PTX (two hidden scratch pointers).
    PTX = ".entry k(\\n" + ",\\n".join(f".param .u64 k_param_{i}" for i in range(6)) + "\\n)\\n{ ret; }"

    class Compiled:
        src = types.SimpleNamespace(signature={"X": "*fp32", "Y": "*fp32", "n": "i32", "scale": "fp32",
                                               "one": "constexpr", "BLOCK": "constexpr", "FLAG": "constexpr"})
        metadata = types.SimpleNamespace(name="k", num_warps=4, warp_size=32, shared=1024, num_ctas=1,
                                         launch_cooperative_grid=False, launch_pdl=False, global_scratch_size=0,
                                         profile_scratch_size=0)
        function = 0xF00D
        asm = {"ptx": PTX}

        def __getitem__(self, grid):
            return lambda *values: None

    triton.runtime.jit.JITFunction.run = lambda self, *a, grid, warmup, **kw: Compiled()
    launches = []

    def cu_launch_kernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        read = lambda i, ctype: ctype.from_address(slots[i]).value
        launches.append(((f, gx, gy, gz, bx, by, bz, shared, stream), read(0, ctypes.c_uint64),
                         read(1, ctypes.c_uint64), read(2, ctypes.c_int32), read(3, ctypes.c_float),
                         read(4, ctypes.c_uint64), read(5, ctypes.c_uint64)))
        return (0,)

    launcher._driver = lambda: (cu_launch_kernel, 0, lambda handle: ("CUfunction", handle))
    x, y = torch.zeros(64), torch.zeros(64)
    args, kw = (x, y, 5, 0.5, 1), dict(BLOCK=16, FLAG=True, num_warps=4)
    assert isinstance(launcher.prepare(k, (4, 2), args, kw), launcher.Relaunch)  # not launched yet: nothing kept
    launcher.launch(k, (4, 2), *args, **kw)
    run = launcher.prepare(k, (4, 2), args, kw)
    assert isinstance(run, launcher.DriverLaunch) and run.num_tensors == 2, run
    x2, y2 = torch.ones(16), torch.ones(16)
    assert run(7, x2, y2) is True
    (dims, px, py, n, scale, hidden0, hidden1), = launches
    assert dims == (("CUfunction", 0xF00D), 4, 2, 1, 128, 1, 1, 1024, 7), dims
    assert (px, py) == (x2.data_ptr(), y2.data_ptr()) and (n, scale) == (5, 0.5) and hidden0 == hidden1 == 0
    # A tensor off the prepared 16-byte alignment launches nothing (the caller takes the full path).
    assert run(7, x2[1:], y2) is False and len(launches) == 1
    with __import__("pytest").raises(TypeError):
        run(7, x2)
    # What the driver path does not know is prepared as a Relaunch: scratch memory, a PTX whose parameters do not
    # add up, a tuple parameter, no cuda-python.
    for change in ({"global_scratch_size": 64}, {"num_ctas": 2}, {"launch_pdl": True}):
        saved = dict(vars(Compiled.metadata))
        vars(Compiled.metadata).update(change)
        assert isinstance(launcher.prepare(k, (4, 2), args, kw), launcher.Relaunch), change
        vars(Compiled.metadata).update(saved)
    Compiled.asm = {"ptx": PTX.replace("k_param_5", "k_param_5,\\n.param .u64 k_param_6,\\n.param .u64 x,\\n.param .u64 z")}
    assert isinstance(launcher.prepare(k, (4, 2), args, kw), launcher.Relaunch)
    Compiled.asm = {"ptx": PTX}
    assert isinstance(launcher.prepare(k, (4, 2), args, kw), launcher.DriverLaunch)
    launcher._driver = lambda: None
    assert isinstance(launcher.prepare(k, (4, 2), args, kw), launcher.Relaunch)
    print("ok")
""")


def test_prepared_driver_launch_packs_what_triton_would(tmp_path):
    """launcher.prepare on a real JITFunction whose compiled form is a stand-in (no GPU here) and with cuLaunchKernel
    replaced by a recorder that reads the parameter buffer back: the pointers are the call's tensors, the scalars
    the prepared values in Triton's C types, the constexprs (and the int equal to 1) absent, the hidden scratch
    pointers null; an alignment change launches nothing; anything the driver path does not know gets a Relaunch."""
    assert run_without_interpreter(tmp_path / "prepare_logic.py", PREPARE_SCRIPT) == "ok"


# ---- on the GPU: direct launches equal the dispatcher's, bit for bit --------------------------------------------
def _paged_cases():
    from test_paged_attention_kernel import Case

    return {
        "decode_gqa4": Case(context=(40, 3), new=(1, 1), num_heads=8, num_kv_heads=2, dtype=torch.bfloat16),
        "decode_one_seq": Case(context=(77,), new=(1,), num_heads=8, num_kv_heads=2, dtype=torch.bfloat16),
        "mixed_fp16": Case(context=(0, 21, 9, 33), new=(13, 5, 1, 1), num_heads=4, num_kv_heads=1,
                           dtype=torch.float16, seed=1),
        "long_split_kv": Case(context=(3000,), new=(1,), num_heads=8, num_kv_heads=2, dtype=torch.bfloat16),
        "alibi_window_fp32": Case(context=(25, 4), new=(5, 1), num_heads=8, num_kv_heads=2, alibi=True,
                                  sliding_window=7, seed=8),
    }


def _run_paged(case, rope: bool, state, planned: bool = True):
    """One call of the op with `state`; `planned=False` passes an output buffer, which keeps the call off the
    per-step plan (attention.py `_PagedPlan`, its own tests in test_paged_plan.py), so its launches go through the
    state's launcher."""
    from test_paged_attention_kernel import make_step, rope_tables

    from trtopt.plugins.paged_attention.kernel import paged_attention_triton

    step = make_step(case, torch.device("cuda"))
    extra = dict(zip(("rope_cos", "rope_sin"), rope_tables(case, torch.device("cuda")))) if rope else {}
    if not planned:
        extra["out"] = torch.empty(step.q.shape, dtype=step.q.dtype, device="cuda")
    out, cache = paged_attention_triton(step.q, step.k, step.v, step.kv_cache, step.block_tables, step.seq_lens,
                                        step.query_start_loc, step.slot_mapping, alibi_slopes=step.alibi_slopes,
                                        **extra, **step.attrs, state=state)
    return out, cache


def _same_both_ways(fn, state=None, kernels=()):
    """fn() through Triton's dispatcher, then twice through the launcher (the second launch is direct): all equal.
    The dispatcher: `state`'s launcher switched to it (PagedAttention), and for `kernels`, launched by launcher.launch
    with no state, their kept compiled kernels forgotten (a launch with none kept goes through the dispatcher, which
    fills them)."""
    for kernel in kernels:
        launcher._info(kernel).cache.clear()
    if state is not None:
        state.launcher.dispatcher_only = True
    try:
        want = fn()
    finally:
        if state is not None:
            state.launcher.dispatcher_only = False
    fn()
    got = fn()
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=0, rtol=0, equal_nan=True)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name, rope", [(name, rope) for name in ("decode_gqa4", "decode_one_seq", "mixed_fp16",
                                                                  "long_split_kv") for rope in (False, True)]
                         + [("alibi_window_fp32", False)])  # ALiBi models do not rotate: no RoPE-fold case
def test_gpu_paged_attention_direct_equals_dispatcher(name, rope):
    """Through the kept CompiledKernel (a call with an output buffer), and through the per-step plan's driver
    launches (a call without): both equal the dispatcher's output bit for bit."""
    from trtopt.plugins.paged_attention.attention import _paged_attn_kernel
    from trtopt.plugins.paged_attention.planning import PagedLaunchState

    case = _paged_cases()[name]
    state = PagedLaunchState()
    hits = launcher.launch_stats(_paged_attn_kernel)[0]
    _same_both_ways(lambda: _run_paged(case, rope, state, planned=False), state)
    assert launcher.launch_stats(_paged_attn_kernel)[0] > hits, "the second call did not launch directly"
    state.clear_plans()
    _same_both_ways(lambda: _run_paged(case, rope, state), state)
    (plan,) = state.plans.values()
    assert plan.calls == 1 and isinstance(plan.attention, launcher.DriverLaunch), "the plan did not serve the call"


@pytest.mark.gpu
@requires_cuda
def test_gpu_specialisation_switches_relaunch_the_right_kernel():
    """num_seqs 1 → 2 → 1 (Triton makes an int equal to 1 a constexpr) and a q view 2 bytes off 16-byte alignment
    between aligned ones: each output equals the dispatcher's."""
    from test_paged_attention_kernel import Case

    from trtopt.plugins.paged_attention.planning import PagedLaunchState

    state = PagedLaunchState()
    for case in (Case(context=(50,), new=(1,), dtype=torch.bfloat16), Case(context=(50, 9), new=(1, 1),
                 dtype=torch.bfloat16), Case(context=(50,), new=(1,), dtype=torch.bfloat16)):
        _same_both_ways(lambda: _run_paged(case, False, state), state)

    from trtopt.plugins.rms_norm.kernel import _rms_norm_kernel, rms_norm_triton

    storage = torch.randn(4 * 257 + 1, device="cuda", dtype=torch.bfloat16)
    scale = torch.randn(257, device="cuda", dtype=torch.bfloat16)
    for offset in (0, 1, 0, 1):
        x = storage[offset:offset + 4 * 257].view(4, 257)
        _same_both_ways(lambda: (rms_norm_triton(x, scale, epsilon=1e-6),), kernels=(_rms_norm_kernel,))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_pointwise_norm_and_argmax_kernels_direct_equal_dispatcher(dtype):
    from trtopt.plugins.add_rms_norm.kernel import _add_rms_norm_kernel, add_rms_norm_triton
    from trtopt.plugins.gelu_mul.kernel import _gelu_mul_kernel, gelu_mul_triton
    from trtopt.plugins.rope.kernel import _rope_kernel, rope_triton
    from trtopt.plugins.silu_mul.kernel import _silu_mul_kernel, silu_mul_triton
    from trtopt.runtime.kernels.argmax_triton import _argmax_pieces, _argmax_rows, argmax_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(5, 2048, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    scale = torch.randn(2048, device="cuda", dtype=dtype, generator=gen)
    gate_up = torch.randn(5, 2 * 1536, device="cuda", dtype=dtype, generator=gen)
    g, u = gate_up.split(1536, dim=-1)
    q = torch.randn(1, 3, 8, 64, device="cuda", dtype=dtype, generator=gen)
    cos, sin = (torch.randn(1, 1, 8, 64, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    logits = torch.randn(3, 50257, device="cuda", generator=gen)
    _same_both_ways(lambda: add_rms_norm_triton(x, r, scale, epsilon=1e-5), kernels=(_add_rms_norm_kernel,))
    _same_both_ways(lambda: (silu_mul_triton(g, u), gelu_mul_triton(g, u, tanh=1)),
                    kernels=(_silu_mul_kernel, _gelu_mul_kernel))
    _same_both_ways(lambda: (rope_triton(q, cos, sin),), kernels=(_rope_kernel,))
    _same_both_ways(lambda: (argmax_triton(logits),), kernels=(_argmax_pieces, _argmax_rows))
