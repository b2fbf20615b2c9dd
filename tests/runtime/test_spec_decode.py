"""Speculative decoding (issue 12): KV rollback on the echo model, exact rejection sampling (chi-square against the
target's exact distribution), configuration errors, and greedy identity on the real SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst
import torch

from trtopt.errors import ConfigError, RequestError
from trtopt.runtime.block_pool import hash_block
from trtopt.runtime.config import EngineConfig
from trtopt.runtime.engine import LLMEngine
from trtopt.runtime.sampling_params import SamplingParams
from trtopt.runtime.spec_decode.ngram import ngram_lookup, ngram_lookup_batch
from trtopt.runtime.spec_decode.proposer import Proposal

from echo_model import VOCAB, EchoExecutor, make_plan, next_logits, prompts, reference_generate
from stepping import run_all

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


class ArgmaxEchoExecutor(EchoExecutor):
    """The echo model with each step's argmax on hand (`last_greedy_tokens`), as a CUDA graph leaves it: the
    verifier must read it row for row as it would its own argmax."""

    def execute(self, step):
        logits = super().execute(step)
        self.last_greedy_tokens = logits.argmax(-1)
        return logits


def make_engine(spec=NGRAM, *, block_size=4, num_blocks=64, max_num_tokens=64, max_num_seqs=8, max_model_len=64,
                argmax_on_hand=False, **cfg):
    plan = make_plan(block_size=block_size, max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    ex = (ArgmaxEchoExecutor if argmax_on_hand else EchoExecutor)(block_size)
    return LLMEngine(ex, plan, None, EngineConfig(num_blocks=num_blocks, speculative_config=spec, **cfg)), ex


class WrongProposer:
    """Proposes K tokens that the target never chose at that position (each one's argmax + 1): every draft is
    rejected, so every step rolls back K slots."""

    def __init__(self, k_tokens=None):
        self.num_proposed = 0

    def propose(self, batch, requests, sampler):
        out = {}
        for seq in batch.seqs:
            if seq.num_lookahead:
                toks = list(requests[seq.request_id].token_ids)
                draft = []
                for _ in range(seq.num_lookahead):
                    t = (int(next_logits(toks).argmax()) + 1) % VOCAB
                    draft.append(t)
                    toks.append(t)
                out[seq.request_id] = Proposal(draft)
                self.num_proposed += len(draft)
        return out

    def allocate_kv_cache(self, num_blocks):
        pass

    def copy_blocks(self, pairs):
        pass


class UniformProposer(WrongProposer):
    """A deliberately bad draft: K tokens uniformly at random, with q uniform. Its draws depend only on the
    sequence itself (like a real draft's, which use the request's generator), not on the batch."""

    def propose(self, batch, requests, sampler):
        out = {}
        for s in batch.seqs:
            if s.num_lookahead:
                toks = requests[s.request_id].token_ids
                rng = torch.Generator().manual_seed(len(toks) * 7919 + sum(toks) + hash(s.request_id) % 1000)
                out[s.request_id] = Proposal(torch.randint(0, VOCAB, (s.num_lookahead,), generator=rng).tolist(),
                                             torch.full((s.num_lookahead, VOCAB), 1.0 / VOCAB))
        return out


def check_blocks(engine):
    """Ref counts equal the block tables holding each block; every cached block hashes committed tokens only."""
    engine.pool.check_invariants()
    refs = [0] * engine.pool.num_blocks
    for table in engine.kv.holders().values():
        for b in table:
            refs[b] += 1
    assert refs == engine.pool.ref_cnt
    bs = engine.limits.block_size
    for rid, hashes in engine.kv._hashes.items():
        req = engine.scheduler.requests[rid]
        assert len(hashes) * bs <= req.num_computed_tokens, f"{rid}: a block past the committed tokens was hashed"
        parent = None
        for i, h in enumerate(hashes):
            parent = hash_block(parent, req.token_ids[i * bs : (i + 1) * bs])
            assert h == parent, f"{rid}: cached block {i} does not hash its committed tokens"
        for i, h in enumerate(hashes):  # the cache still maps those hashes to blocks of the committed tokens
            assert engine.pool.block_hash[engine.kv.block_ids(rid)[i]] in (h, None) or engine.pool.lookup(h) is not None


def test_rollback_when_every_draft_is_rejected():
    engine, ex = make_engine({**NGRAM, "num_speculative_tokens": 4}, num_blocks=40)
    engine.spec.proposer = WrongProposer()
    ps = prompts(6, seed=1) + [prompts(1, seed=1)[0]]  # a repeated prompt shares prefix-cached blocks
    for i, p in enumerate(ps):
        engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        check_blocks(engine)
        for rid, table in engine.kv.holders().items():  # after rollback: no block past the pending token
            req = engine.scheduler.requests[rid]
            assert len(table) <= -(-req.num_tokens // engine.limits.block_size), f"{rid} kept a rejected block"
        steps += 1
    for i, p in enumerate(ps):
        assert done[str(i)].outputs[0].token_ids == reference_generate(p, 20, eos=None)
    assert engine.spec.proposer.num_proposed > 0
    st = engine.stats()
    assert st.num_draft_tokens == engine.spec.proposer.num_proposed and st.num_accepted_tokens == 0
    assert st.num_blocks_free == st.num_blocks_total
    assert st.num_prefix_cache_hit_tokens > 0
    # Every cached block's hash is the hash of some request's committed prefix.
    committed = set()
    for i, p in enumerate(ps):
        toks, parent = p + done[str(i)].outputs[0].token_ids, None
        for b in range(len(toks) // 4):
            parent = hash_block(parent, toks[b * 4 : (b + 1) * 4])
            committed.add(parent)
    assert set(engine.pool._cached) <= committed


@pytest.mark.parametrize("cfg", [
    dict(num_blocks=64),
    dict(num_blocks=17),  # 16 usable blocks: preemption happens
    dict(max_num_batched_tokens=7),  # chunked prefill, and budget-capped lookahead
    dict(num_blocks=64, argmax_on_hand=True),  # the verifier reads the executor's argmax rows
], ids=["plain", "tiny-pool", "small-budget", "argmax-on-hand"])
def test_ngram_greedy_equals_reference_on_echo(cfg):
    engine, _ = make_engine(**cfg)
    # Repetitive prompts so that n-gram lookup proposes (and the echo model sometimes accepts) drafts.
    ps = [p * 3 for p in prompts(8, seed=2, lo=3, hi=6)]
    for i, p in enumerate(ps):
        engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=24))
    done = run_all(engine)
    for i, p in enumerate(ps):
        assert done[str(i)].outputs[0].token_ids == reference_generate(p, 24)
    st = engine.stats()
    assert st.num_draft_tokens > 0 and st.num_blocks_free == st.num_blocks_total
    if cfg.get("num_blocks") == 17:
        assert st.num_preemptions > 0


def test_stop_token_inside_an_accepted_run_drops_what_follows():
    engine, _ = make_engine({**NGRAM, "num_speculative_tokens": 4})
    p = prompts(1, seed=3)[0]
    ref = reference_generate(p, 30, eos=None)
    stop = ref[10]
    engine.spec.proposer = _OracleProposer()
    engine.add_request("a", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                                     stop_token_ids=(stop,)))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    first = ref.index(stop)
    assert outs[-1].outputs[0].token_ids == ref[: first + 1] and outs[-1].outputs[0].finish_reason == "stop"
    assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == first + 1  # streamed exactly the accepted tokens
    assert any(len(o.outputs[0].delta_token_ids) > 1 for o in outs)  # several tokens per step
    m = outs[-1].metrics
    assert m.acceptance_rate == 1.0 and m.mean_accepted_length > 2


class _OracleProposer(WrongProposer):
    """Proposes exactly the target's greedy continuation: every draft is accepted."""

    def propose(self, batch, requests, sampler):
        out = {}
        for seq in batch.seqs:
            if seq.num_lookahead:
                toks, draft = list(requests[seq.request_id].token_ids), []
                for _ in range(seq.num_lookahead):
                    draft.append(int(next_logits(toks).argmax()))
                    toks.append(draft[-1])
                out[seq.request_id] = Proposal(draft)
        return out


def _exact_marginals(prompt, params_probs):
    """Exact distributions of output tokens 2 and 3 (the first ones drawn through verification)."""
    p1 = params_probs(next_logits(prompt))
    p2 = torch.zeros(VOCAB, dtype=torch.float64)
    p3 = torch.zeros(VOCAB, dtype=torch.float64)
    for t1 in torch.nonzero(p1 > 0).flatten().tolist():
        q2 = params_probs(next_logits(prompt + [t1]))
        p2 += p1[t1] * q2
        for t2 in torch.nonzero(q2 > 1e-7).flatten().tolist():
            p3 += p1[t1] * q2[t2] * params_probs(next_logits(prompt + [t1, t2]))
    return p2, p3


def _chi2_pvalue(counts, probs):
    n = counts.sum()
    expected = probs * n
    keep = expected >= 5  # pool the rare cells
    obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum())
    dof = int(keep.sum())
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow
@pytest.mark.parametrize("proposer,top_p", [("ngram", 1.0), ("uniform", 0.8), ("wrong", 0.8)])
def test_rejection_sampling_keeps_the_target_distribution(proposer, top_p):
    num = 1500
    engine, _ = make_engine({**NGRAM, "num_speculative_tokens": 2}, max_num_seqs=64, max_num_tokens=1024, num_blocks=1700,
                            max_model_len=64, enable_prefix_caching=False, seed=11)
    if proposer == "uniform":
        engine.spec.proposer = UniformProposer()
    elif proposer == "wrong":
        engine.spec.proposer = WrongProposer()
    # Tokens 2..39 occur once, so n-gram proposes what followed them; the last token is chosen so that the likely
    # first tokens are among them (the echo model's distributions are peaked).
    prompt = next(list(range(2, 40)) + [c] for c in range(2, VOCAB)
                  if set(next_logits(list(range(2, 40)) + [c]).topk(2).indices.tolist()) <= set(range(2, 40)))
    params = SamplingParams(temperature=0.7, top_p=top_p, max_tokens=3, ignore_eos=True)
    for i in range(num):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = run_all(engine)
    assert engine.stats().num_draft_tokens > num // 10  # many sequences verified drafts

    def probs(logits):
        from trtopt.runtime.sampler import _candidates

        x = (logits / 0.7)[None]
        vals, ids = _candidates(x, torch.tensor([VOCAB]), torch.tensor([top_p]), torch.tensor([0.0]))
        return torch.zeros(VOCAB, dtype=torch.float64).scatter_(0, ids[0], torch.softmax(vals[0].double(), dim=-1))

    p2, p3 = _exact_marginals(prompt, probs)
    for pos, exact in ((1, p2), (2, p3)):
        counts = torch.bincount(torch.tensor([done[str(i)].outputs[0].token_ids[pos] for i in range(num)]),
                                minlength=VOCAB).double()
        assert counts[exact == 0].sum() == 0, "a token outside the target's support was produced"
        assert _chi2_pvalue(counts, exact) > 1e-3, f"output token {pos + 1} does not follow the target distribution"


