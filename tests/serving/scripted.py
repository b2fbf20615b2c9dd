"""A model-free engine for serving tests: an executor that says a scripted reply in SmolLM2's tokens, under a real
LLMEngine (scheduler, sampler, detokenizer), so the server's parsers see exactly the text a model would stream."""

from __future__ import annotations

import torch

from trtopt.builder.plan import Limits, ModelFacts, PlanConfig
from trtopt.runtime.config import EngineConfig
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.executors.base import Executor

VOCAB = 49152  # SmolLM2's
EOS = 2  # SmolLM2's <|im_end|>


class ModelFreeExecutor(Executor):
    """No model and no KV cache: each logits row is one-hot on the token `next_ids` picks for its last position."""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass  # no pools: nothing is cached

    def copy_blocks(self, pairs) -> None:
        pass  # no pools: nothing to copy

    def next_ids(self, positions: list[int]) -> list[int]:
        raise NotImplementedError

    def execute(self, step) -> torch.Tensor:
        positions = step.position_ids[0, step.logits_indices].tolist()  # [N]: each row's last position
        logits = torch.full((len(positions), VOCAB), -1e4)  # [N, vocab]
        logits[torch.arange(len(positions)), torch.tensor(self.next_ids(positions), dtype=torch.int64)] = 0.0
        return logits


class ScriptedExecutor(ModelFreeExecutor):
    """Says `script` (token ids), then EOS, after a prompt of `prompt_len` tokens: the logits row at position p
    picks script[p + 1 - prompt_len] (EOS past its end). prompt_len is set by the caller, or learnt from the first
    step after say() (the prefill of the next request). Every request gets the same reply, so n > 1 and concurrent
    requests of one prompt length work."""

    def __init__(self) -> None:
        self.script: list[int] = []
        self.prompt_len: int | None = None

    def say(self, token_ids: list[int], prompt_len: int | None = None) -> None:
        """The reply from now on; prompt_len None: learnt from the next request's prefill."""
        self.script, self.prompt_len = list(token_ids), prompt_len

    def next_ids(self, positions: list[int]) -> list[int]:
        if self.prompt_len is None and positions:
            self.prompt_len = positions[-1] + 1
        return [self.script[k] if 0 <= (k := p + 1 - self.prompt_len) < len(self.script) else EOS
                for p in positions]


def scripted_engine(executor: ScriptedExecutor, tokenizer, *, max_model_len: int = 512, max_num_seqs: int = 8,
                    num_blocks: int = 256, **config) -> LLMEngine:
    """An LLMEngine over `executor` with SmolLM2's vocabulary and EOS (config: more EngineConfig fields)."""
    plan = PlanConfig(
        model=ModelFacts(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, vocab_size=VOCAB, dtype="float32",
                         eos_token_ids=(EOS,)),
        limits=Limits(block_size=4, max_num_tokens=max_model_len, max_num_seqs=max_num_seqs,
                      max_model_len=max_model_len),
    )
    return LLMEngine(executor, plan, tokenizer, EngineConfig(num_blocks=num_blocks, **config))
