"""Verification: exact rejection sampling of draft tokens against the target (Leviathan et al. 2023, Chen et al.
2023; vLLM's rejection sampler is the reference).

For draft tokens d_1..d_K drawn from q_1..q_K and the target's distributions p_1..p_{K+1} at the same positions:
accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), in order, stopping at the first rejection; after a
rejection at j draw one token from norm(max(0, p_j - q_j)); when all K are accepted draw the bonus token from
p_{K+1}. Every sequence produced this way has exactly the target's distribution.

Both p and q are *processed* distributions (sampler.processed_probs): min_tokens masking, penalties,
temperature, top-k, top-p and min-p are applied to the target's and the draft's logits alike, each row with the
context it is conditioned on (the committed tokens plus the drafts before it, so a penalty counts the earlier
draft tokens as output). Greedy requests are the one-hot case: p_j is one-hot at the target's argmax, so a draft
token is accepted exactly when it is that argmax and the token after the run is the argmax: greedy output is the
non-speculative output token for token. A deterministic proposer (n-gram) has q_j one-hot at d_j.

Randomness: each sequence draws K + 1 uniforms per verification from its own generator (the request's seeded
one, else the engine's), whatever happens, so a seeded request's tokens do not depend on the batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from trtopt.runtime.request import Request, TokenCounts
from trtopt.runtime.sampler import processed_probs


class DraftContext(TokenCounts):
    """A request seen `extra` draft tokens further on: what the sampler's processing reads of a Request."""

    def __init__(self, req: Request, extra: Sequence[int]) -> None:
        self.params = req.params
        self.eos_token_ids = req.eos_token_ids
        self.num_prompt_tokens = req.num_prompt_tokens
        self.token_ids = req.token_ids + list(extra) if extra else req.token_ids
        self.generator = req.generator


def contexts(req: Request, drafts: Sequence[int]) -> list[DraftContext]:
    """The K+1 contexts of a verification: after 0, 1, .., K draft tokens."""
    return [DraftContext(req, drafts[:j]) for j in range(len(drafts) + 1)]


def draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw of one token from probs [V] with the uniform u."""
    cdf = probs.cumsum(dim=0)
    return int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1)).clamp_(max=probs.shape[0] - 1))


def verify_one(target_probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
               generator: torch.Generator) -> tuple[list[int], int]:
    """target_probs [K+1, V] (p), drafts (K tokens), draft_probs [K, V] (q) or None (one-hot).

    Returns (tokens to append: the accepted drafts then one drawn token, number of accepted drafts).
    """
    k = len(drafts)
    u = torch.rand(k + 1, generator=generator).tolist()  # always K+1: the stream does not depend on the outcome
    d = torch.tensor(drafts, dtype=torch.int64)
    p_d = target_probs[torch.arange(k), d].tolist()
    q_d = draft_probs[torch.arange(k), d].tolist() if draft_probs is not None else [1.0] * k
    accepted = 0
    while accepted < k and u[accepted] * q_d[accepted] < p_d[accepted]:  # w.p. min(1, p/q)
        accepted += 1
    if accepted == k:
        final = target_probs[k]  # the bonus token
    else:
        q = draft_probs[accepted] if draft_probs is not None else torch.nn.functional.one_hot(d[accepted], target_probs.shape[1]).float()
        final = (target_probs[accepted] - q).clamp_(min=0)
        if float(final.sum()) <= 0:  # p == q up to rounding: a rejection was (numerically) impossible
            final = target_probs[accepted]
    return drafts[:accepted] + [draw(final, u[k])], accepted


def greedy_verify(target_argmax: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """The one-hot case without probabilities: accept while the draft equals the target's argmax."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_argmax[accepted]:
        accepted += 1
    return drafts[:accepted] + [target_argmax[accepted]], accepted


def plain_greedy(req: Request) -> bool:
    """Greedy with nothing that changes the argmax (penalties, min_tokens): verified by argmax alone, and a draft
    model's q is never read for it (the one-hot case above)."""
    p = req.params
    return (p.greedy and p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0
            and p.min_tokens == 0)


def target_probs_for(logits: torch.Tensor, req: Request, drafts: list[int]) -> torch.Tensor:
    """The K+1 processed target distributions of one verifying sequence (its logits rows [K+1, V])."""
    return processed_probs(logits, contexts(req, drafts))
