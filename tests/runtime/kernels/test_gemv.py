"""The decode GEMV kernels (runtime/kernels/gemv_triton.py) against torch, and the executor rewrite that uses them
(runtime/executors/gemv.py). Without CUDA the kernels run under the Triton interpreter (set here before the kernel
module is imported); the `gpu` tests run the executor's GEMV path on a real GPU against its cuBLAS path."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from trtopt.builder.plan import read_plan  # noqa: E402
from trtopt.check.driver import BlockSource, Seq, make_step  # noqa: E402
from trtopt.plugins.silu_mul.reference import silu_mul_ref  # noqa: E402
from trtopt.plugins.paged_attention.reference import FP8_POOL_DTYPE  # noqa: E402
from trtopt.runtime.executors import gemv, trtopt_ops  # noqa: E402
from trtopt.runtime.executors.torch_executor import TorchExecutor  # noqa: E402
from trtopt.plugins.paged_attention.kernel import (  # noqa: E402
    paged_attention_triton, rope_write_kv_triton,
)
from trtopt.runtime.kernels.gemv_triton import (  # noqa: E402
    MAX_ROWS, default_config, gemv as gemv_triton, gemv_rope_kv, gemv_silu_mul,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# Small tiles (BLOCK_N, BLOCK_K, warps) that make the kernel walk several programs, a clamped last row block and
# several K tiles (a ragged last one) on small shapes; None = default_config (one K tile on these shapes).
CONFIGS = [(4, 32, 1), (2, 16, 1), None]


def _inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k,n", [(1, 64, 40), (3, 100, 17), (4, 96, 64), (2, 33, 9), (1, 48, 1)])
def test_gemv_matches_torch(m: int, k: int, n: int, dtype: torch.dtype, config) -> None:
    x, w = _inputs(m, k, n, dtype, seed=m + k + n)
    got = gemv_triton(x, w, config)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), (x.float() @ w.float().t()).to(dtype).float(), **TOL[dtype])


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k,inter", [(1, 64, 24), (4, 70, 33), (2, 32, 8)])
def test_gemv_silu_mul_matches_the_unfused_pair(m: int, k: int, inter: int, dtype: torch.dtype, config) -> None:
    """gate/up GEMM rounded to the dtype, then SiluMul's reference: what the unfused pair computes."""
    x, w = _inputs(m, k, 2 * inter, dtype, seed=m * k)
    got = gemv_silu_mul(x, w, config)
    gu = (x.float() @ w.float().t()).to(dtype)
    want = silu_mul_ref(gu[:, :inter], gu[:, inter:])
    assert got.shape == (m, inter) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gemv_stores_its_output_cast(dtype) -> None:
    """out_dtype: the GEMM's rounding to x's dtype, then the cast (the LM head's float32 logits), in one launch."""
    x, w = _inputs(1, 80, 37, dtype, seed=4)
    got = gemv_triton(x, w, (2, 32, 1), out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, gemv_triton(x, w, (2, 32, 1)).float())
    with pytest.raises(ValueError, match="cannot store"):
        gemv_triton(x, w, out_dtype=torch.int32)


def test_a_cast_after_the_lm_head_moves_into_its_gemv(monkeypatch) -> None:
    """projection → Squeeze → Cast(float32) becomes projection_cast → Squeeze; off the GEMV path it is the linear
    and the cast, bit for bit, and on it (forced here) the GEMV's cast output."""
    import torch.fx

    from trtopt.runtime.executors import onnx_ops

    graph = torch.fx.Graph()
    x, wt = graph.placeholder("x"), graph.placeholder("wt")
    y = graph.call_function(gemv.projection, (x, wt))
    graph.output(graph.call_function(onnx_ops.cast, (graph.call_function(onnx_ops.squeeze, (y, [0])),),
                                     {"to": torch.float32}))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert gemv._fuse_cast(gm) == 1
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [gemv.projection_cast, onnx_ops.squeeze]
    a, w = _inputs(1, 48, 24, torch.bfloat16, seed=8)
    a = a[None]  # [1, 1, K], as the graph's gathered last hidden state
    want = torch.nn.functional.linear(a, w).squeeze(0).float()
    monkeypatch.setattr(gemv, "_on_gpu", lambda t: False)
    assert torch.equal(gm(a, w), want)
    monkeypatch.setattr(gemv, "_on_gpu", lambda t: True)
    got = gm(a, w)
    assert got.dtype == torch.float32 and torch.equal(got, gemv_triton(a[0], w).float())


