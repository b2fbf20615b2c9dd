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

Why xgrammar (benchmarks/structured_output_mask.py -> docs/benchmarks/structured_output_mask.json, SmolLM2's 49k
vocabulary, 2 shared CPU cores): filling the masks took a median 0.003 ms vs llguidance's 0.031 ms at batch 1 and
0.34 ms vs 15 ms at batch 64 (32 JSON-schema + 32 regex rows); accepting a token costs about the same; one grammar
compiles in 7-10 ms with either; reading the vocabulary once per engine took 1.2 s vs 7 s. Applying the mask to the
logits is the same call for both and dominates on a CPU. vLLM, SGLang and TensorRT-LLM default to xgrammar too.
"""

from __future__ import annotations

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


class GrammarMatcher:
    """The grammar state of one sequence: which tokens may come next. Advanced only by the Scheduler."""

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self.native = _xgrammar().GrammarMatcher(compiled)  # xgrammar's matcher; read by GrammarMasker

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it (the matcher is unchanged)."""
        return self.native.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted a stop token: nothing more may be generated."""
        return self.native.is_terminated()


class GrammarMasker:
    """Applies the grammar masks of one step's constrained rows to the logits, in place."""

    def __init__(self) -> None:
        self._batch = _xgrammar().BatchGrammarMatcher()

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """logits: float [N, vocab] on any device, row i = requests[i]; rows without a grammar are left as they are."""
        xgr = _xgrammar()
        rows = [i for i, r in enumerate(requests) if r.grammar is not None and not r.grammar.is_terminated]
        if not rows:
            return
        # int32 [N, ceil(vocab/32)] on the CPU, row i for logits row i; only the constrained rows are filled and applied.
        bitmask = xgr.allocate_token_bitmask(len(requests), logits.shape[1])
        self._batch.batch_fill_next_token_bitmask([requests[i].grammar.native for i in rows], bitmask, indices=rows)
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
