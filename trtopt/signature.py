"""The paged signature (architecture.md §3): the I/O of a built LLM graph, defined once.

Every module that names, shapes or types these tensors imports them from here: the fusion pass that writes the
signature (fusion_passes/paged_attention.py, logits_gather.py), the build's check of it (builder/signature.py), the
engine build's optimization profile (builder/trt_engine.py) and every executor (runtime/executors/). The per-step
attention metadata that all layers share is vLLM's ``CommonAttentionMetadata``; a new per-step input (speculative
decoding, tensor parallelism) is added here, once. This module imports nothing, so every layer of the package can
use it without an upward arrow.

Dims are symbolic: T tokens this step, S sequences, N rows projected to logits, ``max_blocks`` blocks per sequence
(the block-table width), ``num_blocks`` the pool's blocks. Dtypes are numpy names; the KV pools and their outputs
have the plan's pool dtype (``kv_pool_dtype``): the model's dtype, or float8_e4m3fn for a plan built with
``--kv-cache-dtype fp8`` (architecture.md §3).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

Dim = int | str


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of the signature: its graph name, numpy dtype name and (symbolic) dims."""

    name: str
    dtype: str
    dims: tuple[Dim, ...]

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The concrete shape once every symbolic dim has a size."""
        return resolve_dims(self.dims, sizes)


def resolve_dims(dims: tuple[Dim, ...], sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Concrete dims: each symbolic one looked up in ``sizes`` (KeyError names a missing one)."""
    return tuple(d if isinstance(d, int) else sizes[d] for d in dims)


INPUT_IDS = TensorSpec("input_ids", "int64", (1, "T"))
POSITION_IDS = TensorSpec("position_ids", "int64", (1, "T"))
BLOCK_TABLES = TensorSpec("block_tables", "int32", ("S", "max_blocks"))  # padded with 0, the null block
SEQ_LENS = TensorSpec("seq_lens", "int32", ("S",))  # tokens in the cache after this step
QUERY_START_LOC = TensorSpec("query_start_loc", "int32", ("S_plus_1",))  # cumulative new-token counts
SLOT_MAPPING = TensorSpec("slot_mapping", "int64", ("T",))  # -1 = do not write
LOGITS_INDICES = TensorSpec("logits_indices", "int64", ("N",))
LOGITS = TensorSpec("logits", "float32", ("N", "vocab"))

# Inputs whose every value is >= 0 in each step the runtime feeds (token ids once async scheduling's placeholders
# are filled, positions, logits rows); an executor may index with them without ONNX's negative-index wrap.
NONNEGATIVE_INPUTS = frozenset(spec.name for spec in (INPUT_IDS, POSITION_IDS, LOGITS_INDICES))

# The per-step attention metadata every PagedAttention node reads, in the op's input order.
ATTENTION_METADATA = (BLOCK_TABLES, SEQ_LENS, QUERY_START_LOC, SLOT_MAPPING)
# Every per-step input, in graph order around the pools; runtime.batch.StepInputs has one field per name.
TOKEN_INPUTS = (INPUT_IDS, POSITION_IDS)
STEP_INPUTS = (*TOKEN_INPUTS, *ATTENTION_METADATA, LOGITS_INDICES)
STEP_INPUT_NAMES = tuple(spec.name for spec in STEP_INPUTS)

_KV_INPUT_PREFIX = "kv_cache."
_KV_OUTPUT_PREFIX = "kv_cache_out."


def kv_input(layer: int) -> str:
    """The name of layer ``layer``'s pool input."""
    return f"{_KV_INPUT_PREFIX}{layer}"


def kv_output(layer: int) -> str:
    """The name of layer ``layer``'s pool output (the same buffer after the write)."""
    return f"{_KV_OUTPUT_PREFIX}{layer}"


def is_kv_input(name: str) -> bool:
    return name.startswith(_KV_INPUT_PREFIX)


