"""Per-token grammar-mask cost of xgrammar and llguidance on SmolLM2's 49k vocabulary (the choice behind
trtopt/runtime/structured_output.py).

Each matcher walks a fixed, valid token sequence (a JSON document, a regex match) so both libraries see exactly
the same states. One timed step, for a batch of B matchers: fill every row's token bitmask, apply the bitmask to
float32 logits [B, vocab] and accept one token per matcher, which is all a sampler adds per step. Both libraries'
bitmasks are applied by the same call (trtopt.runtime.structured_output.apply_bitmask, what the sampler runs:
xgrammar's kernel), so `apply` is the same for both and the libraries differ in fill, accept and compile. Batch 1 uses
the single-matcher calls; batch 64 uses each library's own batch call (xgrammar's BatchGrammarMatcher,
llguidance's fill_next_token_bitmask_par), which spread rows over threads. Grammar compile times are reported
apart (they are paid once per request, or once per schema with a cache).

    python benchmarks/structured_output_mask.py --out docs/benchmarks/structured_output_mask.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from trtopt.runtime.structured_output import apply_bitmask

SCHEMA = {  # nested objects, an enum, an array of objects and bounded numbers
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 8},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "integer"}},
                                             "required": ["k", "v"], "additionalProperties": False}},
    },
    "required": ["name", "age", "role", "address", "scores", "tags"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "role": "admin", "address": {"city": "London", "zip": "W1 1AA"},
            "scores": [9.5, 8.25, 10], "tags": [{"k": "field", "v": 1}, {"k": "era", "v": 1843}]}
REGEX = r"(\d{3})-(\d{3})-(\d{4}) [A-Z][a-z]+ [A-Z][a-z]+"
REGEX_TEXT = "555-123-4567 Grace Hopper"


def load_tokenizer():
    from trtopt.export.models import resolve_model  # the bundled SmolLM2 (converted once, cached)

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, kind: str, spec):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
        return self.compiler.compile_regex(spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int, vocab: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, vocab)

    def fill(self, matchers, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str, spec):
        if kind == "json":
            return self.llg.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        return self.llg.LLMatcher.grammar_from_regex(spec)

    def matcher(self, compiled):
        m = self.llg.LLMatcher(self.tok, compiled)
        assert not m.is_error(), m.get_error()
        return m

    def bitmask(self, batch: int, vocab: int) -> torch.Tensor:
        return self.llg.torch.allocate_token_bitmask(batch, vocab)

    def fill(self, matchers, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            self.llg.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


def reference_tokens(tokenizer) -> dict[str, list[int]]:
    """The token sequences the matchers walk: compact JSON (',' and ':' with no spaces) and the regex match.
    Both grammars end with the EOS token, as a sampler would send it."""
    eos = tokenizer.eos_token_id
    doc = json.dumps(DOCUMENT, separators=(",", ":"))
    return {"json": tokenizer(doc, add_special_tokens=False).input_ids + [eos],
            "regex": tokenizer(REGEX_TEXT, add_special_tokens=False).input_ids + [eos]}


def run_batch(lib, compiled: dict, tokens: dict[str, list[int]], batch: int, vocab: int, repeats: int) -> dict:
    """Per-step times (fill + apply + accept) of `batch` matchers, half JSON and half regex for batch > 1."""
    kinds = ["json"] if batch == 1 else [("json", "regex")[i % 2] for i in range(batch)]
    steps = min(len(tokens[k]) for k in set(kinds))
    fill_t, apply_t, accept_t = [], [], []
    for _ in range(repeats):
        matchers = [lib.matcher(compiled[k]) for k in kinds]
        bitmask = lib.bitmask(batch, vocab)
        logits = torch.randn(batch, vocab)
        rows = list(range(batch))
        for s in range(steps):
            t0 = time.perf_counter()
            lib.fill(matchers, bitmask)
            t1 = time.perf_counter()
            apply_bitmask(logits, bitmask, rows)
            t2 = time.perf_counter()
            for m, k in zip(matchers, kinds):
                ok = lib.accept(m, tokens[k][s])
                assert ok, f"{lib.name} rejected token {s} of the {k} reference"
            t3 = time.perf_counter()
            fill_t.append(t1 - t0)
            apply_t.append(t2 - t1)
            accept_t.append(t3 - t2)
    total = [a + b + c for a, b, c in zip(fill_t, apply_t, accept_t)]

    def ms(xs):
        xs = sorted(xs)
        return {"mean": statistics.fmean(xs) * 1e3, "p50": xs[len(xs) // 2] * 1e3, "p90": xs[int(len(xs) * 0.9)] * 1e3}

    return {"batch": batch, "steps_timed": len(total), "step_ms": ms(total), "fill_ms": ms(fill_t),
            "apply_ms": ms(apply_t), "accept_ms": ms(accept_t)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/structured_output_mask.json"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    vocab = len(tokenizer)
    tokens = reference_tokens(tokenizer)
    results = []
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        lib = cls(tokenizer, vocab)
        setup_ms = (time.perf_counter() - t0) * 1e3
        compile_ms = {}
        compiled = {}
        for kind, spec in (("json", SCHEMA), ("regex", REGEX)):
            t0 = time.perf_counter()
            compiled[kind] = lib.compile(kind, spec)
            lib.matcher(compiled[kind])  # llguidance builds its lexer when the first matcher is made
            compile_ms[kind] = (time.perf_counter() - t0) * 1e3
        runs = [run_batch(lib, compiled, tokens, b, vocab, args.repeats) for b in (1, 64)]
        results.append({"library": lib.name, "tokenizer_setup_ms": setup_ms, "compile_ms": compile_ms, "runs": runs})
        for r in runs:
            print(f"{lib.name:10s} batch {r['batch']:3d}: step {r['step_ms']['mean']:.3f} ms (fill {r['fill_ms']['mean']:.3f}, "
                  f"apply {r['apply_ms']['mean']:.3f}, accept {r['accept_ms']['mean']:.3f}); compile {compile_ms}")
    from importlib.metadata import version

    out = {
        "benchmark": "structured_output_mask",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "versions": {"xgrammar": version("xgrammar"), "llguidance": version("llguidance"), "torch": torch.__version__},
        "vocab": vocab,
        "reference_tokens": {k: len(v) for k, v in tokens.items()},
        "notes": ("Times in ms per decode step for the whole batch, on a 2-core CPU shared with other jobs (expect noise; "
                  "compare the libraries within this file). Batch 64 = 32 JSON-schema + 32 regex matchers at the same "
                  "step. fill = computing the bitmask, apply = masking float32 logits [B, vocab] on the CPU with trtopt's "
                  "apply_bitmask (xgrammar's CPU kernel; the same for both), accept = advancing every matcher by one token. tokenizer_setup_ms = "
                  "reading the vocabulary once per engine; compile_ms = one grammar, cache off."),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
