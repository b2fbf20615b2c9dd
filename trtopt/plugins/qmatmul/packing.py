"""QMatMul's weights in the layout its decode GEMV reads (kernel.py), made once when a plan is loaded.

The plan holds w_q [K, N] (FP8 as float8_e4m3fn, INT4/UINT4 one int8/uint8 per value: onnx_to_torch.py) and its
scale / zero point [N] or [K/G, N]. A decode step reads every weight byte once for a few rows of x, so the GEMV wants
each output column's bytes contiguous and as few of them as there are bits:

- FP8: ``data`` [N, K] uint8, the float8e4nv bytes, K contiguous (nn.Linear's layout, as runtime/kernels/
  gemv_triton.py reads bf16 weights; viewed as float8_e4m3fn and transposed it is the column-major [K, N] that
  torch._scaled_mm takes, gemm.py); ``scale`` [N] fp32 (the plan's scale widened, exact: _scaled_mm's rowwise
  scale_b must be fp32; the GEMV reads it as fp32 either way). The rule guarantees an FP8 zero point of 0 (±0).
- INT4/UINT4: ``data`` [N, K/8] int32, eight values a word, **nibble planes**: within quantization group g of a
  column (G values, W = G/8 words), nibble p (bits 4p..4p+3) of word j holds value g·G + p·W + j, so each of the
  eight planes lines up with a contiguous run of x, and the kernel takes a value out with one shift and one mask.
  Values are stored offset binary (u = q + 8 for INT4, u = q for UINT4) with the zero point shifted alike
  (z' = z + 8 / z), so one kernel computes q − z = u − z' for both signednesses. ``scale`` [N, K/G] in the plan's
  dtype; ``zero`` [N, K/G] uint8 z', or None when every z' is one value (``zero_const``: 8 for symmetric INT4, 0
  for UINT4 without zero points), which the kernel then takes as a constant instead of loading.

The GEMMs for larger steps (gemm.py) read the same tensors, so a weight is stored once. `dequantize_packed` gives
back the reference's dequantized weight (reference.py `dequantize_weight`) bit for bit, for steps no kernel takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SIGNED_OFFSET = 8  # INT4 -8..7 stored as 0..15


@dataclass(frozen=True)
class PackedQWeight:
    """One QMatMul weight in the GEMV's layout (module docstring); tensors on the plan's device."""

    data: torch.Tensor  # FP8: [N, K] uint8; INT4/UINT4: [N, K/8] int32, nibble planes, offset binary
    scale: torch.Tensor  # FP8: [N] fp32; INT4/UINT4: [N, K/G] in the plan's float dtype
    zero: torch.Tensor | None  # INT4/UINT4: [N, K/G] uint8 z' (offset binary), or None: every z' is zero_const
    zero_const: int  # z' for every group when zero is None (unused for FP8)
    k: int
    n: int
    group: int  # G for INT4/UINT4; 0 for FP8 (one scale per output column)

    @property
    def fp8(self) -> bool:
        return self.group == 0

    @property
    def nbytes(self) -> int:
        """Bytes a GEMV reads per call (weights, scales, zero points): what bandwidth is measured against."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero) if t is not None)


def packable(w_q: torch.Tensor, w_scale: torch.Tensor, *, block_size: int) -> bool:
    """Whether `pack_weight` takes this weight: 2-D FP8 per output column, or INT4/UINT4 blocked over K with a
    power-of-two block of at least 8 values (one word of each plane) dividing K."""
    if w_q.dim() != 2:
        return False
    k, n = w_q.shape
    if w_q.dtype == torch.float8_e4m3fn:
        return block_size == 0 and tuple(w_scale.shape) == (n,)
    return (w_q.dtype in (torch.int8, torch.uint8) and block_size >= 8 and block_size & (block_size - 1) == 0
            and k % block_size == 0 and tuple(w_scale.shape) == (k // block_size, n))


def pack_weight(w_q: torch.Tensor, w_scale: torch.Tensor, w_zero_point: torch.Tensor, *,
                block_size: int) -> PackedQWeight:
    """w_q [K, N] with its scale and zero point as the plan holds them → the GEMV's layout (module docstring).
    The caller checks `packable` first. int8 w_q is INT4 (-8..7), uint8 is UINT4 (0..15)."""
    assert packable(w_q, w_scale, block_size=block_size), (w_q.dtype, tuple(w_q.shape), block_size)
    k, n = w_q.shape
    if w_q.dtype == torch.float8_e4m3fn:
        assert not w_zero_point.float().any(), "FP8 zero points are 0 (fusion_passes/qmatmul.py refuses others)"
        return PackedQWeight(w_q.view(torch.uint8).t().contiguous(), w_scale.float().contiguous(), None, 0, k, n, 0)
    g = block_size
    offset = SIGNED_OFFSET if w_q.dtype == torch.int8 else 0
    u = (w_q.to(torch.int64) + offset).t().reshape(n, k // g, 8, g // 8)  # [N, K/G, plane p, word j]
    shifts = (4 * torch.arange(8, dtype=torch.int64, device=u.device)).reshape(1, 1, 8, 1)
    data = (u << shifts).sum(dim=2)  # disjoint bits: the sum is the OR, 0..2³²-1, stored as int32's bits
    data = torch.where(data >= 2 ** 31, data - 2 ** 32, data).to(torch.int32).reshape(n, k // 8).contiguous()
    z = (w_zero_point.to(torch.int16) + offset).to(torch.uint8).t().contiguous()  # [N, K/G]
    first = int(z.reshape(-1)[0]) if z.numel() else offset
    uniform = bool((z == first).all())
    return PackedQWeight(data, w_scale.t().contiguous(), None if uniform else z, first if uniform else 0, k, n, g)


def dequantize_packed(p: PackedQWeight) -> torch.Tensor:
    """fp32 [K, N]: reference.py's `dequantize_weight` of the weight `p` was packed from, the same values."""
    if p.fp8:
        return p.data.view(torch.float8_e4m3fn).float().t() * p.scale.float()
    g = p.group
    words = p.data.reshape(p.n, p.k // g, 1, g // 8)
    shifts = (4 * torch.arange(8, dtype=torch.int32, device=words.device)).reshape(1, 1, 8, 1)
    u = ((words >> shifts) & 15).reshape(p.n, p.k // g, g)  # [N, K/G, G]: plane by plane, as packed
    z = p.zero if p.zero is not None else torch.full((), p.zero_const, dtype=torch.uint8, device=words.device)
    w = (u.float() - z.float().reshape(*z.shape, 1)) * p.scale.float().reshape(p.n, p.k // g, 1)
    return w.reshape(p.n, p.k).t()
