"""What every rule may read while it runs: the pass context, built once by the pipeline."""

from __future__ import annotations

import dataclasses

from trtopt.fusion_passes.trace import Trace


@dataclasses.dataclass(frozen=True)
class HeadDims:
    """Attention sizes from config.json (None where the config does not say; the graph is checked against them)."""

    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None


@dataclasses.dataclass(frozen=True)
class PassContext:
    """Plain values the rules need; the trace is the one mutable collector of match failures."""

    trace: Trace
    dims: HeadDims = HeadDims()
    probe_len: int = 512  # longest (past + new) length the mask probe tries; bounds sliding-window detection
