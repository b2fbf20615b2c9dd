"""Structured output: grammars compiled with xgrammar, one matcher per sequence, a batched token mask.

Three parts, one owner each:
  - `GrammarCompiler` (owned by the engine) turns a request's StructuredOutputsParams into an xgrammar
    CompiledGrammar, once per request, cached per spec; a spec xgrammar cannot compile is a RequestError.
  - A `GrammarMatcher` per sequence lives on its Request (`Request.grammar`). The Scheduler advances it with every
    token it appends (`accept`), exactly as it appends the token, so its state always matches the output tokens,
    preemption included (a preempted sequence keeps its output tokens and recomputes their K/V only).
  - `GrammarMasker` (owned by the Sampler) fills one int32 bitmask [N, ceil(vocab/32)] for the constrained rows
    of a step with xgrammar's batch call (C++ threads, no Python loop over the vocabulary), moves it to the logits'
    device and sets disallowed logits to -inf there with xgrammar's kernel, for the constrained rows only.

A reasoning reply (a server with --reasoning-parser, the request in thinking mode) gets a `ReasoningGatedGrammar`:
its matcher lets the reasoning run free and starts the grammar at the token after the reasoning end tag
(`</think>`), as vLLM's structured-output manager waits for its reasoning parser's is_reasoning_end. A model that
opens its reasoning itself (Qwen3's `<think>`) may do so as its first token; a reply that does not has no reasoning
and is the grammar's from its first token (as trtopt's qwen3 split reads such a reply: all content).

Why xgrammar (benchmarks/structured_output_mask.py -> docs/benchmarks/structured_output_mask.json, SmolLM2's 49k
vocabulary, 2 shared CPU cores): filling the masks took a median 0.003 ms vs llguidance's 0.031 ms at batch 1 and
0.34 ms vs 15 ms at batch 64 (32 JSON-schema + 32 regex rows); accepting a token costs about the same; one grammar
compiles in 7-10 ms with either; reading the vocabulary once per engine took 1.2 s vs 7 s. Applying the mask to the
logits is the same call for both and dominates on a CPU. vLLM, SGLang and TensorRT-LLM default to xgrammar too.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any, Sequence

import torch

from trtopt.errors import RequestError
from trtopt.runtime.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

    from trtopt.runtime.request import Request

# JSON text as `json.dumps` writes it. Arbitrary whitespace (vLLM's default) lets a small model loop on newlines
# until max_tokens; a bounded run keeps pretty-printing possible. disable_any_whitespace=True removes it entirely.
_MAX_WHITESPACE = 4


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # an optional dependency disables only structured output
        raise RequestError("structured output needs the xgrammar package: pip install 'trtopt[structured]'.") from e
    return xgrammar


class GrammarCompiler:
    """StructuredOutputsParams -> xgrammar CompiledGrammar for one tokenizer (built once per engine, on first use).

    tokenizer: the plan's HF tokenizer; vocab_size: the logits' width (may exceed len(tokenizer));
    eos_token_ids: the tokens that end a sequence, allowed by a grammar only once it is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)

    def compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """RequestError naming the field when xgrammar rejects the spec (the server answers it with a 400)."""
        field, _ = spec.kind
        try:
            return self._compile(spec)
        except RequestError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError/InvalidJSONError with the parser's message
            raise RequestError(f"structured_outputs.{field} could not be compiled into a grammar: {_first_line(e)}") from e

    def _compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        c = self._compiler
        ws = {"any_whitespace": not spec.disable_any_whitespace, "max_whitespace_cnt": _MAX_WHITESPACE}
        if spec.disable_any_whitespace:
            ws = {"any_whitespace": False, "separators": (", ", ": ")}
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return c.compile_json_schema(schema, strict_mode=True, **ws)
        if spec.json_object:
            return c.compile_json_schema('{"type": "object"}', strict_mode=False, **ws)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            # One literal per choice, written as a JSON string literal (xgrammar's EBNF takes the same escapes).
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
        assert spec.grammar is not None, f"unhandled structured output kind {spec.kind}"
        if "::=" in spec.grammar:  # GBNF/EBNF as xgrammar and vLLM take it; otherwise Lark (llguidance's syntax)
            return c.compile_grammar(spec.grammar)
        return c.compile_lark(spec.grammar)

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> GrammarMatcher:
        return GrammarMatcher(compiled)


@dataclasses.dataclass(frozen=True)
class ReasoningGatedGrammar:
    """A compiled grammar that holds only after the reply's reasoning: from the token after the first occurrence
    of `reasoning_end_ids` (the end tag's token ids, e.g. Qwen3's one `</think>` token) among the generated
    tokens. Until then every token is allowed; a reply that never ends its reasoning is never constrained.

    reasoning_start_ids: empty when the reply starts inside its reasoning (the template opened it: DeepSeek-R1).
    Otherwise the tag the model writes to open it (Qwen3's `<think>`): the first token is the grammar's or the
    tag's first token; a reply that opens the tag is held to the rest of it and then reasons, any other reply is
    the grammar's from its first token (it has no reasoning)."""

    compiled: xgrammar.CompiledGrammar
    reasoning_end_ids: tuple[int, ...]
    reasoning_start_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.reasoning_end_ids, "a reasoning end tag has at least one token"


