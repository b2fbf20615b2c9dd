"""Beam search above the engine, vLLM's way (its v1 `beam_search`, offline and in the OpenAI server).

The engine knows nothing of beams. Each round, every live beam is one engine request: its tokens (the prompt and the
beam's output so far) as the prompt, max_tokens=1, greedy, logprobs=2*beam_width. Its top 2*beam_width tokens by raw
logprob are its candidates, each scored by the beam's cumulative logprob plus the token's:

- a candidate that is an EOS token (unless ignore_eos) ends a beam: it joins the finished beams, EOS its last token;
- the beam_width best other candidates of all beams (by cumulative logprob; they all have the same length) live on.

After max_tokens rounds, or once no beam lives, the finished and live beams are ranked by
cum_logprob / len ** length_penalty (len: prompt and output tokens, a last EOS not counted; vLLM's
get_beam_search_score) and the best beam_width are the result. Prefix caching makes the rounds cheap: a beam's
request finds every full block of its tokens cached (the previous round computed them), so it computes only the
tail. Sampling settings play no part: the candidates come from the raw logprobs, as vLLM's do (`temperature` is
taken for vLLM's signature and changes nothing).

`BeamSearch` is the search of one prompt, with no engine: callers hand it each round's candidates. Two drivers run
it: `run_beam_search` over an LLMEngine (LLM.beam_search) and serving/beam_search.py over the async engine.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from trtopt.errors import RequestError
from trtopt.runtime.batch import CompletionOutput, RequestOutput
from trtopt.runtime.request import RequestMetrics
from trtopt.runtime.sampling_params import MAX_TEMPERATURE, RequestOutputKind, SamplingParams, _is_int, _is_num

if TYPE_CHECKING:
    from trtopt.runtime.engine import LLMEngine


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams (same names and defaults), plus skip_special_tokens for the returned text."""

    beam_width: int  # beams kept each round, and sequences returned
    max_tokens: int | None  # rounds (output tokens at most); None: what the context leaves after the prompt
    ignore_eos: bool = False  # EOS is an ordinary candidate: no beam finishes early
    temperature: float = 0.0  # accepted for vLLM's signature; the candidates are ranked by raw logprobs
    length_penalty: float = 1.0  # the final ranking divides cum_logprob by len ** length_penalty
    include_stop_str_in_output: bool = False  # the server's output keeps a beam's final EOS token
    skip_special_tokens: bool = True  # the returned text leaves special tokens out

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise RequestError(f"BeamSearchParams.{name}={getattr(self, name)!r} is invalid: it must be {allowed}.")

        check(_is_int(self.beam_width) and self.beam_width >= 1, "beam_width", "an integer >= 1")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
              "an integer >= 1 or None")
        check(_is_num(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
              f"a finite number in [0, {MAX_TEMPERATURE:g}]")
        check(_is_num(self.length_penalty), "length_penalty", "a finite number")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            check(isinstance(getattr(self, name), bool), name, "true or false")

    @property
    def num_candidates(self) -> int:
        """Candidates per beam and round (vLLM's and HF transformers' 2 * beam_width)."""
        return 2 * self.beam_width

    def step_params(self, logprobs: int | None = None, *, max_logprobs: int) -> SamplingParams:
        """The params of one beam's request in a round: one greedy token and the top max(2*beam_width, logprobs)
        logprobs (`logprobs`: what the caller shows per token, when it wants more than the candidates). Raises
        RequestError when that is more than the engine's max_logprobs."""
        k = max(self.num_candidates, logprobs or 0)
        if k > max_logprobs:
            raise RequestError(f"beam search with beam width {self.beam_width} asks the engine for the top {k} "
                               f"logprobs of each beam (2 x the width, or the logprobs asked for), more than "
                               f"max_logprobs={max_logprobs}; use a beam width of at most {max_logprobs // 2}, or "
                               "start the engine with a larger max_logprobs (--max-logprobs).")
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, output_kind=RequestOutputKind.FINAL_ONLY)


