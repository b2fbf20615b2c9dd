"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions, on the real app over an engine whose model is a
fixed bigram table in SmolLM2's tokens (hand-checkable: greedy says " red sky", width 2 finds " blue sea"), plus the
BeamSearchStream itself: other requests keep their results, and a cancelled search frees its blocks.

The table: after the prompt's last token ("\\n"): " red" .5, " blue" .4, " green" .1; after " red": " cat" .3,
" dog" .3, " sky" .4; after " blue": " sea" .9, " sun" .1; after " green": " sea" 1; after anything else: EOS.
Greedy: red (.5) sky (.4) = .20. Width 2 keeps red and blue, then blue sea (.36) beats red sky (.20).
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from scripted import EOS, VOCAB, ModelFreeExecutor, scripted_engine
from trtopt.runtime.beam_search import BeamSearchParams
from trtopt.runtime.input_processor import ChatPrompt
from trtopt.runtime.sampling_params import SamplingParams
from trtopt.serving.async_engine import AsyncLLMEngine
from trtopt.serving.beam_search import BeamSearchStream

NL, RED, BLUE, GREEN, CAT, DOG, SKY, SEA, SUN = 198, 2382, 4461, 2654, 2644, 2767, 6376, 3426, 2388
BIGRAMS = {NL: {RED: 0.5, BLUE: 0.4, GREEN: 0.1}, RED: {CAT: 0.3, DOG: 0.3, SKY: 0.4}, BLUE: {SEA: 0.9, SUN: 0.1},
           GREEN: {SEA: 1.0}}
PROMPT = "Colours:\n"
USER = [{"role": "user", "content": "Two colourful words, please."}]
BEAM = {"model": "m", "n": 2, "max_tokens": 2, "temperature": 0.0, "use_beam_search": True}


class BigramExecutor(ModelFreeExecutor):
    """Each logits row is BIGRAMS[the row's last token] as log-probabilities (EOS after any other token)."""

    def execute(self, step) -> torch.Tensor:
        last = step.input_ids[0, step.logits_indices].tolist()  # [N]
        logits = torch.full((len(last), VOCAB), -1e4)  # [N, vocab]: probability 0 in float32
        for row, token in enumerate(last):
            for nxt, p in BIGRAMS.get(token, {EOS: 1.0}).items():
                logits[row, nxt] = math.log(p)
        return logits


def make_engine(tokenizer):
    engine = scripted_engine(BigramExecutor(), tokenizer, max_model_len=256, num_blocks=128)
    assert tokenizer(PROMPT).input_ids[-1] == NL
    assert engine.input_processor.process(ChatPrompt(USER), SamplingParams()).prompt_token_ids[-1] == NL
    return engine


@pytest.fixture(scope="module")
def client(smol_tokenizer):
    from starlette.testclient import TestClient

    from trtopt.serving.server import create_app

    with TestClient(create_app(make_engine(smol_tokenizer), "m")) as c:
        yield c


def _texts(resp) -> list[str]:
    assert resp.status_code == 200, resp.text
    return [c["text"] for c in resp.json()["choices"]]


def test_completion_beam_search_returns_the_best_beams_best_first(client):
    resp = client.post("/v1/completions", json={**BEAM, "prompt": PROMPT})
    assert _texts(resp) == [" blue sea", " red sky"]
    body = resp.json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 4
    greedy = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert _texts(greedy) == [" red sky"]  # the same request without beam search: greedy's answer


def test_batched_prompts_as_vllms_test_batch_completions(client, smol_tokenizer):
    """vLLM's tests/entrypoints/openai/completion/test_completion.py::test_batch_completions, n=2 part."""
    ids = smol_tokenizer(PROMPT).input_ids
    for prompts in ([PROMPT] * 2, [ids] * 2):
        texts = _texts(client.post("/v1/completions", json={**BEAM, "prompt": prompts}))
        assert texts == [" blue sea", " red sky", " blue sea", " red sky"]


def test_eos_ends_the_beams_and_its_token_is_kept_only_when_asked(client):
    body = client.post("/v1/completions", json={**BEAM, "prompt": PROMPT, "max_tokens": 3,
                                                "return_token_ids": True}).json()
    assert [(c["text"], c["finish_reason"], c["stop_reason"]) for c in body["choices"]] == \
        [(" blue sea", "stop", EOS), (" red sky", "stop", EOS)]
    assert [c["token_ids"] for c in body["choices"]] == [[BLUE, SEA], [RED, SKY]]
    kept = client.post("/v1/completions", json={**BEAM, "prompt": PROMPT, "max_tokens": 3, "return_token_ids": True,
                                                "include_stop_str_in_output": True}).json()
    assert [c["token_ids"] for c in kept["choices"]] == [[BLUE, SEA, EOS], [RED, SKY, EOS]]
    assert kept["choices"][0]["text"] == " blue sea"


