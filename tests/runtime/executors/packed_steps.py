"""One packed step sequence that the executor tests compare across variants of a plan or an executor."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trtopt.check.driver import BlockSource, Seq, make_step


def prefill_then_decode(ex, block_size: int,
                        chunks: Sequence[Sequence[int]] = ((20, 7),)) -> list[torch.Tensor]:
    """Logits of every step on a fresh 16-block pool: two sequences of 20 and 7 prompt tokens prefilled in `chunks`
    (tokens of each sequence per step; the default is one packed prefill), then one decode step of both, each with
    a new token 5."""
    ex.allocate_kv_cache(16)
    source = BlockSource(16)
    seqs = [Seq(list(range(3, 3 + n))) for n in (20, 7)]
    outs = [ex.execute(make_step(seqs, list(chunk), block_size, source)) for chunk in chunks]
    for seq in seqs:
        seq.tokens.append(5)
    outs.append(ex.execute(make_step(seqs, [1, 1], block_size, source)))
    return outs
