"""Engine configuration: the runtime knobs, the limits they resolve to against a plan, and start-up defaults."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trtopt.builder.plan import PlanConfig, read_plan
from trtopt.errors import BuildError, ConfigError
from trtopt.runtime.sampling_params import DEFAULT_MAX_LOGPROBS
from trtopt.signature import FP8_KV_DTYPE

if TYPE_CHECKING:
    from trtopt.runtime.spec_decode import SpeculativeConfig

log = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, FP8_KV_DTYPE: 1}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Runtime knobs. None = take the plan's limit. Frozen: derived values are returned, never written back."""

    num_blocks: int | None = None  # KV blocks per layer incl. the null block; None = from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0  # used when num_blocks is None
    max_num_batched_tokens: int | None = None  # token budget per step (<= plan max_num_tokens)
    max_num_seqs: int | None = None  # sequences per step (<= plan max_num_seqs)
    max_model_len: int | None = None  # prompt + output tokens (<= plan max_model_len)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int | None = None  # seeds draws of requests that have no seed of their own
    # Speculative decoding: a dict like {"method": "ngram", "num_speculative_tokens": 4} (vLLM's keys), its JSON
    # text, or a SpeculativeConfig; None = off. See runtime/spec_decode.
    speculative_config: Any = None
    # Async scheduling: schedule and launch step N+1 before step N's tokens reach the host (one step in flight).
    # None = on for a CUDA device, off on CPU (nothing runs meanwhile there). Speculative decoding steps stay
    # synchronous (the proposer needs the tokens).
    async_scheduling: bool | None = None
    # The most logprobs / prompt_logprobs alternatives a request may ask for per token (vLLM's --max-logprobs and
    # default); -1 = no cap (the whole vocabulary, which a request asks for with -1).
    max_logprobs: int = DEFAULT_MAX_LOGPROBS


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """Where this process sits when a tensor-parallel group spans hosts: torchrun's launch flags, the same on every
    node but node_rank (docs/architecture.md §7b). Node 0 runs the driver and its ranks 0 .. size/nnodes - 1; node
    R > 0 runs ranks R*size/nnodes .. (R+1)*size/nnodes - 1 only, until the driver stops them."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # node 0's address as every node reaches it (the group's TCPStore lives there)
    master_port: int | None = None  # a free TCP port on node 0 for that store

    def __post_init__(self) -> None:
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ConfigError(f"nnodes must be a positive integer, got {self.nnodes!r}.")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank={self.node_rank!r} must be in [0, {self.nnodes - 1}] with "
                              f"nnodes={self.nnodes}; node 0 runs the driver.")
        if self.nnodes > 1 and not self.master_addr:
            raise ConfigError(f"nnodes={self.nnodes} needs master_addr (--master-addr): node 0's address, reachable "
                              "from every node.")
        if self.nnodes > 1 and (not isinstance(self.master_port, int) or not 1 <= self.master_port <= 65535):
            raise ConfigError(f"nnodes={self.nnodes} needs master_port (--master-port): a free TCP port on node 0 in "
                              f"[1, 65535], got {self.master_port!r}.")

    def ranks_per_node(self, size: int) -> int:
        """Ranks each node runs for a group of ``size``; ConfigError when they do not split evenly."""
        if size % self.nnodes:
            raise ConfigError(f"tensor_parallel_size={size} does not split evenly over nnodes={self.nnodes}: every "
                              "node runs tensor_parallel_size / nnodes ranks (e.g. 4 ranks over 2 nodes).")
        return size // self.nnodes


@dataclasses.dataclass(frozen=True)
class ResolvedLimits:
    """EngineConfig merged with the plan's limits and checked."""

    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    max_blocks_per_seq: int


def block_bytes(plan: PlanConfig, block_size: int | None = None) -> int:
    """Bytes one KV block takes across every layer of `plan` (K and V), in the pools' dtype (plan.kv_pool_dtype:
    an FP8 plan's block takes half a bf16 plan's, so the same kv_cache_memory_gb holds twice the blocks)."""
    m = plan.model
    block_size = block_size or plan.limits.block_size
    return m.num_layers * 2 * m.num_kv_heads * block_size * m.head_dim * _DTYPE_BYTES.get(plan.kv_pool_dtype, 4)


