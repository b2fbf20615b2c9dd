"""The one rule for calibration and evaluation text (docs/architecture.md §7 for the error tiers).

Nothing may be downloaded, so the text is Python's own reference manual: ``pydoc_data.topics.topics``, which ships
with every CPython. The rule, fixed and deterministic (no sampling, so no seed to drift):

- the corpus is every topic's text, keys sorted, joined with a blank line, tokenized once with the model's tokenizer
  (no special tokens);
- calibration is the first ``num`` windows of ``length`` tokens, from the start of the stream;
- held-out evaluation is the last ``num`` windows of ``length`` tokens, ending at the end of the stream;
- when the tokenizer starts every text with BOS (Gemma), each window is run with that BOS in front (``with_bos``):
  a base model that expects BOS scores text far worse without it, and its BOS activations belong in calibration.

The two slices must not overlap (checked). Calibration (trtopt/quantize/calibrate.py) and the accuracy benchmark
(benchmarks/quant_accuracy.py) both read their tokens from here and nowhere else.

``CHAT_QUESTIONS`` are the chat prompts on which greedy output is compared (the SmolLM2 GPU e2e tests,
benchmarks/fp8_kv.py's agreement, benchmarks/w8a8_noise.py), kept here once so those runs speak of the same prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trtopt.errors import ConfigError

DEFAULT_CALIBRATION_SEQUENCES = 32
DEFAULT_CALIBRATION_LENGTH = 512
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "How do I boil an egg?",
    "What is 12 times 12?",
    "Name three primary colors.",
    "Explain what a CPU cache is in one paragraph.",
    "Give me a name for a pet turtle.",
)


def corpus_text() -> str:
    """The Python reference manual's topics, keys sorted, joined by a blank line."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def corpus_tokens(tokenizer) -> np.ndarray:
    """The whole corpus as token ids [n] int64 (an HF tokenizer; no BOS/EOS added)."""
    ids = tokenizer(corpus_text(), add_special_tokens=False).input_ids
    return np.asarray(ids, dtype=np.int64)


@dataclass(frozen=True)
class TextSlices:
    """Calibration and held-out windows of one tokenized corpus; each array is [num, length] int64."""

    calibration: np.ndarray
    heldout: np.ndarray
    corpus_tokens: int  # tokens in the whole stream


def split_windows(tokens: np.ndarray, *, calibration: tuple[int, int], heldout: tuple[int, int] = (0, 0)
                  ) -> TextSlices:
    """Cut ``tokens`` by the rule above; ``calibration``/``heldout`` are (num windows, window length)."""
    (cn, cl), (hn, hl) = calibration, heldout
    if min(cn, cl) <= 0 or min(hn, hl) < 0:
        raise ConfigError(f"calibration needs a positive number of sequences and length, got {cn} x {cl}.")
    need = cn * cl + hn * hl
    if need > len(tokens):
        raise ConfigError(f"{cn} x {cl} calibration tokens and {hn} x {hl} held-out tokens need {need} tokens, but "
                          f"the calibration text has {len(tokens)} with this tokenizer; ask for fewer or shorter "
                          "sequences.")
    calib = tokens[: cn * cl].reshape(cn, cl)
    held = tokens[len(tokens) - hn * hl:].reshape(hn, hl) if hn * hl else np.zeros((0, hl), np.int64)
    return TextSlices(calib, held, len(tokens))


def with_bos(windows: np.ndarray, tokenizer) -> np.ndarray:
    """[n, L] -> [n, 1 + L] with the tokenizer's BOS first when it starts every text with one; else ``windows``."""
    bos = tokenizer.bos_token_id
    if bos is None or tokenizer("a").input_ids[:1] != [bos]:
        return windows
    return np.concatenate([np.full((len(windows), 1), bos, np.int64), windows], axis=1)


def load_tokenizer(model_dir):
    """The model directory's HF tokenizer (the files `trtopt export` copies next to model.onnx)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
