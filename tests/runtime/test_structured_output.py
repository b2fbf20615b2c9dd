"""Structured output on the real SmolLM2: JSON schemas, regex, choice and grammars, mixed with free requests in one
batch; every constrained output must parse and validate, and free rows must not feel the masks."""

from __future__ import annotations

import json
import re

import pytest
import torch

from trtopt.errors import RequestError
from trtopt.runtime.sampling_params import SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MODEL = "smollm2-135m"

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
# 20 schemas: nested objects, enums, arrays (bounded and not), numbers and integers with bounds, booleans, nulls.
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 10}, "minItems": 1, "maxItems": 3}}, "required": ["scores"]},
    {"type": "object", "properties": {"city": NAME, "location": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]}}, "required": ["city", "location"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}}, "required": ["tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "admin": {"type": "boolean"}}, "required": ["id", "admin"]}}, "required": ["user"]},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}}, "required": ["price"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "note": {"type": "null"}}, "required": ["level", "note"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 2}}, "required": ["items"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}, "genre": {"enum": ["drama", "comedy", "horror"]}}, "required": ["title", "year", "genre"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "integer", "maximum": 5}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"enum": ["C", "F"]}}, "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}, "required": ["matrix"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["status", "count"]},
    {"type": "object", "properties": {"first": NAME, "last": NAME, "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}, "required": ["first", "last", "email"]},
    {"type": "object", "properties": {"flags": {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"type": "boolean"}}, "required": ["x", "y"], "additionalProperties": False}}, "required": ["flags"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 10, "maximum": 20}, "kind": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "integer", "maximum": 3}]}}, "required": ["id", "kind"]},
]


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def smollm2(engine_for):
    return lambda **cfg: engine_for(MODEL, **cfg)


def _run(engine, requests: list[tuple[object, SamplingParams]]):
    """Add every (prompt, params) at once and step to the end: one continuously batched run."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[f"r{i}"] for i in range(len(requests))]


def test_twenty_json_schemas_in_one_batch_all_validate(smollm2):
    engine = smollm2()
    reqs = [(_chat(f"Give a JSON value for this schema: {json.dumps(s)}"),
             SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=s)))
            for s in SCHEMAS]
    outs = _run(engine, reqs)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", f"{schema}: stopped by {c.finish_reason} after {len(c.token_ids)} tokens: {c.text!r}"
        jsonschema.validate(json.loads(c.text), schema)


def test_mixed_batch_regex_choice_grammar_and_free_rows(smollm2):
    free = SamplingParams(temperature=0, max_tokens=12)
    reqs = [
        (_chat("What is the phone number of the office?"),
         SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"))),
        ("The capital of France is", free),
        (_chat("Is the sky blue?"),
         SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no", "it depends"]))),
        (_chat("Pick a fruit."),  # sampled rows go through the same mask before top-k/top-p and the draw
         SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["apple", "pear"]))),
        (_chat("Write a sum."),
         SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(grammar='root ::= num " + " num\nnum ::= [1-9] [0-9]?'))),
        (_chat("Write a greeting."),
         SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(grammar='start: GREET " " NAME\nGREET: "hello" | "hi"\nNAME: /[A-Z][a-z]{1,8}/'))),
        (_chat("Give me a JSON object with the keys name and age of a person."),
         SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json_object=True))),
    ]
    outs = _run(smollm2(), reqs)
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", texts[0]), texts[0]
    assert texts[2] in ("yes", "no", "it depends")
    assert texts[3] in ("apple", "pear")
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", texts[4]), texts[4]
    assert re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,8}", texts[5]), texts[5]
    assert isinstance(json.loads(texts[6]), dict)
    for o in outs[:1] + outs[2:]:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0]
    # The free row is what it is alone: the masks of its neighbours did not leak into it.
    alone = _run(smollm2(), [reqs[1]])[0].outputs[0]
    assert outs[1].outputs[0].token_ids == alone.token_ids


def test_n_completions_each_follow_the_grammar(smollm2):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma", "delta"]))
    out = _run(smollm2(), [(_chat("Name a Greek letter."), params)])[0]
    assert [c.text in ("alpha", "beta", "gamma", "delta") for c in out.outputs] == [True] * 3


def test_bad_specs_are_request_errors_and_change_nothing(smollm2):
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(RequestError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(RequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    engine = smollm2()
    for spec in (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
                 StructuredOutputsParams(regex="(unclosed"),
                 StructuredOutputsParams(grammar="root ::= undefined_rule")):
        with pytest.raises(RequestError, match="could not be compiled"):
            engine.add_request("bad", "Hi", SamplingParams(structured_outputs=spec))
    assert not engine.has_unfinished_requests()


def test_masker_touches_only_constrained_rows(smollm2):
    """The sampler's mask on random logits: constrained rows allow exactly the grammar's tokens, free rows stay bit-identical."""
    from trtopt.runtime.request import Request
    from trtopt.runtime.structured_output import GrammarMasker, GrammarMatcher

    engine = smollm2()
    vocab = engine.plan.model.vocab_size
    compiled = engine.compile_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    reqs = [Request(f"s{i}", [1, 2, 3], SamplingParams(), max_model_len=64) for i in range(4)]
    for i in (1, 3):
        reqs[i].grammar = GrammarMatcher(compiled)
    logits = torch.randn(4, vocab)
    masked = logits.clone()
    GrammarMasker()(masked, reqs)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    tok = engine.tokenizer
    allowed = {t for t in range(vocab) if masked[1, t] > float("-inf")}
    assert allowed and all(any(w.startswith(tok.decode([t])) for w in ("yes", "no")) for t in allowed)
    assert torch.equal(masked[1] > float("-inf"), masked[3] > float("-inf"))


def test_speculative_decoding_refuses_structured_output():
    """Draft tokens are proposed without the grammar, so the combination is refused up front (not rolled back)."""
    from echo_model import EchoExecutor, make_plan

    from trtopt.runtime.config import EngineConfig
    from trtopt.runtime.engine import LLMEngine

    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    engine = LLMEngine(EchoExecutor(4), make_plan(block_size=4, max_num_tokens=64, max_num_seqs=4, max_model_len=64),
                       None, EngineConfig(num_blocks=32, speculative_config=spec))
    with pytest.raises(RequestError, match="structured outputs.* not available with speculative decoding"):
        engine.add_request("s", [1, 2, 3], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+")))
    assert not engine.has_unfinished_requests()


@pytest.mark.slow  # two SmolLM2 engines on the CPU
def test_async_scheduling_gives_the_same_constrained_outputs(smollm2):
    """With one step in flight the grammar still sees every token before the next row is masked: the matcher is
    advanced when step N's tokens are processed, before step N+1 is sampled (docs/architecture.md §6a)."""
    reqs = [
        (_chat("Is the sky blue?"),
         SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no", "it depends"]))),
        ("The capital of France is", SamplingParams(temperature=0, max_tokens=6)),
        (_chat("Pick a fruit."),
         SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["apple", "pear"]))),
    ]
    results = []
    for mode in (False, True):
        engine = smollm2(async_scheduling=mode)
        assert engine.async_scheduling is mode
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in _run(engine, reqs)])
    assert results[0] == results[1]
    assert results[1][0][1] == results[1][2][1] == "stop"
