"""Speculative decoding: proposers (n-gram, draft model, self-draft) and exact verification."""

from trtopt.runtime.spec_decode.config import SpeculativeConfig
from trtopt.runtime.spec_decode.decoder import SpecDecoder, create_spec_decoder

__all__ = ["SpecDecoder", "SpeculativeConfig", "create_spec_decoder"]
