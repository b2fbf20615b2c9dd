"""PagedAttention, the KV write and copy_blocks as Triton kernels (face 4 of docs/architecture.md §4): the op's
public launchers, one module per kernel behind them.

- write_kv.py: the KV write, and the RoPE of q and k folded into it (`write_kv_triton`, `rope_write_kv_triton`);
- attention.py: the attention kernel, its split-KV merge and the op's launcher (`paged_attention_triton`);
- planning.py: the tiling of a step from its shapes (`plan_paged_launch`) and what the launches keep between calls
  (`PagedLaunchState`, owned by the torch executor and passed to each call);
- copy_blocks.py: the copy-on-write of KV blocks over every layer's pool (`copy_blocks_triton`).

The torch executor finds `paged_attention_triton` here by name (trtopt_ops.py `_impl`).
"""

from __future__ import annotations

from trtopt.plugins.paged_attention.attention import paged_attention_triton
from trtopt.plugins.paged_attention.copy_blocks import copy_blocks_triton
from trtopt.plugins.paged_attention.planning import PagedLaunch, PagedLaunchState, plan_paged_launch
from trtopt.plugins.paged_attention.write_kv import rope_write_kv_triton, write_kv_triton

__all__ = ["PagedLaunch", "PagedLaunchState", "plan_paged_launch", "paged_attention_triton", "write_kv_triton",
           "rope_write_kv_triton", "copy_blocks_triton"]