@dataclasses.dataclass
class BeamSequence:
    """One beam (vLLM's BeamSearchSequence): its tokens, prompt first, and per output token the engine's logprobs at
    that position (the chosen token's and the top alternatives)."""

    tokens: list[int]  # prompt + output; a beam ended by EOS has it last
    logprobs: list[dict[int, float]]  # one per output token
    cum_logprob: float = 0.0  # the output tokens' raw logprobs, summed
    finish_reason: str | None = None  # "stop" once an EOS ended it; None while live (reported as "length")
    stop_reason: int | None = None  # the EOS id that ended it
    text: str | None = None  # decode(tokens) (prompt included, vLLM's LLM.beam_search); set by run_beam_search


@dataclasses.dataclass
class BeamSearchOutput:
    """The result for one prompt (vLLM's): the best beams, best first; `error` when an engine request failed."""

    sequences: list[BeamSequence]
    error: str | None = None


class BeamSearch:
    """The beam search of one prompt: pending() gives the round's beams, advance() takes their candidates."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams, *,
                 eos_token_ids: Sequence[int]) -> None:
        assert params.max_tokens is not None, "resolve max_tokens against the context first"
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self._eos = frozenset(eos_token_ids)
        self.beams = [BeamSequence(list(prompt_token_ids), [])]  # live
        self.completed: list[BeamSequence] = []  # ended by EOS
        self.rounds = 0

    @property
    def done(self) -> bool:
        return self.rounds >= self.params.max_tokens or not self.beams

    def pending(self) -> list[list[int]]:
        """The token lists to run this round, one per live beam (none once done)."""
        return [] if self.done else [beam.tokens for beam in self.beams]

    def advance(self, candidates: Sequence[dict[int, float]]) -> None:
        """Take this round's engine logprobs, one dict (token -> raw logprob) per live beam, in pending() order."""
        assert not self.done and len(candidates) == len(self.beams), "one candidate dict per live beam"
        k = self.params.num_candidates
        live = []
        for beam, row in zip(self.beams, candidates):
            for token, logprob in sorted(row.items(), key=lambda kv: -kv[1])[:k]:
                seq = BeamSequence(beam.tokens + [token], beam.logprobs + [row], beam.cum_logprob + logprob)
                if token in self._eos and not self.params.ignore_eos:
                    seq.finish_reason, seq.stop_reason = "stop", token
                    self.completed.append(seq)
                else:
                    live.append(seq)
        # sorted() is stable: among equal scores, the earlier beam and its better-ranked token win.
        self.beams = sorted(live, key=lambda s: -s.cum_logprob)[: self.params.beam_width]
        self.rounds += 1

    def score(self, seq: BeamSequence) -> float:
        """vLLM's get_beam_search_score: cum_logprob / len ** length_penalty, a last EOS not counted in len."""
        length = len(seq.tokens) - (1 if seq.tokens[-1] in self._eos else 0)
        return seq.cum_logprob / (length ** self.params.length_penalty)

    def best(self) -> list[BeamSequence]:
        """The beam_width best of the finished and live beams, best first (call once done)."""
        return sorted(self.completed + self.beams, key=self.score, reverse=True)[: self.params.beam_width]

    def request_output(self, request_id: str, prompt: str | None, tokenizer: Any, *, logprobs: int | None,
                       metrics: RequestMetrics) -> RequestOutput:
        """The result as the server's RequestOutput (vLLM's serving beam_search): completion i is the i-th best beam;
        a beam's final EOS is left out of its tokens unless include_stop_str_in_output, and always out of its text;
        logprobs: None, or k for each token's logprob and its top-k alternatives."""
        outputs = []
        for i, beam in enumerate(self.best()):
            out_ids = beam.tokens[self.num_prompt_tokens:]
            rows = beam.logprobs
            text_ids = out_ids[:-1] if beam.finish_reason == "stop" else out_ids
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                out_ids, rows = text_ids, rows[:-1]
            text = _decode(tokenizer, text_ids, self.params.skip_special_tokens)
            lps = None if logprobs is None else [_top(row, t, logprobs) for t, row in zip(out_ids, rows)]
            outputs.append(CompletionOutput(
                index=i, text=text, token_ids=out_ids, delta_text=text, delta_token_ids=out_ids, logprobs=lps,
                cumulative_logprob=beam.cum_logprob, finish_reason=beam.finish_reason or "length",
                stop_reason=beam.stop_reason))
        return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=True, metrics=metrics)