class GrammarMatcher:
    """The grammar state of one sequence: which tokens may come next. Advanced only by the Scheduler.

    compiled: a CompiledGrammar (it holds from the first token), or a ReasoningGatedGrammar (it holds from the
    token after the reasoning end)."""

    def __init__(self, compiled: xgrammar.CompiledGrammar | ReasoningGatedGrammar) -> None:
        self._reasoning_end: tuple[int, ...] = ()  # non-empty while the reply reasons: the tag that ends it
        self._tail: list[int] = []  # the last generated tokens, as many as the tag has (while reasoning)
        self._opening: tuple[int, ...] = ()  # the rest of the start tag the reply may still write (or must)
        self._opened = False  # the reply has written the start tag's first token: it must finish the tag
        if isinstance(compiled, ReasoningGatedGrammar):
            self._reasoning_end = compiled.reasoning_end_ids
            self._opening = compiled.reasoning_start_ids
            compiled = compiled.compiled
        self.native = _xgrammar().GrammarMatcher(compiled)  # xgrammar's matcher; read by GrammarMasker

    @property
    def is_reasoning(self) -> bool:
        """The grammar does not hold yet: the reply reasons (no mask, tokens not matched), or may still open its
        reasoning (`opening`)."""
        return bool(self._reasoning_end)

    @property
    def opening(self) -> tuple[int, bool] | None:
        """While the reply may open its reasoning: (the start tag's next token, whether the grammar's tokens are
        allowed too: only for the first token); None otherwise."""
        if not self._opening:
            return None
        return self._opening[0], not self._opened

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it (the matcher is unchanged).
        While reasoning every token is accepted; the one that completes the end tag starts the grammar."""
        if self._opening:
            if token_id == self._opening[0]:  # the start tag, token by token: then the reply reasons
                self._opening, self._opened = self._opening[1:], True
                return True
            if self._opened:
                return False  # a started tag must be finished (the mask allowed nothing else)
            self._opening, self._reasoning_end = (), ()  # no reasoning: the grammar holds from this token
            return self.native.accept_token(token_id)
        if self._reasoning_end:
            self._tail = [*self._tail, token_id][-len(self._reasoning_end):]
            if tuple(self._tail) == self._reasoning_end:
                self._reasoning_end, self._tail = (), []
            return True
        return self.native.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted a stop token: nothing more may be generated."""
        return not self._reasoning_end and self.native.is_terminated()

    @property
    def constrains(self) -> bool:
        """The next token is masked: the grammar holds (reasoning over) and is not complete yet, or the reply may
        still open its reasoning (the grammar's tokens or the start tag's next one)."""
        return bool(self._opening) or (not self._reasoning_end and not self.native.is_terminated())


class GrammarMasker:
    """Applies the grammar masks of one step's constrained rows to the logits, in place."""

    def __init__(self) -> None:
        self._batch = _xgrammar().BatchGrammarMatcher()

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """logits: float [N, vocab] on any device, row i = requests[i]; rows without a grammar are left as they are."""
        xgr = _xgrammar()
        rows = [i for i, r in enumerate(requests) if r.grammar is not None and r.grammar.constrains]
        if not rows:
            return
        # int32 [N, ceil(vocab/32)] on the CPU, row i for logits row i; only the constrained rows are filled and applied.
        bitmask = xgr.allocate_token_bitmask(len(requests), logits.shape[1])
        self._batch.batch_fill_next_token_bitmask([requests[i].grammar.native for i in rows], bitmask, indices=rows)
        for i in rows:
            opening = requests[i].grammar.opening
            if opening is not None:  # a reply that may open its reasoning: the start tag's next token is allowed too
                tag_token, with_grammar = opening
                if not with_grammar:
                    bitmask[i] = 0
                bit = tag_token % 32  # int32 words: bit 31 is the sign bit
                bitmask[i, tag_token // 32] |= (1 << bit) if bit < 31 else -(1 << 31)
        apply_bitmask(logits, bitmask, rows)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[i, t] = -inf for i in rows where bit t%32 of bitmask[i, t//32] is 0 (xgrammar's kernel: a CUDA
    kernel for CUDA logits, a C++ loop on the CPU; both beat unpacking the bits with torch ops, measured)."""
    xgr = _xgrammar()
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


def _first_line(e: Exception) -> str:
    """xgrammar's message without its "[time] /project/cpp/file.cc:line: " prefix."""
    text = (str(e).strip() or type(e).__name__).splitlines()[0]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)[:300]
