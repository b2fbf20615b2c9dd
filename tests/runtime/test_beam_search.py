"""Beam search (runtime/beam_search.py) over a real LLMEngine: hand-checked answers on a fixed probability table
where greedy and beam search disagree, EOS and length_penalty, the echo model against a plain-Python beam search,
no leaked blocks, the limits; and LLM.beam_search on built plans (width 1 with ignore_eos is greedy)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from echo_model import EOS, VOCAB, check_engine, make_plan, next_logits, prompts
from trtopt.errors import RequestError
from trtopt.runtime.beam_search import BeamSearch, BeamSearchParams, run_beam_search
from trtopt.runtime.config import EngineConfig
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.executors.base import Executor
from trtopt.runtime.sampling_params import SamplingParams

P = 5  # the prompt
A, B, C, X, Y, Z, W, V = 10, 11, 12, 20, 21, 22, 23, 24

# Next-token probabilities by the whole sequence; any other sequence says EOS. Greedy: A (.5) then Z (.4) = .20;
# width 2 keeps B (.4) beside A and finds B W = .4 * .9 = .36.
PAIRS = {(P,): {A: 0.5, B: 0.4, C: 0.1}, (P, A): {X: 0.3, Y: 0.3, Z: 0.4}, (P, B): {W: 0.9, V: 0.1},
         (P, C): {W: 1.0}}
# With EOS. Round 1: EOS (.2) ends [EOS]; A (.5), B (.3) live. Round 2: A EOS (.3) and B EOS (.03) end; B Y (.27),
# A X (.2) live. Round 3: B Y Z (.27), A X Z (.2). Scores cum / len ** lp, len = prompt + output without a last EOS:
# lp=1: B Y Z log(.27)/4 = -0.327 > A X Z log(.2)/4 = -0.402 > A EOS log(.3)/2 = -0.602; lp=0: A EOS (.3) > B Y Z.
ENDINGS = {(P,): {A: 0.5, B: 0.3, EOS: 0.2}, (P, A): {EOS: 0.6, X: 0.4}, (P, B): {Y: 0.9, EOS: 0.1},
           (P, A, X): {Z: 1.0}, (P, B, Y): {Z: 1.0}}


def table_logits(table: dict[tuple[int, ...], dict[int, float]]):
    """A model that says table[sequence] (log-probabilities; every other token -1e4, probability 0 in float32)."""
    def logits(seq: list[int]) -> torch.Tensor:
        row = torch.full((VOCAB,), -1e4)
        for token, p in table.get(tuple(seq), {EOS: 1.0}).items():
            row[token] = math.log(p)
        return row
    return logits


class SequenceExecutor(Executor):
    """Logits as a function of the whole sequence, read back through the block tables from a token-id KV cache
    (as tests/runtime/echo_model.py's EchoExecutor), so prefix caching and block reuse are on the path."""

    def __init__(self, logits, block_size: int = 4) -> None:
        self.logits, self.block_size = logits, block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.cache = torch.full((num_blocks * self.block_size,), -1, dtype=torch.int64)  # slot -> token id

    def copy_blocks(self, pairs) -> None:
        bs = self.block_size
        for src, dst in pairs:
            self.cache[dst * bs:(dst + 1) * bs] = self.cache[src * bs:(src + 1) * bs]

    def execute(self, step) -> torch.Tensor:
        bs = self.block_size
        self.cache[step.slot_mapping] = step.input_ids[0]
        qsl = step.query_start_loc.tolist()
        rows = []
        for r in step.logits_indices.tolist():
            s = next(i for i in range(len(qsl) - 1) if qsl[i] <= r < qsl[i + 1])
            table = step.block_tables[s].tolist()
            seq = [int(self.cache[table[p // bs] * bs + p % bs]) for p in range(int(step.position_ids[0, r]) + 1)]
            assert -1 not in seq, "read a slot that was never written"
            rows.append(self.logits(seq))
        return torch.stack(rows)  # [N, VOCAB]


def make_engine(logits, **config) -> LLMEngine:
    return LLMEngine(SequenceExecutor(logits), make_plan(max_model_len=64), None,
                     EngineConfig(**{"num_blocks": 64, **config}))


def search(engine: LLMEngine, prompt_list, **params):
    ids = (f"b{i}" for i in itertools.count())
    return run_beam_search(engine, prompt_list, BeamSearchParams(**params), request_ids=ids)


def greedy(engine: LLMEngine, prompt: list[int], max_tokens: int, **params) -> list[int]:
    engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params))
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.finished]
        if outs:
            return outs[0].outputs[0].token_ids
    raise AssertionError("unreachable")


def test_width_two_finds_the_pair_greedy_misses():
    engine = make_engine(table_logits(PAIRS))
    assert greedy(engine, [P], 2) == [A, Z]
    (out,) = search(engine, [[P]], beam_width=2, max_tokens=2)
    assert [s.tokens for s in out.sequences] == [[P, B, W], [P, A, Z]]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([math.log(0.36), math.log(0.2)], abs=1e-5)
    assert [s.finish_reason for s in out.sequences] == [None, None] and out.error is None
    # each output token's logprobs: the candidates the engine gave (2 x width), the chosen token among them
    assert len(out.sequences[0].logprobs) == 2 and all(len(row) == 4 for row in out.sequences[0].logprobs)
    assert out.sequences[0].logprobs[0][B] == pytest.approx(math.log(0.4), abs=1e-5)
    (one,) = search(engine, [[P]], beam_width=1, max_tokens=2)
    assert [s.tokens for s in one.sequences] == [[P, A, Z]]  # width 1 keeps only the best first token: greedy
    check_engine(engine)


def test_eos_ends_a_beam_and_length_penalty_ranks_the_ends():
    engine = make_engine(table_logits(ENDINGS))
    (lp1,) = search(engine, [[P]], beam_width=2, max_tokens=3)
    assert [s.tokens for s in lp1.sequences] == [[P, B, Y, Z], [P, A, X, Z]]
    assert [s.finish_reason for s in lp1.sequences] == [None, None]
    (lp0,) = search(engine, [[P]], beam_width=2, max_tokens=3, length_penalty=0.0)
    assert [s.tokens for s in lp0.sequences] == [[P, A, EOS], [P, B, Y, Z]]
    assert (lp0.sequences[0].finish_reason, lp0.sequences[0].stop_reason) == ("stop", EOS)
    assert lp0.sequences[0].cum_logprob == pytest.approx(math.log(0.3), abs=1e-5)
    # ignore_eos: EOS is a token like any other. Round 2 keeps A EOS (.3) and B Y (.27); A EOS EOS (.3, len 3 with
    # its last EOS left out) scores log(.3)/3 = -0.401 < B Y Z's -0.327.
    (free,) = search(engine, [[P]], beam_width=2, max_tokens=3, ignore_eos=True)
    assert [s.tokens for s in free.sequences] == [[P, B, Y, Z], [P, A, EOS, EOS]]
    assert [s.finish_reason for s in free.sequences] == [None, None]
    check_engine(engine)


def _reference_beam_search(prompt: list[int], width: int, max_tokens: int) -> list[list[int]]:
    """Plain-Python beam search on the echo model, ignore_eos, length_penalty 1: the best `width` outputs."""
    beams = [(0.0, list(prompt))]
    for _ in range(max_tokens):
        pool = []
        for cum, tokens in beams:
            logp = torch.log_softmax(next_logits(tokens), dim=-1)
            top = logp.topk(2 * width)
            pool += [(cum + v, tokens + [t]) for v, t in zip(top.values.tolist(), top.indices.tolist())]
        beams = sorted(pool, key=lambda b: -b[0])[:width]
    ranked = sorted(beams, key=lambda b: -b[0] / (len(b[1]) - (b[1][-1] == EOS)))
    return [tokens[len(prompt):] for _, tokens in ranked]


def test_engine_beam_search_matches_a_plain_python_one_on_the_echo_model():
    """Several prompts at once (their beams share the engine's steps), prompts longer than a block (prefix caching
    serves each round's prompt), a small pool: the same beams as a beam search on plain token lists."""
    engine = make_engine(next_logits, num_blocks=48)
    batch = prompts(3, seed=4, lo=5, hi=12)
    outs = search(engine, batch, beam_width=3, max_tokens=5, ignore_eos=True)
    for prompt, out in zip(batch, outs):
        assert [s.tokens[len(prompt):] for s in out.sequences] == _reference_beam_search(prompt, 3, 5)
    assert engine.stats().num_prefix_cache_hit_tokens > 0, "each round's prompt came from the prefix cache"
    check_engine(engine)
    # width 1 with ignore_eos is greedy decoding
    (one,) = search(engine, [batch[0]], beam_width=1, max_tokens=6, ignore_eos=True)
    assert one.sequences[0].tokens[len(batch[0]):] == greedy(engine, batch[0], 6, ignore_eos=True)


def test_the_search_alone_without_an_engine():
    """BeamSearch is pure: the caller gives each round's candidates (the engine's logprob rows)."""
    s = BeamSearch([P], BeamSearchParams(beam_width=2, max_tokens=2), eos_token_ids=[EOS])
    assert s.pending() == [[P]]
    s.advance([{A: math.log(0.5), B: math.log(0.4), C: math.log(0.1)}])
    assert s.pending() == [[P, A], [P, B]]
    s.advance([{Z: math.log(0.4), X: math.log(0.3)}, {W: math.log(0.9), EOS: math.log(0.1)}])
    assert s.done and s.pending() == []
    assert [b.tokens for b in s.best()] == [[P, B, W], [P, A, Z]]
    assert [b.tokens for b in s.completed] == [[P, B, EOS]]


def test_bad_params_and_prompts_are_request_errors():
    engine = make_engine(table_logits(PAIRS))
    with pytest.raises(RequestError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(RequestError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))
    with pytest.raises(RequestError, match="max_logprobs"):  # 2 x 11 candidates > the default max_logprobs of 20
        search(engine, [[P]], beam_width=11, max_tokens=2)
    with pytest.raises(RequestError, match="maximum context length"):
        search(engine, [[P] * 10], beam_width=2, max_tokens=60)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("model", ["tiny-llama"])
def test_llm_beam_search_on_a_built_plan(built_plan, model):
    from trtopt.runtime import LLM

    llm = LLM(built_plan(model), max_model_len=128)
    plain = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    (one,) = llm.beam_search(["Hello there"], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    prompt_ids = plain.prompt_token_ids
    assert one.sequences[0].tokens == prompt_ids + plain.outputs[0].token_ids
    (three,) = llm.beam_search([{"prompt_token_ids": prompt_ids}], BeamSearchParams(beam_width=3, max_tokens=6))
    beams = three.sequences
    assert len(beams) == 3 and len({tuple(b.tokens) for b in beams}) == 3
    scores = [b.cum_logprob / (len(b.tokens) - (b.finish_reason == "stop")) for b in beams]
    assert scores == sorted(scores, reverse=True)
    tok = llm.get_tokenizer()
    assert beams[0].text == tok.decode(beams[0].tokens, skip_special_tokens=True)
    assert beams[0].cum_logprob >= one.sequences[0].cum_logprob - 1e-4 or beams[0].finish_reason == "stop"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_width_one_is_greedy_on_smollm2(smollm2_engine):
    engine = smollm2_engine()
    ids = engine.tokenizer("The capital of France is").input_ids
    (one,) = search(engine, [ids], beam_width=1, max_tokens=8, ignore_eos=True)
    assert one.sequences[0].tokens[len(ids):] == greedy(engine, ids, 8, ignore_eos=True)
    (four,) = search(engine, [ids], beam_width=4, max_tokens=8)
    assert len(four.sequences) == 4 and four.sequences[0].text.startswith("The capital of France is")
