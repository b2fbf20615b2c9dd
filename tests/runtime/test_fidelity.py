"""End to end on the real SmolLM2-135M plan: greedy output is token-identical to HF transformers `generate`.

Four scenarios x two backends, all compared with one HF reference computed once per session:
(a) everything at once, (b) staggered arrivals with a small chunked-prefill budget, (c) a pool so small that
preemption happens, (d) prefix caching with a shared system prompt.
"""

from __future__ import annotations

import pytest
import torch

from trtopt.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
MAX_TOKENS = 64
SYSTEM = (
    "You are a careful assistant. Answer in plain English, keep answers short, avoid lists unless asked, "
    "and say so when you do not know something."
)
CHATS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "Give me a name for a pet turtle.",
    "How do I boil an egg?",
    "What is 12 times 12?",
]
RAW = ["def fibonacci(n):", "The quick brown fox", "1, 2, 3, 4,"]


def prompts() -> list:
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in CHATS]
    return [*chats[:3], RAW[0], *chats[3:], RAW[1], RAW[2]]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
# Room for every prompt at max_model_len=256 at once (8 x 16 blocks of 16, plus the null block), so (a), (b) and (d)
# never preempt. The default pool (1 GB, ~1450 blocks) changes no scheduling decision here, but onnxruntime's
# PagedAttention body copies each layer's whole pool every step (ScatterND): a 1 GB copy a step made (a), (b) and
# (d) on onnxruntime 3-6x slower than (c)'s 13 blocks.
NUM_BLOCKS = len(prompts()) * 256 // 16 + 1


@pytest.fixture(scope="module")
def reference(smollm2_engine, hf_model):
    """Prompt token ids (as the engine tokenizes them) -> HF greedy continuation."""
    engine = smollm2_engine("torch")
    ids = [engine.input_processor.tokenize(p)[1] for p in prompts()]
    model = hf_model(MODEL)
    refs = []
    with torch.inference_mode():
        for prompt_ids in ids:
            x = torch.tensor([prompt_ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False)
            refs.append(out[0, len(prompt_ids):].tolist())
    return ids, refs


def drain(engine, done):
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out


def run(engine, arrivals):
    """arrivals: list of (step index, request id, prompt). Returns finished outputs by id."""
    done, step = {}, 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, GREEDY)
        drain(engine, done)
        step += 1
        assert step < 5000
    return done


def assert_matches(done, reference, engine):
    ids, refs = reference
    for i, (prompt_ids, ref) in enumerate(zip(ids, refs)):
        out = done[str(i)]
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == ref, f"prompt {i} diverges from HF"
    st = engine.stats()
    assert st.num_blocks_free == st.num_blocks_total and st.num_running == st.num_waiting == 0
    engine.pool.check_invariants()


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_a_all_at_once(smollm2_engine, reference, backend):
    engine = smollm2_engine(backend, enable_prefix_caching=False, num_blocks=NUM_BLOCKS)
    done = run(engine, [(0, str(i), p) for i, p in enumerate(prompts())])
    assert_matches(done, reference, engine)
    assert engine.stats().num_preemptions == 0


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_b_staggered_with_chunked_prefill(smollm2_engine, reference, backend):
    engine = smollm2_engine(backend, enable_prefix_caching=False, max_num_batched_tokens=48, num_blocks=NUM_BLOCKS)
    done = run(engine, [(5 * i, str(i), p) for i, p in enumerate(prompts())])
    assert_matches(done, reference, engine)
    assert engine.stats().num_preemptions == 0


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_c_tiny_pool_preempts(smollm2_engine, reference, backend):
    # The chats alone need 5 x ~4 blocks of 16 for their prompts and grow to ~7 blocks each;
    # 12 usable blocks (enough for one sequence of max_model_len=128) force preemption.
    engine = smollm2_engine(backend, enable_prefix_caching=False, num_blocks=13, max_model_len=128)
    done = run(engine, [(0, str(i), p) for i, p in enumerate(prompts())])
    assert engine.stats().num_preemptions > 0
    assert_matches(done, reference, engine)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_d_prefix_caching_shared_system_prompt(smollm2_engine, reference, backend):
    engine = smollm2_engine(backend, enable_prefix_caching=True, num_blocks=NUM_BLOCKS)
    ps = prompts()
    # The first chat runs alone so that its system-prompt blocks are cached before the others arrive.
    done = run(engine, [(0, "0", ps[0])] + [(3, str(i), p) for i, p in enumerate(ps) if i])
    assert_matches(done, reference, engine)
    chat_ids = [str(i) for i, p in enumerate(ps) if isinstance(p, list)]
    shared = min(len(reference[0][int(i)]) for i in chat_ids)
    assert all(done[i].num_cached_tokens >= 32 for i in chat_ids[1:]), [done[i].num_cached_tokens for i in chat_ids]
    assert all(done[i].num_cached_tokens < shared for i in chat_ids)
    assert engine.stats().num_prefix_cache_hit_tokens >= 32 * (len(chat_ids) - 1)
    assert engine.stats().num_preemptions == 0


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_logprobs_equal_hf_log_softmax(smollm2_engine, hf_model, backend):
    engine = smollm2_engine(backend, num_blocks=NUM_BLOCKS)
    engine.add_request("lp", [{"role": "user", "content": "Name a planet."}], SamplingParams(temperature=0, max_tokens=12, logprobs=5))
    done = {}
    while engine.has_unfinished_requests():
        drain(engine, done)
    out = done["lp"]
    gen = out.outputs[0].token_ids
    full = torch.tensor([out.prompt_token_ids + gen])
    with torch.inference_mode():
        logits = hf_model(MODEL)(full).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(out.prompt_token_ids) - 1 : -1]  # row j predicts gen[j]
    for j, (tok, alts) in enumerate(zip(gen, out.outputs[0].logprobs)):
        assert len(alts) in (5, 6) and tok in alts
        for t, v in alts.items():
            assert abs(v - lp[j, t].item()) < 1e-4, (j, t, v, lp[j, t].item())
        assert set(lp[j].topk(5).indices.tolist()) <= set(alts)
    assert abs(out.outputs[0].cumulative_logprob - sum(lp[j, t].item() for j, t in enumerate(gen))) < 1e-3