def test_completion_logprobs_are_the_usual_shape(client):
    choice = client.post("/v1/completions", json={**BEAM, "prompt": PROMPT, "logprobs": 1}).json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [" blue", " sea"]
    assert lp["token_logprobs"] == pytest.approx([math.log(0.4), math.log(0.9)], abs=1e-5)
    # the position's own token first, then the top alternative (vLLM's order)
    assert list(lp["top_logprobs"][0]) == [" blue", " red"]
    assert lp["top_logprobs"][0][" red"] == pytest.approx(math.log(0.5), abs=1e-5)
    assert list(lp["top_logprobs"][1]) == [" sea"]


def test_what_beam_search_does_not_do_is_a_400(client):
    resp = client.post("/v1/completions", json={**BEAM, "prompt": PROMPT, "stream": True})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "Streaming is not currently supported with beam search"  # vLLM's
    for extra, name in (({"stop": ["sea"]}, "stop"), ({"min_tokens": 1}, "min_tokens"),
                        ({"response_format": {"type": "json_object"}}, "structured output")):
        resp = client.post("/v1/completions", json={**BEAM, "prompt": PROMPT, **extra})
        assert resp.status_code == 400 and name in resp.json()["error"]["message"], resp.text
    resp = client.post("/v1/completions", json={**BEAM, "prompt": PROMPT, "n": 11})  # 22 candidates > 20
    assert resp.status_code == 400 and "max_logprobs" in resp.json()["error"]["message"]
    resp = client.post("/v1/chat/completions", json={**BEAM, "messages": USER, "tool_choice": "required",
                                                     "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert resp.status_code == 400 and "forced tool call" in resp.json()["error"]["message"]


def test_chat_beam_search_full_and_streamed(client):
    body = client.post("/v1/chat/completions", json={**BEAM, "messages": USER}).json()
    assert [c["message"]["content"] for c in body["choices"]] == [" blue sea", " red sky"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    # vLLM streams a beam search's chat reply: the role chunks, then each choice's whole text at once
    with client.stream("POST", "/v1/chat/completions", json={**BEAM, "messages": USER, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert [c["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [(c["index"], c["delta"]["content"], c["finish_reason"]) for c in chunks[2:]] == \
        [(0, " blue sea", "length"), (1, " red sky", "length")]


def _prepared(aengine: AsyncLLMEngine, max_tokens: int):
    return aengine.prepare(PROMPT, SamplingParams(max_tokens=max_tokens))


class _HeldRound:
    """A round's RequestStream that yields nothing until cancelled: the search is then mid-round for certain (its
    engine requests are submitted and its _round is set), however fast the engine runs them."""

    def __init__(self, stream, held: asyncio.Event) -> None:
        self._stream, self._held = stream, held

    def __aiter__(self):
        return self

    async def __anext__(self):
        self._held.set()
        await asyncio.Event().wait()  # until the test cancels the search

    def close(self) -> None:
        self._stream.close()


def test_other_requests_keep_their_results_and_a_cancelled_search_frees_its_blocks(smol_tokenizer):
    aengine = AsyncLLMEngine(make_engine(smol_tokenizer))

    async def greedy(rid: str) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=2)
        outs = [o async for o in aengine.generate(rid, PROMPT, params)]
        return outs[-1].outputs[0].token_ids

    async def beams(rid: str, max_tokens: int) -> list[list[int]]:
        stream = BeamSearchStream(aengine, [(rid, _prepared(aengine, max_tokens))], BeamSearchParams(2, max_tokens))
        try:
            return [c.token_ids for out in [o async for o in stream] for c in out.outputs]
        finally:
            stream.close()

    async def main():
        together = await asyncio.gather(greedy("g1"), beams("b1", 2), greedy("g2"))
        # a long search (its live beams say EOS-free filler after round 2), cancelled in its fourth round
        stream = BeamSearchStream(aengine, [("long", _prepared(aengine, 200))], BeamSearchParams(2, 200))
        held, add_requests = asyncio.Event(), aengine.add_requests

        async def adding(requests):
            round_ = await add_requests(requests)
            return _HeldRound(round_, held) if stream._rounds == 4 else round_

        aengine.add_requests = adding

        async def drain():
            async for _ in stream:
                pass

        task = asyncio.create_task(drain())
        await asyncio.wait_for(held.wait(), timeout=60)
        assert stream._round is not None, "the search is between rounds of engine requests"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stream.close()
        for _ in range(500):  # the abort lands before the next step
            stats = aengine.stats()
            if stats.num_running == stats.num_waiting == 0 and stats.num_blocks_free == stats.num_blocks_total:
                break
            await asyncio.sleep(0.01)
        return together, aengine.stats()

    try:
        together, stats = asyncio.run(main())
    finally:
        aengine.stop()
    assert together == [[RED, SKY], [[BLUE, SEA], [RED, SKY]], [RED, SKY]]
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_blocks_free == stats.num_blocks_total