def draft_plan_block_bytes(spec: SpeculativeConfig | None, plan: PlanConfig) -> int:
    """Per-block bytes of a draft plan's own pools (method draft_model); 0 for n-gram and self-draft (which runs on
    the target's pools), and for a draft plan that cannot be read (create_spec_decoder then says what is wrong)."""
    if spec is None or spec.method != "draft_model" or not (Path(spec.model) / "plan.json").is_file():
        return 0
    try:
        return block_bytes(read_plan(spec.model), plan.limits.block_size)
    except BuildError:
        return 0


def resolve_limits(plan: PlanConfig, config: EngineConfig, draft_block_bytes: int = 0) -> ResolvedLimits:
    """draft_block_bytes: what one block of a speculative draft's own pools takes (0 without one). The draft's pools
    have the target's block count (the same block ids), so kv_cache_memory_gb holds both: num_blocks comes from
    the sum of the two per-block sizes, and the memory splits between them in that proportion."""
    lim = plan.limits

    def capped(name: str, value: int | None, plan_max: int) -> int:
        if value is None:
            return plan_max
        if not 1 <= value <= plan_max:
            raise ConfigError(
                f"{name}={value} must be in [1, {plan_max}] (the plan's limit); rebuild the plan to raise it.")
        return value

    max_model_len = capped("max_model_len", config.max_model_len, lim.max_model_len)
    max_num_seqs = capped("max_num_seqs", config.max_num_seqs, lim.max_num_seqs)
    max_tokens = capped("max_num_batched_tokens", config.max_num_batched_tokens, lim.max_num_tokens)
    max_blocks_per_seq = -(-max_model_len // lim.block_size)
    num_blocks = config.num_blocks
    if num_blocks is None:
        per_block = block_bytes(plan) + draft_block_bytes
        # More blocks than every sequence at full length can use would only waste memory.
        num_blocks = min(int(config.kv_cache_memory_gb * 2**30) // per_block, max_num_seqs * max_blocks_per_seq) + 1
    if num_blocks - 1 < max_blocks_per_seq:
        raise ConfigError(
            f"{num_blocks - 1} usable KV blocks cannot hold one sequence of max_model_len={max_model_len} "
            f"({max_blocks_per_seq} blocks of {lim.block_size}); raise num_blocks/kv_cache_memory_gb or lower "
            "max_model_len."
        )
    return ResolvedLimits(num_blocks, lim.block_size, max_tokens, max_num_seqs, max_model_len, max_blocks_per_seq)


def resolve_max_logprobs(max_logprobs: int, vocab_size: int) -> int:
    """EngineConfig.max_logprobs as a count (-1: the vocabulary); ConfigError for a value below -1."""
    if not isinstance(max_logprobs, int) or isinstance(max_logprobs, bool) or max_logprobs < -1:
        raise ConfigError(f"max_logprobs={max_logprobs!r} must be -1 (no cap: the whole vocabulary) or an integer "
                          ">= 0 (vLLM's default is 20).")
    return vocab_size if max_logprobs == -1 else max_logprobs


def default_async_scheduling(device: str) -> bool:
    """Async scheduling pays off where the host can work while the device runs: a CUDA device."""
    return str(device).startswith("cuda")


def resolve_async_scheduling(wanted: bool | None, device: str, *, speculative: bool) -> bool:
    """EngineConfig.async_scheduling (None = default_async_scheduling(device)); off with speculative decoding."""
    if wanted is None:
        wanted = default_async_scheduling(device)
    if wanted and speculative:
        log.info("async scheduling is off with speculative decoding: its proposer needs each step's tokens")
        return False
    return bool(wanted)


def default_cuda_graphs(backend: str, device: str) -> bool:
    """Decode steps replay CUDA graphs by default where they can: the torch backend on a CUDA device."""
    return backend == "torch" and str(device).startswith("cuda")


def load_tokenizer(plan_dir: str | Path) -> Any:
    """The plan's HF tokenizer, or None when the plan dir has no tokenizer files."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(plan_dir))
    except (OSError, ValueError) as e:
        log.warning("no tokenizer in %s (%s); only token-id prompts will work", plan_dir, e)
        return None
