import pytest
import torch

from trtopt.runtime.request import Request
from trtopt.runtime.sampler import Sampler
from trtopt.runtime.sampling_params import SamplingParams

V = 50


def req(prompt=(3, 4), out=(), **kw):
    r = Request("r", list(prompt), SamplingParams(**kw), eos_token_ids=(0,), max_model_len=1000)
    r.token_ids += list(out)
    return r


def logits_rows(n, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    x = logits_rows(3)
    s = Sampler(seed=0)
    got = s(x, [req(temperature=0), req(temperature=0.7, top_k=1), req(temperature=1.3, top_p=1e-6)])
    assert [t.token_id for t in got] == x.argmax(-1).tolist()


def test_seeded_draws_do_not_depend_on_batch_composition():
    x = logits_rows(4, seed=1)
    a = [Sampler()(x[2:3], [req(temperature=1.0, seed=7)])[0].token_id]
    r1, r2 = req(temperature=1.0, seed=7), req(temperature=1.0, seed=7)
    seq_alone = [Sampler()(x[2:3], [r1])[0].token_id for _ in range(20)]
    seq_batched = [Sampler()(x, [req(temperature=0.5), req(temperature=0), r2, req(temperature=2.0)])[2].token_id for _ in range(20)]
    assert seq_alone == seq_batched and a[0] == seq_alone[0]
    assert len(set(seq_alone)) > 1  # it really samples


def test_sampling_follows_the_distribution():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [0.0] * (V - 3)]) + 1e-30)
    r = req(temperature=1.0, seed=3)
    s = Sampler()
    counts = torch.bincount(torch.tensor([s(x, [r])[0].token_id for _ in range(3000)]), minlength=V).float() / 3000
    assert torch.allclose(counts[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.04)
    assert counts[3:].sum() == 0


def test_top_k_top_p_min_p_keep_exactly_the_allowed_tokens():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04] + [0.0] * (V - 6))
    x = torch.log(probs + 1e-30)[None]
    cases = [({"top_k": 2}, {0, 1}), ({"top_p": 0.7}, {0, 1, 2}), ({"top_p": 0.65}, {0, 1}), ({"min_p": 0.3}, {0, 1, 2})]
    for kw, allowed in cases:
        r = req(temperature=1.0, seed=11, **kw)
        seen = {Sampler()(x, [r])[0].token_id for _ in range(400)}
        assert seen == allowed, kw


