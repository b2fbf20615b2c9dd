"""Incremental detokenizer: token ids -> text deltas that are UTF-8 safe and stop-string safe.

Decoding token by token breaks in two ways: byte-level BPE splits one character over several tokens (a
lone token decodes to U+FFFD), and SentencePiece-style tokenizers drop or add a leading space depending on
what precedes. Both are solved by decoding a short window (prefix_offset .. end) and emitting only what
grew past the already-read part (the offset method of HF TGI and vLLM), and by holding text back while it
ends in U+FFFD. Stop strings are searched in the full text, so they are found across token boundaries;
the last len(longest stop) - 1 characters are held back until they cannot start a stop string.
"""

from __future__ import annotations

from typing import Sequence

from trtopt.runtime.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the output, so its first token gets the right leading space.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tok = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._hold = max(params.max_stop_len - 1, 0)
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context  # context + output ids
        self._num_context = len(context)
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(context)  # ids before this are already in `text`
        self.text = ""  # output text so far (cut at a stop string)
        self._emitted = 0  # characters of `text` already returned by take_delta
        self._stopped = False
        self._finished = False

    def update(self, output_token_ids: Sequence[int], *, stop_token: bool = False) -> str | None:
        """Take in the output ids not seen yet; return the stop string if one now appears in the text.

        stop_token: the last id ends the sequence (EOS or a stop token id). Its text is left out unless
        include_stop_str_in_output (vLLM's rule: with skip_special_tokens=False, "<|im_end|>" shows only then).
        """
        if self._stopped:
            return None
        new_ids = output_token_ids[len(self._ids) - self._num_context :]
        if stop_token and not self._include_stop:
            new_ids = new_ids[:-1]
        before = len(self.text)
        for token_id in new_ids:
            self._ids.append(token_id)
            self.text += self._decode_step(final=False)
        return self._find_stop(before)

    def finish(self) -> None:
        """The sequence ended: flush text held back (an incomplete character at the very end included)."""
        if not self._stopped and not self._finished:
            self.text += self._decode_step(final=True)
        self._finished = True

    def take_delta(self) -> str:
        """Text that is safe to stream now and has not been streamed yet."""
        limit = len(self.text) if (self._finished or self._stopped) else len(self.text) - self._hold
        if limit <= self._emitted:
            return ""
        delta = self.text[self._emitted : limit]
        self._emitted = limit
        return delta

    def _decode_step(self, *, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _find_stop(self, before: int) -> str | None:
        if not self._stop or len(self.text) == before:
            return None
        # Only a stop string ending in the new text can be new; it may start up to len-1 chars earlier.
        start = max(0, before - self._hold)
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self._include_stop else self.text[:i]
        self._emitted = min(self._emitted, len(self.text))
        self._stopped = True
        return s