def test_seeded_requests_are_reproducible_in_any_batch():
    def run(batch):
        engine, _ = make_engine({**NGRAM, "num_speculative_tokens": 3})
        engine.spec.proposer = UniformProposer()
        p = [5, 9, 5, 9, 5]
        engine.add_request("x", {"prompt_token_ids": p}, SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))
        for i, q in enumerate(prompts(batch, seed=4)):
            engine.add_request(str(i), {"prompt_token_ids": q}, SamplingParams(temperature=1.0, max_tokens=12))
        return run_all(engine)["x"].outputs[0].token_ids

    assert run(0) == run(5) == run(2)


def test_ngram_lookup_finds_the_latest_longest_match():
    t = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 2, 3])
    assert ngram_lookup(t, 3, 1, 3) == [5, 6, 7]  # suffix [2, 3] matched most recently at 6..7
    assert ngram_lookup(np.array([1, 2, 3]), 3, 1, 3) == []
    assert ngram_lookup(np.array([4, 4, 4, 4]), 2, 2, 2) == [4]


def _ngram_by_hand(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, token by token: the latest earlier occurrence of the longest suffix."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=60, deadline=None)
@given(hst.lists(hst.lists(hst.integers(0, 3), max_size=24), min_size=1, max_size=6), hst.integers(1, 3),
       hst.integers(1, 4), hst.integers(1, 5))
def test_batched_ngram_lookup_equals_the_definition_row_by_row(rows, min_n, extra, k):
    """One vectorised pass over right-aligned histories of different lengths gives each row its own answer."""
    max_n = min_n + extra - 1
    width = max(1, max(len(r) for r in rows))
    histories = np.full((len(rows), width), -1, dtype=np.int64)
    for b, r in enumerate(rows):
        histories[b, width - len(r):] = r
    ks = [k + b % 2 for b in range(len(rows))]
    got = ngram_lookup_batch(histories, np.array([len(r) for r in rows]), ks, min_n, max_n)
    assert got == [_ngram_by_hand(r, kb, min_n, max_n) for r, kb in zip(rows, ks)]


@pytest.mark.parametrize("spec,match", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "unknown"),
    ({"method": "draft_model", "model": "/nonexistent/plan", "num_speculative_tokens": 2}, "does not exist"),
    ({"method": "self_draft", "num_layers": 2, "num_speculative_tokens": 2}, "plan dir"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_config_is_a_config_error(spec, match):
    with pytest.raises(ConfigError, match=match):
        make_engine(spec)


def test_logprobs_are_refused_with_speculation():
    engine, _ = make_engine()
    with pytest.raises(RequestError, match="logprobs"):
        engine.add_request("a", {"prompt_token_ids": [3, 4]}, SamplingParams(logprobs=1))


# ---- SmolLM2: greedy identity with every proposer ---------------------------------------------------------------

SMOL = "smollm2-135m"
CHAT = ["Write a Python function that returns the squares of a list of numbers.",
        "Rewrite this sentence in the passive voice: The cat chased the mouse across the garden.",
        "List three fruits that are red.", "What is 12 times 12? Answer with the number only.",
        "Summarise: The quick brown fox jumps over the lazy dog. The dog sleeps. The fox runs away.",
        "Translate 'good morning' into French.", "Give a one-line definition of a prime number.",
        "Fix the bug: def add(a, b): return a - b"]
SMOL_TOKENS = 16


@pytest.fixture(scope="module")
def smol(built_plan, executor_for):
    from trtopt.builder.draft import build_draft_plan
    from trtopt.builder.plan import read_plan
    from trtopt.runtime.config import load_tokenizer

    plan_dir = built_plan(SMOL)
    for n in (4, 20):
        build_draft_plan(plan_dir, n)
    tok = load_tokenizer(plan_dir)

    def run(spec, **cfg):
        engine = LLMEngine(executor_for(SMOL, "torch"), read_plan(plan_dir), tok,
                           EngineConfig(max_model_len=256, speculative_config=spec, **cfg), plan_dir=plan_dir)
        for i, p in enumerate(CHAT):
            engine.add_request(str(i), [{"role": "user", "content": p}],
                               SamplingParams(temperature=0, max_tokens=SMOL_TOKENS, ignore_eos=True))
        done = run_all(engine)
        st = engine.stats()
        assert st.num_blocks_free == st.num_blocks_total
        return [done[str(i)].outputs[0].token_ids for i in range(len(CHAT))], st

    base, _ = run(None)
    return plan_dir, run, base


@pytest.mark.slow
@pytest.mark.parametrize("name,spec,cfg", [
    ("ngram-small-budget", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}, {"max_num_batched_tokens": 24}),
    ("self-draft-4", {"method": "self_draft", "num_layers": 4, "num_speculative_tokens": 3}, {}),
    ("self-draft-20-tiny-pool", {"method": "self_draft", "num_layers": 20, "num_speculative_tokens": 3}, {"num_blocks": 18}),
    ("draft-plan-own-pool", {"method": "draft_model", "model": "draft_20", "num_speculative_tokens": 3}, {"num_blocks": 18}),
])
def test_smollm2_greedy_identity(smol, name, spec, cfg):
    plan_dir, run, base = smol
    if spec["method"] == "draft_model":
        spec = {**spec, "model": str(plan_dir / spec["model"])}
    out, st = run(spec, **cfg)
    assert out == base
    assert st.num_draft_tokens > 0
    if "num_blocks" in cfg:
        assert st.num_preemptions > 0
    if "20" in name or "own-pool" in name:
        assert st.num_accepted_tokens > 0  # 20 of 30 layers guess some tokens right


def test_prometheus_exports_draft_and_accepted_counters():
    from prometheus_client import generate_latest

    from trtopt.serving.metrics import ServingMetrics

    engine, _ = make_engine({**NGRAM, "num_speculative_tokens": 4})
    engine.spec.proposer = _OracleProposer()
    engine.add_request("a", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    run_all(engine)
    st = engine.stats()
    assert st.num_draft_tokens == st.num_accepted_tokens > 0 and st.num_accepted_per_position[0] > 0
    text = generate_latest(ServingMetrics(engine.stats).registry).decode()
    assert f"trtopt_spec_decode_num_draft_tokens_total {float(st.num_draft_tokens)}" in text
    assert f"trtopt_spec_decode_num_accepted_tokens_total {float(st.num_accepted_tokens)}" in text
    assert f'trtopt_spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {float(st.num_accepted_per_position[0])}' in text