def is_kv_output(name: str) -> bool:
    return name.startswith(_KV_OUTPUT_PREFIX)


def kv_dims(num_blocks: Dim, num_kv_heads: int, block_size: int, head_dim: int) -> tuple[Dim, ...]:
    """A pool's dims: [num_blocks, 2 (K, V), Hkv, block_size, D], heads-major inside a block; block 0 is null."""
    return (num_blocks, 2, num_kv_heads, block_size, head_dim)


# `trtopt build --kv-cache-dtype`: "auto" keeps the model's dtype in the pools; "fp8" stores K and V as float8 E4M3
# (e4m3fn: no infinities, finite range ±448), quantized on the write (x / scale, saturated, rounded to nearest even)
# and dequantized on the read (× scale), with one float32 K and one V scale per layer (1.0 without calibration).
KV_CACHE_DTYPES = ("auto", "fp8")
FP8_KV_DTYPE = "float8_e4m3fn"  # the pool dtype of an "fp8" plan (torch.float8_e4m3fn, ONNX FLOAT8E4M3FN)
FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn; the write saturates to ±this
# `trtopt build --kv-cache-rotation` (with --kv-cache-dtype fp8 only): "hadamard" rotates q and k by one orthonormal
# Hadamard matrix before each PagedAttention (fusion_passes/kv_rotation.py), so the pools hold k·H, not k;
# "hadamard_kv" also v (the pools hold v·H, the output is multiplied by H after attention).
KV_CACHE_ROTATIONS = ("none", "hadamard", "hadamard_kv")
# `trtopt build --kv-cache-smoothing` (with --kv-cache-dtype fp8 only): "k" subtracts a calibrated per-layer mean from
# the keys before each PagedAttention, "kv" from the values too and adds it back to the output
# (fusion_passes/kv_smoothing.py), so the pools hold k - b_k (and v - b_v).
KV_CACHE_SMOOTHINGS = ("none", "k", "kv")
# `trtopt build --kv-cache-scales` (with --kv-cache-dtype fp8 only): "one" gives every layer K and V scales of 1.0;
# "amax" calibrates them on the final plan graph (after smoothing and rotation): the layer's largest |k| (|v|) / 448;
# "amax_head" also multiplies each KV head's k (v) by a power of two that brings its amax within 2x of the layer's,
# exactly undone on q (the output) (fusion_passes/kv_head_scales.py): per-head scales without a kernel change;
# "search" picks each layer's K and V scale among 16 in [2, 4) x amax / 448 by the attention output's error on the
# calibration text (builder/kv_calibration.py); "quantizer" takes the per-layer scales `trtopt quantize --kv-cache fp8`
# calibrated on the float model and recorded in the source's metadata (quantize/api.py `kv_cache_scales`), the
# default where the source has them (and no smoothing or rotation changes what the pools hold).
KV_CACHE_SCALES = ("one", "amax", "amax_head", "search", "quantizer")
KV_CACHE_SCALES_AUTO = "auto"  # build_plan's default: "quantizer" where the source has the scales, else "one"


def kv_pool_dtype(model_dtype: str, kv_cache_dtype: str) -> str:
    """The pools' dtype name for a plan of ``model_dtype`` built with ``--kv-cache-dtype kv_cache_dtype``."""
    assert kv_cache_dtype in KV_CACHE_DTYPES, f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}"
    return FP8_KV_DTYPE if kv_cache_dtype == "fp8" else model_dtype


def input_names(num_layers: int) -> list[str]:
    """The graph's input names in order: tokens, one pool per layer, the attention metadata, logits_indices."""
    return [*(s.name for s in TOKEN_INPUTS), *(kv_input(i) for i in range(num_layers)),
            *(s.name for s in (*ATTENTION_METADATA, LOGITS_INDICES))]


def output_names(num_layers: int) -> list[str]:
    """The graph's output names in order: logits, then one pool per layer."""
    return [LOGITS.name, *(kv_output(i) for i in range(num_layers))]
