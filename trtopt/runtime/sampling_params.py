"""SamplingParams: how one request is decoded (vLLM's field names, so users' code carries over).

Every field is validated on construction; a bad value raises RequestError naming the field and the
allowed range, so a caller (or the HTTP server, as a 400) can tell the user what to fix. Every field has a
bound, so no value can make the sampler or the detokenizer fail or stall later; the bounds that depend on the
plan or the engine (n <= max_num_seqs, top_k <= vocab, prompt + max_tokens <= max_model_len, logprobs and
prompt_logprobs <= max_logprobs) are checked by the InputProcessor, which knows them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import json as _json
import math
from typing import Any, Callable, Mapping

from trtopt.errors import RequestError

# A temperature below this is treated as greedy: dividing logits by ~0 only produces inf/nan.
_GREEDY_EPS = 1e-5

# Documented limits (README "Limits"). MAX_TEMPERATURE: logits / 100 already make any distribution of a real
# model near-uniform; larger values only risk overflow-free nonsense. DEFAULT_MAX_LOGPROBS is the engine's default
# cap on logprobs and prompt_logprobs (EngineConfig.max_logprobs, vLLM's --max-logprobs): OpenAI's top_logprobs limit.
# The stop-string limits bound the detokenizer's per-token search (it holds back max_stop_len characters).
MAX_TEMPERATURE = 100.0
DEFAULT_MAX_LOGPROBS = 20
ALL_LOGPROBS = -1  # logprobs / prompt_logprobs = -1: the whole vocabulary (vLLM's)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes [-2**63, 2**64); seeds are in [0, 2**63)
# bad_words: vLLM's own caps (MAX_NUM_BAD_WORDS); each word is tokenized twice (with and without a leading space).
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: -100 bans a token, +100 forces it in practice

# A logits processor (vLLM's v0 style): (output_token_ids, logits) -> logits, or
# (prompt_token_ids, output_token_ids, logits) -> logits; logits is the request's own row, float32 [vocab].
LogitsProcessor = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrains a request's output to a grammar (vLLM's `StructuredOutputsParams`; set exactly one field).

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex: a regular expression the whole
    output matches; choice: exactly one of these strings; grammar: a context-free grammar, xgrammar/GBNF EBNF
    (`root ::= ...`) or Lark (`start: ...`). Grammars are compiled when the request is added, so a bad spec is a
    RequestError there (a 400 from the server), never a failed step.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON with no whitespace beyond ", " and ": " (vLLM's option)

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_fields = [f for f in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, f) not in (None, False)]
        if len(set_fields) != 1:
            raise RequestError(
                f"StructuredOutputsParams needs exactly one of json, regex, choice, grammar, json_object; got {set_fields or 'none'}."
            )
        if self.json is not None:
            _check(isinstance(self.json, (str, dict)), "structured_outputs.json", self.json, "a JSON schema (a dict or JSON text)")
            if isinstance(self.json, str):
                try:
                    _json.loads(self.json)
                except ValueError as e:
                    raise RequestError(f"structured_outputs.json is not valid JSON ({e}); send a JSON schema.") from e
        _check(self.regex is None or (isinstance(self.regex, str) and self.regex != ""), "structured_outputs.regex", self.regex, "a non-empty string")
        _check(self.choice is None or (isinstance(self.choice, tuple) and bool(self.choice) and all(isinstance(c, str) and c for c in self.choice)),
               "structured_outputs.choice", self.choice, "a non-empty list of non-empty strings")
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""), "structured_outputs.grammar", self.grammar, "a non-empty grammar text")

    @property
    def kind(self) -> tuple[str, object]:
        """(field name, value) of the one constraint that is set."""
        for f in ("json", "regex", "choice", "grammar", "json_object"):
            value = getattr(self, f)
            if value not in (None, False):
                return f, value
        raise AssertionError("validated in __post_init__")


class RequestOutputKind(enum.Enum):
    """Which RequestOutputs the engine makes for a request (vLLM's RequestOutputKind, without DELTA)."""

    # One every step the request gets a token or finishes: everything so far plus that step's delta (streaming).
    CUMULATIVE = "cumulative"
    # One, when the request finishes (what LLM.generate returns). The engine then builds no per-step output, whose
    # cumulative token list costs O(length) per running request per step.
    FINAL_ONLY = "final_only"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Decoding options of one request. Frozen: the engine never writes back into it."""

    n: int = 1  # completions per prompt; they share the prompt's KV blocks (copy-on-write)
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    top_p: float = 1.0  # keep the smallest set whose probability mass reaches top_p; 1 = off
    min_p: float = 0.0  # drop tokens whose probability < min_p * the top probability; 0 = off
    repetition_penalty: float = 1.0  # CTRL-style, over prompt + output tokens; 1 = off
    presence_penalty: float = 0.0  # subtracted once for every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    seed: int | None = None  # completion i of this request uses seed + i; reproducible whatever the batch
    max_tokens: int | None = 16  # None = until max_model_len
    min_tokens: int = 0  # EOS and stop token ids are ignored before this many tokens
    stop: tuple[str, ...] = ()  # stop strings; the output is cut before the first one
    # Extra token ids that end the sequence. Like EOS, the stop token stays in token_ids, but its text is left out
    # of the text unless include_stop_str_in_output (vLLM's rule, also with skip_special_tokens=False).
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None = none; k >= 0 = logprob of the chosen token plus the top-k alternatives; -1 = the whole vocabulary
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output to a JSON schema, regex, ...
    # None = none; k >= 0 = for every prompt token after the first, its logprob given the tokens before it plus
    # the top-k alternatives (RequestOutput.prompt_logprobs); -1 = the whole vocabulary. Such a request is never
    # served from the prefix cache.
    prompt_logprobs: int | None = None
    # Token controls, applied in this order before penalties and any filtering (the logprobs stay raw):
    logits_processors: tuple[LogitsProcessor, ...] = ()  # offline only; see LogitsProcessor above
    allowed_token_ids: tuple[int, ...] | None = None  # only these tokens can be generated
    bad_words: tuple[str, ...] = ()  # words never generated (as a whole token sequence; see InputProcessor)
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens; -1 = the last max_model_len - 1
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # or "final_only": one output, at the end

    def __post_init__(self) -> None:
        # Accept the usual loose spellings (a single stop string, lists) but store tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        if callable(self.logits_processors):
            object.__setattr__(self, "logits_processors", (self.logits_processors,))
        for name in ("stop", "stop_token_ids", "bad_words", "logits_processors"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, (list, tuple)), name, value, "a list")
            object.__setattr__(self, name, tuple(value or ()))
        if self.allowed_token_ids is not None:
            _check(isinstance(self.allowed_token_ids, (list, tuple)), "allowed_token_ids", self.allowed_token_ids, "a list of token ids or None")
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, Mapping), "logit_bias", self.logit_bias, "a dict of token id -> bias, or None")
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))  # a private copy: the caller's may change
        if isinstance(self.output_kind, str):
            kinds = {k.value: k for k in RequestOutputKind}
            _check(self.output_kind in kinds, "output_kind", self.output_kind, f"one of {sorted(kinds)}")
            object.__setattr__(self, "output_kind", kinds[self.output_kind])
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind", self.output_kind,
               "a RequestOutputKind or one of 'cumulative', 'final_only'")
        self._validate()
        self._validate_token_controls()

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(_is_num(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE, "temperature", self.temperature,
               f"a finite number in [0, {MAX_TEMPERATURE:g}]")
        _check(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k", self.top_k,
               "0 or -1 (off) or an integer >= 1 (at most the vocabulary size)")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        _check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "a number > 0")
        _check(_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "a number in [-2, 2]")
        _check(_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "a number in [-2, 2]")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed and self.seed + self.n <= SEED_LIMIT),
               "seed", self.seed, "None or an integer in [0, 2**63) (with seed + n - 1 < 2**63: completion i uses seed + i)")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens", self.max_tokens, "an integer >= 1 or None")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"<{len(self.stop)} strings>",
               f"at most {MAX_STOP_STRINGS} strings")
        _check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
               _short(self.stop), f"non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        for s in self.stop:
            check_text(s, "a stop string")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"<{len(self.stop_token_ids)} ids>",
               f"at most {MAX_STOP_TOKEN_IDS} token ids")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", _short(self.stop_token_ids),
               "token ids >= 0")
        _check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= ALL_LOGPROBS), "logprobs",
               self.logprobs, "None, -1 (the whole vocabulary) or an integer >= 0 (at most the engine's max_logprobs)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")
        if self.structured_outputs is not None:
            # EOS is the grammar's own end; banning it before min_tokens could leave no allowed token at all.
            _check(self.min_tokens == 0, "min_tokens", self.min_tokens, "0 with structured_outputs (the grammar decides where the output ends)")

    def _validate_token_controls(self) -> None:
        """The bounds of prompt_logprobs and the token controls that need no plan (InputProcessor checks the ids
        against the vocabulary)."""
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= ALL_LOGPROBS),
               "prompt_logprobs", self.prompt_logprobs,
               "None, -1 (the whole vocabulary) or an integer >= 0 (at most the engine's max_logprobs)")
        for proc in self.logits_processors:
            _check(callable(proc) and _processor_arity(proc) in (2, 3), "logits_processors", proc,
                   "callables taking (output_token_ids, logits) or (prompt_token_ids, output_token_ids, logits)")
        if self.allowed_token_ids is not None:
            _check(bool(self.allowed_token_ids) and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                   "allowed_token_ids", _short(self.allowed_token_ids), "None or a non-empty list of token ids >= 0")
        _check(len(self.bad_words) <= MAX_BAD_WORDS, "bad_words", f"<{len(self.bad_words)} words>", f"at most {MAX_BAD_WORDS} words")
        _check(all(isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words), "bad_words",
               _short(self.bad_words), f"non-blank strings of at most {MAX_BAD_WORD_CHARS} characters")
        for w in self.bad_words:
            check_text(w, "a bad word")
        if self.logit_bias is not None:
            _check(all(_is_int(t) and t >= 0 for t in self.logit_bias), "logit_bias", _short(self.logit_bias),
                   "a dict whose keys are token ids >= 0")
            _check(all(_is_num(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in self.logit_bias.values()), "logit_bias",
                   _short(self.logit_bias), f"a dict whose values are numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        _check(self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens) and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)),
               "truncate_prompt_tokens", self.truncate_prompt_tokens, "None, -1 (the context length) or an integer >= 1")

    @property
    def has_token_controls(self) -> bool:
        """Anything that changes logits per request before sampling: logits processors, allowed or bad tokens, biases."""
        return bool(self.logits_processors or self.allowed_token_ids is not None or self.bad_words or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the argmax or asks for more than the token (min_tokens aside, which
        depends on the sequence): the sampler's one-argmax path. Cached: the sampler asks it for every row of every
        step, and the params are frozen."""
        return (self.greedy and self.logprobs is None and not self.has_token_controls and self.repetition_penalty == 1
                and self.presence_penalty == 0 and self.frequency_penalty == 0)

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def for_completion(self, index: int) -> SamplingParams:
        """The params of completion `index` of an n>1 request: n=1 and its own seed (seed + index)."""
        seed = None if self.seed is None else self.seed + index
        # The prompt's logprobs are the request's, computed once by completion 0 (the one that prefills).
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def num_logprobs(k: int, vocab_size: int) -> int:
    """A logprobs / prompt_logprobs value (not None) as a count of alternatives: -1 is the whole vocabulary."""
    return vocab_size if k == ALL_LOGPROBS else k


def _processor_arity(proc: Callable[..., Any]) -> int | None:
    """Positional parameters of a logits processor (2 or 3 are valid); None if it has no inspectable signature."""
    try:
        params = inspect.signature(proc).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # no nan, no inf


def check_text(text: str, what: str) -> int:
    """Refuse text that is not valid Unicode (a lone UTF-16 surrogate, which JSON's \\ud800 can carry: the
    tokenizer and every UTF-8 writer fail on it). Returns its UTF-8 size in bytes."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} is not valid Unicode: {e.reason} at character {e.start}; send valid UTF-8 text.") from None


def _short(value: object, limit: int = 200) -> str:
    text = repr(value)  # repr escapes surrogates, so the message itself can always be sent
    return text if len(text) <= limit else text[:limit] + "..."


def _check(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise RequestError(f"SamplingParams.{field}={value!r} is invalid: it must be {allowed}.")

