"""A paged "echo" model for scheduler/engine unit tests (no weights, no ONNX).

Its KV cache stores token ids at their slots. The logits of a row are a pseudo-random function of the
*whole* sequence it reads back through block_tables, so any bug in slot mapping, block tables, prefix
caching, copy-on-write or preemption changes the tokens generated. `reference_generate` computes the
same function on plain token lists: the engine must match it token for token.
"""

from __future__ import annotations

import collections
import random
from typing import TYPE_CHECKING

import torch

from trtopt.builder.plan import Limits, ModelFacts, PlanConfig
from trtopt.runtime.batch import StepInputs
from trtopt.runtime.executors.base import Executor

if TYPE_CHECKING:
    from trtopt.runtime.engine import LLMEngine

VOCAB = 97
EOS = 1


def make_plan(*, block_size: int = 4, max_num_tokens: int = 64, max_num_seqs: int = 8, max_model_len: int = 64) -> PlanConfig:
    return PlanConfig(
        model=ModelFacts(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, vocab_size=VOCAB, dtype="float32", eos_token_ids=(EOS,)),
        limits=Limits(block_size=block_size, max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len),
    )


def next_logits(tokens: list[int]) -> torch.Tensor:
    """The model: logits [VOCAB] that depend on every token of the sequence."""
    g = torch.Generator().manual_seed(hash(tuple(tokens)) & 0xFFFFFFFF)
    return torch.randn(VOCAB, generator=g) * 4


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[list[int]]:
    """n seeded random prompts of lo..hi tokens from the echo vocabulary (ids 0 and 1 left out: 1 is EOS)."""
    rnd = random.Random(seed)
    return [[rnd.randint(2, VOCAB - 1) for _ in range(rnd.randint(lo, hi))] for _ in range(n)]


def reference_generate(prompt: list[int], max_tokens: int, *, eos: int | None = EOS) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        t = int(next_logits(tokens).argmax())
        out.append(t)
        tokens.append(t)
        if t == eos:
            break
    return out


class EchoExecutor(Executor):
    """The Executor contract on the echo model (its capabilities the base's defaults), checking the §3 invariants as
    it goes."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.steps: list[StepInputs] = []
        self.copies: list[tuple[int, int]] = []
        self.fail_next = False

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.cache = torch.full((num_blocks * self.block_size,), -1, dtype=torch.int64)  # slot -> token id

    def copy_blocks(self, pairs) -> None:
        bs = self.block_size
        for src, dst in pairs:
            assert src != 0 and dst != 0, "copy_blocks touched the null block"
            self.cache[dst * bs : (dst + 1) * bs] = self.cache[src * bs : (src + 1) * bs]
            self.copies.append((src, dst))

    def execute(self, step: StepInputs) -> torch.Tensor:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected executor failure")
        self.steps.append(step)
        bs = self.block_size
        slots = step.slot_mapping
        assert (slots >= bs).all(), "a token was written into the null block"
        assert len(set(slots.tolist())) == slots.numel(), "two tokens share a slot"
        self.cache[slots] = step.input_ids[0]
        qsl = step.query_start_loc.tolist()
        rows = []
        for r in step.logits_indices.tolist():
            s = next(i for i in range(len(qsl) - 1) if qsl[i] <= r < qsl[i + 1])
            pos = int(step.position_ids[0, r])
            assert pos == int(step.seq_lens[s]) - (qsl[s + 1] - r), "position_ids disagree with seq_lens/query_start_loc"
            table = step.block_tables[s].tolist()
            seq = [int(self.cache[table[p // bs] * bs + p % bs]) for p in range(pos + 1)]
            assert -1 not in seq, "read a slot that was never written"
            rows.append(next_logits(seq))
        return torch.stack(rows)  # [N, VOCAB]


# ---- what every engine fault test checks and injects ----------------------------------------------------------


def poison(engine: LLMEngine, request_id: str, **fields) -> None:
    """Set sampling fields of a queued request past validation: a value that slipped through the edge (say
    top_k=2**63, which no int64 tensor holds) must still hurt no one else."""
    for seq in engine.output_processor.groups[request_id].seqs:
        for k, v in fields.items():
            object.__setattr__(seq.params, k, v)
        # As if the params had been made with these values: drop what was derived (and cached) from the old ones.
        seq.params.__dict__.pop("plain_greedy", None)


def check_engine(engine: LLMEngine) -> None:
    """The engine's bookkeeping agrees with itself: every block's ref count equals its holders, every open sequence
    sits in exactly one place, no finished sequence holds blocks, and an idle engine has every usable block free."""
    pool, sched = engine.pool, engine.scheduler
    pool.check_invariants()
    holders = engine.kv.holders()
    held = collections.Counter(b for table in holders.values() for b in table)
    assert [pool.ref_cnt[b] for b in range(1, pool.num_blocks)] == [held[b] for b in range(1, pool.num_blocks)]
    assert set(holders) <= set(sched.requests), f"finished sequences hold blocks: {set(holders) - set(sched.requests)}"
    pending = [s for r in sched.requests.values() for s in r.pending_forks]
    places = collections.Counter(r.request_id for r in (*sched.running, *sched.waiting, *pending))
    assert places == collections.Counter(set(sched.requests)), "a sequence is in no queue, or in two"
    open_seqs = {r.request_id for g in engine.output_processor.groups.values() for r in g.seqs if not r.status.finished}
    assert open_seqs == set(sched.requests), "engine groups and scheduler disagree on what is open"
    if not engine.has_unfinished_requests():
        assert not sched.requests and not holders and not sched.running and not sched.waiting
        assert pool.num_free_blocks == pool.num_usable_blocks, "blocks leaked"


class ExplodingDetokenizer:
    """A detokenizer that fails on its first update, as a tokenizer bug on one odd token would."""

    text = ""

    def update(self, _ids, *, stop_token: bool = False):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")

    def take_delta(self) -> str:
        return ""

    def finish(self) -> None:
        pass
