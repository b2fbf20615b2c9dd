"""SpeculativeConfig: which proposer guesses the next tokens, and how many (vLLM's `speculative_config` keys).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "out/draft_plan", "num_speculative_tokens": 4}
    {"method": "self_draft", "num_layers": 8, "num_speculative_tokens": 4}   # plan/draft_8, built by --draft-layers 8

A bad value is a ConfigError naming the key and what to change.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from trtopt.errors import ConfigError

METHODS = ("ngram", "draft_model", "self_draft")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # K: draft tokens proposed (and verified) per step and sequence
    prompt_lookup_max: int = 4  # ngram: longest suffix matched against the history
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    model: str | None = None  # draft_model: the draft plan dir
    num_layers: int | None = None  # self_draft: N, the target's first N layers

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """A dict (the API), a JSON string (the CLI) or a SpeculativeConfig; None turns speculation off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON ({e}); pass e.g. "
                                  '\'{"method": "ngram", "num_speculative_tokens": 4}\'.') from e
        if not isinstance(value, Mapping):
            raise ConfigError(f"speculative_config must be a dict, got {type(value).__name__}.")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ConfigError(f"speculative_config has unknown keys {unknown}; the keys are {sorted(fields)}.")
        if "method" not in value:
            raise ConfigError(f"speculative_config needs 'method', one of {list(METHODS)}.")
        if "num_speculative_tokens" not in value:
            raise ConfigError("speculative_config needs 'num_speculative_tokens' (K, e.g. 4).")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config method {self.method!r} is unknown; choose one of {list(METHODS)}.")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"num_speculative_tokens={k!r} must be an integer >= 1 (e.g. 4).")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ConfigError(f"prompt_lookup_min={lo!r}, prompt_lookup_max={hi!r}: they must be integers with "
                                  "1 <= prompt_lookup_min <= prompt_lookup_max.")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("method 'draft_model' needs 'model': a plan dir built by `trtopt build`.")
        if self.method == "self_draft":
            n = self.num_layers
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"method 'self_draft' needs 'num_layers' >= 1 (the target layers the draft runs), "
                                  f"got {n!r}.")
