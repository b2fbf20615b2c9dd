"""The ONE ordered pass list (STYLE.md §8): ``optimize`` runs every rule and returns the counts."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from trtopt.fusion_passes.cleanup import cleanup
from trtopt.fusion_passes.context import HeadDims, PassContext
from trtopt.fusion_passes.flash_attention import fuse_flash_attention
from trtopt.fusion_passes.logits_gather import gather_logits
from trtopt.fusion_passes.paged_attention import fuse_paged_attention, has_cache_io
from trtopt.fusion_passes.trace import MatchFailure, Trace

# The passes a build may turn off (`trtopt build --disable-pass NAME`, for ablations): the performance fusions.
# Attention, the logits gather and cleanup make the plan's signature and are never optional.
OPTIONAL_PASSES = ("rope", "rope_table", "layer_norm", "rms_norm", "add_rms_norm", "horizontal_matmul", "silu_mul", "gelu_mul",
                   "matmul_add")


@dataclasses.dataclass(frozen=True)
class FusionReport:
    """What the pipeline did: per-pass counts in run order, the plan kind, and every region left unfused."""

    counts: dict[str, int]  # pass name → rewrites (for cleanup: nodes removed)
    kind: str  # "paged" (the graph had a KV cache) or "flash"
    unfused: tuple[MatchFailure, ...]

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "counts": dict(self.counts),
            "unfused": [dataclasses.asdict(f) for f in self.unfused],
        }


def optimize(
    model: ir.Model,
    *,
    dims: HeadDims = HeadDims(),
    block_size: int = 16,
    vocab_size: int | None = None,
    probe_len: int = 512,
    horizontal: bool = True,
    disable: frozenset[str] | tuple[str, ...] = (),
    max_positions: int | None = None,
) -> FusionReport:
    """Rewrite ``model`` in place into the plan graph; return the report.

    A graph with KV-cache I/O becomes the paged signature of docs/architecture.md §3 (or FusionError is raised); any
    other
    graph keeps its signature and gets FlashAttention. Passes named in ``disable`` (from OPTIONAL_PASSES; the
    caller checks the names) are skipped and count 0. ``max_positions`` (default ``probe_len``) sizes the rotary
    tables of the rope_table pass: the plan's max_model_len, which every position the runtime feeds is below.
    """
    from trtopt.fusion_passes.add_rms_norm import fuse_add_rms_norm
    from trtopt.fusion_passes.rope import fuse_rope
    from trtopt.fusion_passes.rope_table import tabulate_rope
    from trtopt.fusion_passes.gelu_mul import fuse_gelu_mul
    from trtopt.fusion_passes.silu_mul import fuse_silu_mul
    from trtopt.fusion_passes.horizontal_matmul import fuse_horizontal_matmul
    from trtopt.fusion_passes.layer_norm import fuse_layer_norm
    from trtopt.fusion_passes.matmul_add import fuse_matmul_add
    from trtopt.fusion_passes.qmatmul import fuse_qmatmul
    from trtopt.fusion_passes.rms_norm import fuse_rms_norm

    assert set(disable) <= set(OPTIONAL_PASSES), f"unknown passes {set(disable) - set(OPTIONAL_PASSES)}"
    on = set(OPTIONAL_PASSES) - set(disable)
    ctx = PassContext(trace=Trace(), dims=dims, probe_len=probe_len)
    counts: dict[str, int] = {}
    counts["cleanup"] = cleanup(model)
    paged = has_cache_io(model.graph)
    if paged:
        counts["paged_attention"] = fuse_paged_attention(model, ctx, block_size=block_size)
        counts["logits_gather"] = gather_logits(model, vocab_size=vocab_size)
    else:
        counts["flash_attention"] = fuse_flash_attention(model, ctx)
    # After attention: the paged rewrite's proofs walk the exported RoPE ops.
    counts["rope"] = fuse_rope(model, ctx.trace) if "rope" in on else 0
    # After rope: the tables are the cos/sin the Rope ops read (paged plans only: they have position_ids).
    counts["rope_table"] = (tabulate_rope(model, ctx.trace, max_positions=max_positions or probe_len)
                            if paged and "rope_table" in on else 0)
    # Norms and MatMul+Add run after attention: the QKᵀ MatMul + mask Add must not be taken for a biased MatMul.
    counts["layer_norm"] = fuse_layer_norm(model) if "layer_norm" in on else 0
    counts["rms_norm"] = fuse_rms_norm(model) if "rms_norm" in on else 0
    counts["add_rms_norm"] = fuse_add_rms_norm(model, ctx.trace) if "add_rms_norm" in on else 0
    # Q/DQ projections → QMatMul (0 on unquantized graphs), before the rules that read MatMuls with constant weights:
    # horizontal_matmul joins QMatMuls too, matmul_add leaves them alone.
    counts["qmatmul"] = fuse_qmatmul(model, ctx.trace)
    # Before matmul_add, so that a group's concatenated bias becomes one MatMulAdd.
    # Off for tensor-parallel builds (horizontal=False): the sharding analysis (builder/sharding/) finds Q/K/V and
    # gate/up as separate projections, and the build runs this rule on the rank graph after sharding instead.
    counts["horizontal_matmul"] = (fuse_horizontal_matmul(model, ctx.trace)
                                   if horizontal and "horizontal_matmul" in on else 0)
    counts["silu_mul"] = fuse_silu_mul(model, ctx.trace) if "silu_mul" in on else 0
    counts["gelu_mul"] = fuse_gelu_mul(model, ctx.trace) if "gelu_mul" in on else 0
    counts["matmul_add"] = fuse_matmul_add(model) if "matmul_add" in on else 0
    counts["cleanup"] += cleanup(model)
    return FusionReport(counts=counts, kind="paged" if paged else "flash", unfused=tuple(ctx.trace.failures))