def run_beam_search(engine: LLMEngine, prompts: Sequence[Any], params: BeamSearchParams, *,
                    request_ids: Iterator[str]) -> list[BeamSearchOutput]:
    """Beam search for every prompt on an LLMEngine that nothing else steps meanwhile (LLM.beam_search): each round
    runs the live beams of all prompts together. `request_ids` yields fresh engine request ids. A bad prompt raises
    RequestError before anything runs; an engine request that fails ends its prompt's search with `error` set."""
    processor = engine.input_processor
    step = params.step_params(max_logprobs=processor.limits.max_logprobs)
    searches, texts = [], []
    for prompt in prompts:
        processed = processor.process(prompt, SamplingParams(max_tokens=params.max_tokens))
        resolved = dataclasses.replace(params, max_tokens=processed.max_tokens)
        searches.append(BeamSearch(processed.prompt_token_ids, resolved, eos_token_ids=engine.plan.model.eos_token_ids))
        texts.append(processed.prompt)
    errors: dict[int, str] = {}
    while True:
        batch = [(k, tokens) for k, s in enumerate(searches) if k not in errors for tokens in s.pending()]
        if not batch:
            break
        ids = [next(request_ids) for _ in batch]
        finals = _run_round(engine, ids, [tokens for _, tokens in batch], step)
        rows: dict[int, list[dict[int, float]]] = {}
        for rid, (k, _) in zip(ids, batch):
            out = finals[rid].outputs[0]
            if out.finish_reason == "error":
                errors.setdefault(k, finals[rid].error or "a beam's engine request failed")
                continue
            assert out.logprobs, "a finished one-token request with logprobs has its token's row"
            rows.setdefault(k, []).append(out.logprobs[0])
        for k, row in rows.items():
            if k not in errors:
                searches[k].advance(row)
    results = []
    for k, search in enumerate(searches):
        if k in errors:
            results.append(BeamSearchOutput([], error=errors[k]))
            continue
        best = search.best()
        for beam in best:
            beam.text = _decode(engine.tokenizer, beam.tokens, params.skip_special_tokens)
        results.append(BeamSearchOutput(best))
    return results


def _run_round(engine: LLMEngine, ids: list[str], prompts: list[list[int]],
               step: SamplingParams) -> dict[str, RequestOutput]:
    """Add one request per beam, step until all have finished; their final outputs by id."""
    added = []
    try:
        for rid, tokens in zip(ids, prompts):
            engine.add_request(rid, tokens, step)
            added.append(rid)
    except BaseException:
        for rid in added:
            engine.abort(rid)
        raise
    finals: dict[str, RequestOutput] = {}
    wanted = set(ids)
    while len(finals) < len(ids):
        for out in engine.step():
            if out.finished and out.request_id in wanted:
                finals[out.request_id] = out
    return finals


def _top(row: dict[int, float], token: int, k: int) -> dict[int, float]:
    """A position's logprobs as a normal request reports them: the token's own first, then the top-k others."""
    ranked = sorted(row.items(), key=lambda kv: -kv[1])[:k]
    return {token: row[token], **{t: v for t, v in ranked if t != token}}


def _decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if tokenizer is not None else ""