def test_penalties_match_their_definition():
    x = torch.tensor([[2.0, -1.0, 0.5, 1.0] + [-10.0] * (V - 4)])
    prompt, out = [0], [1, 2, 2]
    r = req(prompt=prompt, out=out, temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # token 0: in prompt only -> 2.0/2 = 1.0; token 1: out once -> -1*2 - 0.5 - 0.25 = -2.75
    # token 2: out twice -> 0.5/2 - 1.0 - 0.25 = -1.0; token 3: untouched 1.0
    penalised = x.clone()
    from trtopt.runtime.sampler import SamplingTensors, _apply_penalties

    _apply_penalties(penalised, [r], SamplingTensors.from_requests([r], V))
    assert torch.allclose(penalised[0, :4], torch.tensor([1.0, -2.75, -1.0, 1.0]))
    assert Sampler()(x, [r])[0].token_id == 0  # ties at 1.0 go to the first index


def test_min_tokens_masks_eos_and_stop_ids():
    x = torch.zeros(1, V)
    x[0, 0] = 10.0  # EOS
    x[0, 5] = 9.0  # a stop id
    r = req(temperature=0, min_tokens=2, stop_token_ids=[5])
    assert Sampler()(x, [r])[0].token_id not in (0, 5)
    r.token_ids += [7, 8]
    assert Sampler()(x, [r])[0].token_id == 0


def test_logprobs_are_raw_log_softmax_with_top_k_alternatives():
    x = logits_rows(2, seed=4)
    ra, rb = req(temperature=0, logprobs=3, repetition_penalty=1.5, out=(1, 2)), req(temperature=0)
    a, b = Sampler()(x, [ra, rb])
    lp = torch.log_softmax(x[0], -1)
    assert abs(a.logprob - lp[a.token_id].item()) < 1e-6
    top = lp.topk(3)
    assert {k: round(v, 5) for k, v in a.top_logprobs.items()} == {
        **{a.token_id: round(lp[a.token_id].item(), 5)},
        **{i: round(v, 5) for i, v in zip(top.indices.tolist(), top.values.tolist())},
    }
    assert b.logprob is None and b.top_logprobs is None


def reference_keep(x: torch.Tensor, k: int, p: float, mp: float) -> set[int]:
    """Plain HF-order filtering of one row over the whole vocabulary: top-k, top-p on the top-k
    distribution, then min-p."""
    order = x.argsort(descending=True).tolist()
    keep = order[:k] if k > 0 else order
    probs = torch.softmax(x[keep], -1).tolist()
    kept, mass = [], 0.0
    for tok, q in zip(keep, probs):
        if p < 1 and mass >= p and kept:
            break
        kept.append(tok)
        mass += q
    top = probs[0]
    return {tok for tok, q in zip(kept, probs) if q >= mp * top or tok == keep[0]}


def test_candidate_shortcut_equals_full_vocabulary_filtering():
    from trtopt.runtime.sampler import _candidates

    vocab = 3000  # > the 1024 candidates, so both the shortcut and the full-sort fallback run
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        m = 6
        scale = [0.05, 0.5, 3.0][trial % 3]  # flat rows force the fallback, peaked rows take the shortcut
        x = torch.randn(m, vocab, generator=g) * scale
        ks = [0, 5, 40, 0, 0, 0] if trial % 4 else [0, 5, 40, 2000, 0, 0]  # a top-k > 1024 forces the full sort
        top_k = torch.tensor([ks[(i + trial) % 6] for i in range(m)])
        top_p = torch.tensor([[1.0, 0.9, 0.5, 0.999, 0.3, 1.0][(i + 2 * trial) % 6] for i in range(m)])
        min_p = torch.tensor([[0.0, 0.0, 0.1, 0.0, 0.0, 0.05][(i + 3 * trial) % 6] for i in range(m)])
        k_t = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        # As in the sampler, rows with no filter at all are drawn from the whole vocabulary, not from here.
        rows = torch.nonzero(~((k_t >= vocab) & (top_p >= 1) & (min_p <= 0))).flatten()
        x, top_k, top_p, min_p, k_t = x[rows], top_k[rows], top_p[rows], min_p[rows], k_t[rows]
        vals, ids = _candidates(x, k_t, top_p, min_p)
        for i in range(len(rows)):
            got = set(ids[i][vals[i] > float("-inf")].tolist())
            want = reference_keep(x[i], int(top_k[i]), float(top_p[i]), float(min_p[i]))
            assert got == want, (trial, i, int(top_k[i]), float(top_p[i]), float(min_p[i]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
def test_every_option_samples_on_cuda_as_on_cpu():
    """Logits on the GPU: every sampling path runs there and, seeded, picks what the CPU sampler picks."""
    x = logits_rows(6, seed=4)

    def batch():
        return [
            req(temperature=0),
            req(temperature=0.8, top_k=5, seed=1),
            req(temperature=1.2, top_p=0.7, seed=2),
            req(temperature=1.0, min_p=0.1, seed=3),
            req(out=(7, 7, 9), temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, seed=4),
            req(temperature=1.0, min_tokens=4, seed=5, logprobs=2),
        ]

    for _ in range(5):
        cpu = Sampler()(x, batch())
        gpu = Sampler()(x.cuda(), batch())
        assert [t.token_id for t in gpu] == [t.token_id for t in cpu]
        assert gpu[5].logprob == pytest.approx(cpu[5].logprob, abs=1e-5)
    assert 0 not in {Sampler()(x[:1].cuda(), [req(temperature=1.0, min_tokens=4)])[0].token_id for _ in range(50)}


def test_token_controls_on_the_sampler_alone():
    """allowed_token_ids, logit_bias and multi-token bad_words, row by row, beside rows without them."""
    x = logits_rows(4, seed=9)
    bad = req(out=(5, 6), temperature=0)
    bad.bad_words_token_ids = ((5, 6, int(x[2].argmax())), (int(x[2].argmax()),), (9, 9, 1))  # 1st and 2nd ban the argmax
    free = req(temperature=0)
    rows = [free, req(temperature=1.0, seed=1, allowed_token_ids=(3, 8)), bad,
            req(temperature=0, logit_bias={int(x[3].argmin()): 100.0})]
    for _ in range(10):
        got = [t.token_id for t in Sampler()(x, rows)]
        assert got[0] == int(x[0].argmax()) and got[1] in (3, 8)
        assert got[2] != int(x[2].argmax()) and got[2] == int(x[2].topk(2).indices[1])
        assert got[3] == int(x[3].argmin())
    partial = req(out=(7,), temperature=0)
    partial.bad_words_token_ids = ((5, int(x[0].argmax())),)  # the output does not end with 5: nothing banned
    assert Sampler()(x[:1], [partial])[0].token_id == int(x[0].argmax())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
def test_token_controls_on_cuda_as_on_cpu():
    x = logits_rows(5, seed=6)

    def batch():
        bad = req(out=(5,), temperature=1.0, seed=3)
        bad.bad_words_token_ids = ((5, 7), (11,))
        return [req(temperature=0), req(temperature=1.0, seed=1, allowed_token_ids=(3, 8, 20)), bad,
                req(temperature=0.7, seed=2, logit_bias={4: 5.0, 9: -100.0}),
                req(temperature=0, logits_processors=[lambda ids, row: row.flip(0)])]

    for _ in range(5):
        cpu = Sampler()(x, batch())
        gpu = Sampler()(x.cuda(), batch())
        assert [t.token_id for t in gpu] == [t.token_id for t in cpu]
