"""copy_blocks as a Triton kernel (face 4 of docs/architecture.md §4): the copy-on-write of KV blocks, every
layer's pool in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtopt.plugins import launcher
from trtopt.plugins.kernel_common import TL_DTYPES, next_pow2
from trtopt.plugins.paged_attention.reference import FP8_POOL_DTYPE

# An FP8 pool is copied as its bytes (not every torch index op takes float8, and a copy needs no arithmetic).
_COPY_DTYPES = {**TL_DTYPES, torch.uint8: tl.uint8}


@triton.jit
def _copy_blocks_kernel(PoolAddresses, Pairs, block_numel, DTYPE: tl.constexpr, CHUNK: tl.constexpr):
    """pool[dst] = pool[src] for one (pool, pair, chunk): every layer's pool is copied in a single launch."""
    pool = tl.load(PoolAddresses + tl.program_id(0)).to(tl.pointer_type(DTYPE))
    pair = tl.program_id(1)
    src = tl.load(Pairs + 2 * pair)
    dst = tl.load(Pairs + 2 * pair + 1)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    values = tl.load(pool + src * block_numel + offs, mask=mask)
    tl.store(pool + dst * block_numel + offs, values, mask=mask)


def copy_blocks_triton(kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
    """For every pool and every (src, dst) row of pairs (int64 [P, 2]): pool[dst] = pool[src], in place.

    On CUDA one kernel copies every layer (a per-layer torch gather/scatter costs two launches per layer, which
    dominates at copy-on-write sizes). The copies run in parallel, so no destination may also be a source: the
    block manager's copy-on-write guarantees it (a fresh block is the destination), and pairs on the host are
    checked; pairs that break it, and CPU pools, take the sequential torch path.
    """
    if pairs.dim() != 2 or pairs.shape[1] != 2 or pairs.dtype != torch.int64:
        raise ValueError(f"pairs must be int64 [P, 2] (src, dst); got {pairs.dtype} {tuple(pairs.shape)}")
    if pairs.shape[0] == 0 or not kv_caches:
        return
    kv_caches = [c.view(torch.uint8) if c.dtype == FP8_POOL_DTYPE else c for c in kv_caches]
    first = kv_caches[0]
    uniform = all(c.shape == first.shape and c.dtype == first.dtype and c.device == first.device
                  and c.is_contiguous() for c in kv_caches)
    overlapping = pairs.device.type == "cpu" and bool(torch.isin(pairs[:, 1], pairs[:, 0]).any())
    if first.device.type != "cuda" or not uniform or overlapping or first.dtype not in _COPY_DTYPES:
        for cache in kv_caches:
            idx = pairs.to(cache.device)
            # index_select copies the sources first, so a block that is also a destination is read before it is
            # overwritten.
            cache.index_copy_(0, idx[:, 1], cache.index_select(0, idx[:, 0]))
        return
    addresses = torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64).to(first.device,
                                                                                     non_blocking=True)
    block_numel = first[0].numel()
    chunk = min(4096, next_pow2(block_numel))
    grid = (len(kv_caches), pairs.shape[0], -(-block_numel // chunk))
    launcher.launch(_copy_blocks_kernel, grid, addresses, pairs.to(first.device).contiguous(), block_numel,
                    DTYPE=_COPY_DTYPES[first.dtype], CHUNK=chunk, num_warps=4)