def _qkv_case(hq: int, hkv: int, d: int, k: int, dtype: torch.dtype, seed: int):
    """x [1, K], a fused Q/K/V weight, one token's cos/sin rows ([1, 1, D], as the plan's gathers give them) and an
    empty pool of 4-slot blocks."""
    x, w = _inputs(1, k, (hq + 2 * hkv) * d, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    cos, sin = (torch.randn(1, 1, d, generator=gen).to(DEVICE, dtype) for _ in range(2))
    pool = torch.zeros(6, 2, hkv, 4, d, dtype=dtype, device=DEVICE)
    return x, w, cos, sin, pool


def _views(y: torch.Tensor, hq: int, hkv: int, d: int) -> list[torch.Tensor]:
    """q, k, v [1, H, 1, D] as the exported graph makes them from the projection row (Split, Reshape, Transpose)."""
    return [part.reshape(1, 1, h, d).transpose(1, 2) for part, h in zip(y.split([hq * d, hkv * d, hkv * d], -1),
                                                                         (hq, hkv, hkv))]


@pytest.mark.parametrize("config", [None, (2, 32, 1), (4, 16, 1)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hq,hkv,d,k", [(4, 2, 16, 64), (6, 2, 8, 100), (3, 3, 10, 33), (2, 1, 6, 20)])
def test_gemv_rope_kv_is_the_gemv_then_the_rope_kv_write(hq, hkv, d, k, dtype, config) -> None:
    """The fused Q/K/V epilogue, bit for bit: y's q and k parts are what PagedAttention's RoPE + KV-write kernel makes
    of the plain GEMV's output, its v part is the GEMV's, and the pool holds the same rotated k and v at the slot
    (ragged K tiles, several pairs a program with a clamped last program, GQA and MHA, a head_dim not a power of
    two; fp32 on a GPU within rounding, see below). A slot of −1 leaves the pool alone."""
    x, w, cos, sin, pool = _qkv_case(hq, hkv, d, k, dtype, seed=hq * d + k)
    want_pool = pool.clone()
    slot = torch.tensor([9], device=DEVICE)
    y = gemv_rope_kv(x, w, cos, sin, pool, slot, num_heads=hq, num_kv_heads=hkv, head_dim=d, config=config)
    plain = gemv_triton(x, w, None if config is None else (2, config[1], config[2]))
    q, k_, v = _views(plain, hq, hkv, d)
    q_rot = rope_write_kv_triton(q, k_, v, cos, sin, want_pool, slot)
    got_q, got_k, got_v = _views(y, hq, hkv, d)
    assert bool(pool[2, :, :, 1].ne(0).any()) and torch.equal(got_k[0, :, 0], pool[2, 0, :, 1])  # slot 9: block 2
    if dtype == torch.float32 and DEVICE.type == "cuda":
        # The fused kernel is compiled without FMA contraction (RoPE's rounding); the plain GEMV's fp32 sums may
        # contract, and in fp32 no output rounding hides that.
        for got, want in ((pool, want_pool), (got_q, q_rot), (got_v, v)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(pool, want_pool) and torch.equal(got_q, q_rot) and torch.equal(got_v, v)
    untouched = torch.zeros_like(pool)
    gemv_rope_kv(x, w, cos, sin, untouched, torch.tensor([-1], device=DEVICE), num_heads=hq, num_kv_heads=hkv,
                 head_dim=d, config=config)
    assert not untouched.any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 0.2)])
def test_gemv_rope_kv_quantizes_an_fp8_pool_like_the_rope_kv_write(dtype, k_scale, v_scale) -> None:
    """With a float8_e4m3fn pool the epilogue stores the bytes PagedAttention's RoPE + KV-write kernel stores for
    the same scales (y unchanged), and the attention over it with kv_written equals the unfused path's."""
    hq, hkv, d = 4, 2, 16
    x, w, cos, sin, _ = _qkv_case(hq, hkv, d, 64, dtype, seed=21)
    x = x * 4  # values past 1/scale's reach: saturation is exercised too
    pool = torch.zeros(6, 2, hkv, 4, d, dtype=FP8_POOL_DTYPE, device=DEVICE)
    want_pool = pool.clone()
    meta = (torch.tensor([[1, 2, 0, 0]], dtype=torch.int32, device=DEVICE),
            torch.tensor([6], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
            torch.tensor([2 * 4 + 1], device=DEVICE))  # token 6: block 2, offset 1
    attrs = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=0.25, k_scale=k_scale, v_scale=v_scale)
    want, _ = paged_attention_triton(*_views(gemv_triton(x, w), hq, hkv, d), want_pool, *meta, **attrs,
                                     rope_cos=cos, rope_sin=sin)
    y = gemv_rope_kv(x, w, cos, sin, pool, meta[3], num_heads=hq, num_kv_heads=hkv, head_dim=d, k_scale=k_scale,
                     v_scale=v_scale)
    assert pool.view(torch.uint8).any()
    assert torch.equal(pool.view(torch.uint8), want_pool.view(torch.uint8))
    got, _ = paged_attention_triton(*_views(y, hq, hkv, d), pool, *meta, **attrs, kv_written=True)
    assert torch.equal(got, want)


def test_gemv_rope_kv_refuses_what_it_cannot_do() -> None:
    x, w, cos, sin, pool = _qkv_case(4, 2, 16, 64, torch.float16, seed=3)
    slot = torch.tensor([0], device=DEVICE)
    attrs = dict(num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="one row"):
        gemv_rope_kv(torch.cat([x, x]), w, cos, sin, pool, slot, **attrs)
    with pytest.raises(ValueError, match="one row"):
        gemv_rope_kv(x, w[:-16], cos, sin, pool, slot, **attrs)
    with pytest.raises(ValueError, match="cos as one row"):
        gemv_rope_kv(x, w, cos.expand(1, 2, 16), sin, pool, slot, **attrs)
    with pytest.raises(ValueError, match="pool"):
        gemv_rope_kv(x, w, cos, sin, pool.float(), slot, **attrs)
    with pytest.raises(ValueError, match="powers of two"):
        gemv_rope_kv(x, w, cos, sin, pool, slot, **attrs, config=(3, 64, 1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_attention_after_the_fused_write_equals_the_rope_kv_path(dtype) -> None:
    """A decode step of one sequence (13 cached tokens): gemv_rope_kv, then PagedAttention with kv_written (the
    attention kernels only) gives the output and pool of the path it replaces, the plain GEMV then PagedAttention
    with RoPE folded in, bit for bit; and kv_written refuses q, k, v that are not head-major views of one row."""
    hq, hkv, d = 4, 2, 16
    x, w, cos, sin, pool = _qkv_case(hq, hkv, d, 64, dtype, seed=11)
    gen = torch.Generator().manual_seed(5)
    pool[1:5] = torch.randn(pool[1:5].shape, generator=gen).to(DEVICE, dtype)
    want_pool = pool.clone()
    meta = (torch.tensor([[1, 2, 3, 4]], dtype=torch.int32, device=DEVICE),
            torch.tensor([14], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
            torch.tensor([4 * 4 + 1], device=DEVICE))  # token 14 of the sequence: block 4, offset 1
    attrs = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=0.25)
    want, _ = paged_attention_triton(*_views(gemv_triton(x, w), hq, hkv, d), want_pool, *meta, **attrs,
                                     rope_cos=cos, rope_sin=sin)
    y = gemv_rope_kv(x, w, cos, sin, pool, meta[3], num_heads=hq, num_kv_heads=hkv, head_dim=d)
    got, _ = paged_attention_triton(*_views(y, hq, hkv, d), pool, *meta, **attrs, kv_written=True)
    assert torch.equal(got, want) and torch.equal(pool, want_pool)
    q, k, v = _views(y, hq, hkv, d)
    # (a call without a PagedLaunchState plans nothing: the layout is checked on each)
    with pytest.raises(ValueError, match="head-major views of one fused Q/K/V row"):
        paged_attention_triton(q, v, k, pool, *meta, **attrs, kv_written=True)
    with pytest.raises(ValueError, match="already rotated"):
        paged_attention_triton(q, k, v, pool, *meta, **attrs, kv_written=True, rope_cos=cos, rope_sin=sin)


def test_default_config_keeps_the_grid_wide_and_the_tile_bounded() -> None:
    for m, k, n in [(1, 2048, 3072), (1, 8192, 2048), (4, 2048, 128256), (2, 576, 960), (1, 64, 8)]:
        block_n, block_k, warps = default_config(m, n, k)
        assert block_k <= 2048 and block_k >= min(k, 2048) // 2 and warps in (2, 4, 8)
        assert block_n * block_k * (1 << (m - 1).bit_length()) <= 8192
    assert default_config(1, 8192, 2048, silu_mul=True) == (2, 1024, 2)  # the sweep's best at one row
    assert default_config(1, 128256, 2048) == (2, 2048, 2) and default_config(2, 128256, 2048)[2] == 4


def test_kernels_refuse_what_they_cannot_do() -> None:
    x, w = _inputs(MAX_ROWS + 1, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="M <="):
        gemv_triton(x, w)
    with pytest.raises(ValueError, match="one float dtype"):
        gemv_triton(x[:2], w.half())
    with pytest.raises(ValueError, match="gate rows then as many up rows"):
        gemv_silu_mul(x[:2], w[:7])


def test_the_gemv_runs_where_it_was_measured_faster() -> None:
    assert gemv.use_gemv(1, 3072, 2048) and gemv.use_gemv(1, 128256, 2048) and gemv.use_gemv(1, 960, 576)
    assert not gemv.use_gemv(2, 3072, 2048) and not gemv.use_gemv(4, 2048, 8192)
    assert not gemv.use_gemv(1, 49152, 576)  # SmolLM2's LM head: cuBLAS is faster


def test_off_the_gemv_path_the_calls_are_the_linear_path_exactly() -> None:
    """CPU, fp32 (not a GEMV dtype) or more than one row: F.linear and the unfused three ops, bit for bit."""
    x, w = _inputs(MAX_ROWS + 2, 16, 12, torch.float32)
    for rows in (x, x[:1].cpu(), x[:2].half() if DEVICE.type == "cuda" else x[:1]):
        ww = w.to(rows.device, rows.dtype)
        assert torch.equal(gemv.projection(rows, ww), torch.nn.functional.linear(rows, ww))
        gate, up = torch.nn.functional.linear(rows, ww).split(6, dim=-1)
        assert torch.equal(gemv.projection_silu_mul(rows, ww, sizes=[6, 6], axis=-1), trtopt_ops.silu_mul(gate, up))


def _steps(ex: TorchExecutor, plan) -> list[torch.Tensor]:
    """A chunked prefill (27 rows), a decode step of two rows (both cuBLAS) and one of one row (the GEMVs when on)."""
    ex.allocate_kv_cache(16)
    source = BlockSource(16)
    seqs = [Seq(list(range(3, 3 + n))) for n in (20, 7)]
    outs = [ex.execute(make_step(seqs, [20, 7], plan.limits.block_size, source))]
    for seq in seqs:
        seq.tokens.append(5)
    outs.append(ex.execute(make_step(seqs, [1, 1], plan.limits.block_size, source)))
    seqs[1].tokens.append(9)
    outs.append(ex.execute(make_step(seqs[1:], [1], plan.limits.block_size, source)))
    return outs


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels on CPU tensors under the Triton interpreter; "
                    "on a GPU test_executor_gemv_path_on_gpu runs them")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_executor_rewrites_every_projection_and_keeps_the_logits(model: str, plan_dir, monkeypatch) -> None:
    """decode_gemv on a CPU plan, with the GEMV path forced on (the interpreter runs the kernels, fp32 allowed):
    every projection weight moves to [N, K], gate/up + SiLU·mul become one call, and the logits of a prefill step,
    a two-row step (F.linear) and a one-row step (the GEMVs) equal the unrewritten executor's within fp32 rounding."""
    built = plan_dir(model)
    plan = read_plan(built)
    layers = plan.model.num_layers
    want = _steps(TorchExecutor(built, plan, decode_gemv=False), plan)
    ex = TorchExecutor(built, plan, decode_gemv=True)
    assert ex.num_gemv_weights == 4 * layers + 1  # fused Q/K/V, O, fused gate/up, down per layer; the LM head
    targets = [n.target for n in ex.graph.module.graph.nodes if n.op == "call_function"]
    biased = layers if model == "tiny-qwen2" else 0  # Qwen2's Q/K/V has a bias: F.linear(x, w, b)
    assert targets.count(torch.nn.functional.linear) == biased
    # Q/K/V with RoPE and the KV write as one call (Qwen2's biased Q/K/V stays F.linear, the plain attention op)
    rope_kv = 0 if biased else layers
    assert ex.num_gemv_rope_kv == targets.count(gemv.projection_rope_kv) == rope_kv
    assert targets.count(gemv.projection) == 3 * layers + 1 - biased - rope_kv
    assert ex.num_gemv_silu_mul == layers
    assert torch.matmul not in targets and gemv.projection_silu_mul in targets
    calls = _force_gemv_path(monkeypatch)
    got = _steps(ex, plan)
    # The one-row step's projections (an LM head only if not wide and short: use_gemv) and gate/ups.
    gm = ex.graph.module
    shapes = [getattr(gm, n.args[1].target).shape for n in gm.graph.nodes if n.target is gemv.projection]
    assert calls.count("gemv") == sum(gemv.use_gemv(1, *shape) for shape in shapes) >= 2 * layers - biased + (
        layers - rope_kv)
    assert calls.count("gemv_silu_mul") == layers
    assert calls.count("gemv_rope_kv") == rope_kv
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.fixture(scope="module")
def fp8_plan(export_dir, tmp_path_factory):
    """The tiny Llama built with FP8 KV pools and calibrated-looking scales (not 1.0), the limits of `plan_dir`'s."""
    from trtopt.builder.pipeline import build_plan
    from trtopt.builder.plan import Limits

    limits = Limits(block_size=16, max_num_tokens=256, max_num_seqs=8, max_model_len=256)
    out = tmp_path_factory.mktemp("plan-tiny-llama-fp8-gemv")
    return build_plan(export_dir("tiny-llama"), out, limits=limits, force=True, progress=False,
                      kv_cache_dtype="fp8").plan_dir


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run; on a GPU "
                    "test_executor_gemv_path_on_fp8_pools_on_gpu runs it")
def test_an_fp8_plan_keeps_the_fused_qkv_rope_kv_write(fp8_plan, monkeypatch) -> None:
    """FP8 pools take the one-row decode path bf16 pools take: the Q/K/V GEMV rotates q and k and writes the pool
    in its epilogue (which quantizes with the attention node's scales). Sessions before 30 left it off for FP8 pools,
    one launch more per layer than bf16 at batch 1. The forced-on path (interpreter, fp32) leaves the pools byte for
    byte as the plain path does, and its logits within fp32 rounding. (The interpreter's fp32 → e4m3 cast rounds a
    few values wrongly, test_trt_plugin_paged_attention says which; none of this plan's do.)"""
    plan = read_plan(fp8_plan)
    layers = plan.model.num_layers
    base = TorchExecutor(fp8_plan, plan, decode_gemv=False)
    want = _steps(base, plan)
    ex = TorchExecutor(fp8_plan, plan, decode_gemv=True)
    assert ex.pool_dtype == FP8_POOL_DTYPE
    assert ex.num_gemv_rope_kv == layers
    calls = _force_gemv_path(monkeypatch)
    got = _steps(ex, plan)
    assert calls.count("gemv_rope_kv") == layers  # the one-row step, once per layer
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for pool, base_pool in zip(ex.kv_caches, base.kv_caches):
        assert torch.equal(pool.view(torch.uint8), base_pool.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
def test_executor_gemv_path_on_fp8_pools_on_gpu(fp8_plan, monkeypatch) -> None:
    """On CUDA an FP8 plan's one-row step writes its pool in the Q/K/V GEMV's epilogue: pools byte for byte those
    of the unfused path (its RoPE-fused write kernel), logits within fp32 rounding."""
    plan = read_plan(fp8_plan)
    base = TorchExecutor(fp8_plan, plan, device="cuda", decode_gemv=False)
    want = _steps(base, plan)
    monkeypatch.setattr(gemv, "GEMV_DTYPES", (torch.float32,))
    ex = TorchExecutor(fp8_plan, plan, device="cuda", decode_gemv=True)
    assert ex.num_gemv_rope_kv == plan.model.num_layers
    got = _steps(ex, plan)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for pool, base_pool in zip(ex.kv_caches, base.kv_caches):
        assert torch.equal(pool.view(torch.uint8), base_pool.view(torch.uint8))


def _force_gemv_path(monkeypatch) -> list[str]:
    """The executor's GEMV path taken on the CPU (the interpreter runs the kernels, fp32 allowed); returns the list
    its kernel entry points are recorded in, as they are called."""
    monkeypatch.setattr(gemv, "_on_gpu", lambda x: True)
    monkeypatch.setattr(gemv, "GEMV_DTYPES", (torch.float32,))
    calls: list[str] = []
    real = gemv._kernels()
    monkeypatch.setattr(gemv, "_kernels", lambda: _Counting(real, calls))
    return calls


class _Counting:
    """gemv_triton with its three entry points counted."""

    def __init__(self, kernels, calls: list[str]):
        self._k, self._calls = kernels, calls

    def gemv(self, *a):
        self._calls.append("gemv")
        return self._k.gemv(*a)

    def gemv_silu_mul(self, *a):
        self._calls.append("gemv_silu_mul")
        return self._k.gemv_silu_mul(*a)

    def gemv_rope_kv(self, *a, **kw):
        self._calls.append("gemv_rope_kv")
        return self._k.gemv_rope_kv(*a, **kw)

    def __getattr__(self, name: str):  # the rest (rope_kv_refusal) as is
        return getattr(self._k, name)


def test_decode_gemv_defaults_off_on_cpu_and_refuses_compile(plan_dir) -> None:
    built = plan_dir("tiny-llama")
    plan = read_plan(built)
    assert TorchExecutor(built, plan).num_gemv_weights == 0  # CPU: the plan as converted
    from trtopt.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot be combined"):
        TorchExecutor(built, plan, decode_gemv=True, compile_mode="default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_executor_gemv_path_on_gpu(model: str, plan_dir, monkeypatch) -> None:
    """On CUDA the one-row decode step runs the GEMV kernels (fp32 allowed for the check): its logits agree with
    the cuBLAS path."""
    built = plan_dir(model)
    plan = read_plan(built)
    want = _steps(TorchExecutor(built, plan, device="cuda", decode_gemv=False), plan)
    monkeypatch.setattr(gemv, "GEMV_DTYPES", (torch.float32,))
    got = _steps(TorchExecutor(built, plan, device="cuda", decode_gemv=True), plan)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
