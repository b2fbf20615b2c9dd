"""Sampler: logits [N, vocab] -> one token per row, vectorised over the batch (docs/architecture.md §6).

Order of operations (vLLM's): the request's logits processors, its allowed_token_ids and bad_words masks, min_tokens
masking, logit_bias, penalties, the grammar mask of structured-output rows, then greedy argmax for temperature 0, or
temperature -> top-k -> top-p -> min-p -> a draw for the others. Each seeded request draws with its own
torch.Generator (one uniform per step, inverse-CDF), so its tokens do not depend on what else is in the batch. Logprobs are the model's raw
log_softmax, before penalties and temperature, as in vLLM and HF `output_scores`-free comparisons.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from trtopt.runtime.batch import SampledToken
from trtopt.runtime.kernels.argmax import greedy_argmax
from trtopt.runtime.request import Request
from trtopt.runtime.sampling_params import LogitsProcessor, _processor_arity, num_logprobs
from trtopt.runtime.structured_output import GrammarMasker


@dataclasses.dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, as tensors (built once per step from the requests)."""

    temperature: torch.Tensor  # float32 [N]; 0 = greedy
    top_k: torch.Tensor  # int64 [N]; vocab = off
    top_p: torch.Tensor  # float32 [N]
    min_p: torch.Tensor  # float32 [N]
    repetition: torch.Tensor  # float32 [N]
    presence: torch.Tensor  # float32 [N]
    frequency: torch.Tensor  # float32 [N]

    @classmethod
    def from_requests(cls, requests: Sequence[Request], vocab: int, device: torch.device | str = "cpu") -> SamplingTensors:
        ps = [r.params for r in requests]

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            temperature=f32([0.0 if p.greedy else p.temperature for p in ps]),
            top_k=torch.tensor([p.top_k if p.top_k > 0 else vocab for p in ps], dtype=torch.int64,
                               device=device).clamp_(max=vocab),
            top_p=f32([p.top_p for p in ps]),
            min_p=f32([p.min_p for p in ps]),
            repetition=f32([p.repetition_penalty for p in ps]),
            presence=f32([p.presence_penalty for p in ps]),
            frequency=f32([p.frequency_penalty for p in ps]),
        )


@dataclasses.dataclass
class PendingTokens:
    """One step's sampled tokens on their way to the host (async scheduling): `token_ids` stays on the logits'
    device for the next step's placeholders to read, while a copy travels to the host behind it."""

    token_ids: torch.Tensor  # int64 [N] on the logits' device
    _host: torch.Tensor | None = None  # pinned int64 [N], filled by a non-blocking copy (greedy rows on CUDA)
    _copied: torch.cuda.Event | None = None  # recorded after that copy
    sampled: list[SampledToken | Exception] | None = None  # set when the rows were sampled on the host (sync)

    def resolve(self) -> list[SampledToken | Exception]:
        """The tokens on the host. Waits for this step's sampling only, never for work launched after it."""
        if self.sampled is not None:
            return self.sampled
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host if self._host is not None else self.token_ids
        return list(map(SampledToken, host.tolist()))


class Sampler:
    """argmax_kernel (default on): greedy rows take their argmax through the Triton kernel on CUDA (kernels/argmax.py
    `greedy_argmax`, as speculative decoding's argmax does with this sampler); off, through torch.argmax (benchmarks'
    ablation, gpu_e2e.py's argmax row)."""

    def __init__(self, seed: int | None = None, *, argmax_kernel: bool = True) -> None:
        self.argmax_kernel = argmax_kernel
        # Draws for requests without a seed of their own.
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._grammar_masker: GrammarMasker | None = None  # made on the first constrained step

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[SampledToken]:
        """logits: float32 [N, vocab], row i belongs to requests[i]. Raises the first row's error, if any."""
        sampled = self.sample_each(logits, requests)
        error = next((s for s in sampled if isinstance(s, Exception)), None)
        if error is not None:
            raise error
        return sampled  # type: ignore[return-value]  # no row failed

    def sample_each(self, logits: torch.Tensor, requests: Sequence[Request],
                    argmax: torch.Tensor | None = None) -> list[SampledToken | Exception]:
        """One token per row, or the exception that row's request raised: one request's sampling parameters
        (say a top_k no tensor can hold) fail only that request, never the batch.

        The batch is sampled vectorised; only when that raises is each row sampled alone, to find the culprit.
        Every row's uniform is drawn before anything that can fail, so the rows that are fine get the very
        tokens the batch would have given them, and no generator advances twice.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(requests), f"logits {tuple(logits.shape)} for {len(requests)} requests"
        logits = logits.float()
        if all(_plain_greedy(r) for r in requests):  # the common serving case: one argmax, one device->host read
            ids = greedy_argmax(logits, kernel=self.argmax_kernel) if argmax is None else argmax
            return list(map(SampledToken, ids.tolist()))
        u = self._uniforms(requests)
        if self._grammar_masker is None and any(r.grammar is not None for r in requests):
            self._grammar_masker = GrammarMasker()  # on the first constrained step (imports xgrammar)
        try:
            return list(_sample(logits, requests, u, self._grammar_masker, argmax_kernel=self.argmax_kernel))
        except Exception:
            rows: list[SampledToken | Exception] = []
            for i, r in enumerate(requests):
                try:
                    rows.append(_sample(logits[i : i + 1], [r], u[i : i + 1], self._grammar_masker,
                                        argmax_kernel=self.argmax_kernel)[0])
                except Exception as e:  # this request's own fault; the engine ends it with finish_reason="error"
                    rows.append(e)
            return rows

    def sample_async(self, logits: torch.Tensor, requests: Sequence[Request],
                     argmax: torch.Tensor | None = None) -> PendingTokens:
        """sample_each without waiting for the device where it can: plain greedy rows (the common serving case)
        take their argmax on the device and copy it to the host behind the step, so the engine can launch the
        next step first. Any other row (penalties, logprobs, grammar, random draws) samples on the host as
        sample_each does, which waits for this step's logits (the step still overlapped the previous outputs).

        argmax (here and in sample_each): these rows' greedy argmax when the step computed it already (inside its
        CUDA graph: executors' `last_greedy_tokens`); a plain greedy batch then launches nothing."""
        assert logits.dim() == 2 and logits.shape[0] == len(requests), f"logits {tuple(logits.shape)} for {len(requests)} requests"
        if all(_plain_greedy(r) for r in requests):
            ids = greedy_argmax(logits, kernel=self.argmax_kernel) if argmax is None else argmax
            if ids.device.type != "cuda":
                return PendingTokens(ids)
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            return PendingTokens(ids, host, copied)
        sampled = self.sample_each(logits, requests)
        ids = [0 if isinstance(s, Exception) else s.token_id for s in sampled]  # a failed row's request ends now
        return PendingTokens(torch.tensor(ids, dtype=torch.int64).to(logits.device, non_blocking=True), sampled=sampled)

    def _uniforms(self, requests: Sequence[Request]) -> torch.Tensor:
        """[N] float32 on the CPU: one uniform per sampling (non-greedy) row from the row's own generator (the
        engine's for a request without a seed); greedy rows draw nothing (0). Generators stay on the CPU: a
        request's draws must not depend on the device or the batch."""
        u = torch.zeros(len(requests), dtype=torch.float32)
        for i, r in enumerate(requests):
            if not r.params.greedy:
                u[i] = torch.rand(1, generator=r.generator or self._generator)
        return u

    def generator_for(self, request: Request) -> torch.Generator:
        """The generator a request draws from: its own (seeded) one, else the engine's."""
        return request.generator or self._generator


def _sample(logits: torch.Tensor, requests: Sequence[Request], u: torch.Tensor,
            grammar_masker: GrammarMasker | None = None, *, argmax_kernel: bool = True) -> list[SampledToken]:
    """The vectorised sampler: logits float32 [N, vocab], u [N] uniforms for the rows that draw; grammar_masker
    is given when some row has a grammar (structured output); argmax_kernel as the Sampler's."""
    vocab = logits.shape[1]
    t = SamplingTensors.from_requests(requests, vocab, logits.device)
    want_logprobs = [r.params.logprobs for r in requests]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want_logprobs) else None

    constrained = any(r.grammar is not None for r in requests)
    controlled = any(r.params.has_token_controls for r in requests)
    if any(r.num_output_tokens < r.params.min_tokens for r in requests) or _has_penalties(t) or constrained or controlled:
        logits = logits.clone()  # the executor's logits stay as they came
        if controlled:
            _apply_token_controls(logits, requests, before_min_tokens=True)
        _mask_before_min_tokens(logits, requests)
        if controlled:
            _apply_token_controls(logits, requests, before_min_tokens=False)
        _apply_penalties(logits, requests, t)
        if constrained:  # structured output: tokens the grammar forbids are -inf before any filtering or draw
            assert grammar_masker is not None, "a constrained row needs the sampler's GrammarMasker"
            grammar_masker(logits, requests)
    tokens = greedy_argmax(logits, kernel=argmax_kernel)  # greedy rows keep this
    rows = torch.nonzero(t.temperature > 0).flatten()
    if rows.numel():
        x = logits[rows] / t.temperature[rows, None]
        top_k, top_p, min_p = t.top_k[rows], t.top_p[rows], t.min_p[rows]
        # Unfiltered rows draw from the whole vocabulary; filtered ones from a few candidates.
        unfiltered = (top_k >= vocab) & (top_p >= 1) & (min_p <= 0)
        for group in (unfiltered, ~unfiltered):
            sub = torch.nonzero(group).flatten()
            if sub.numel():
                cand_logits, cand_ids = _candidates(x[sub], top_k[sub], top_p[sub], min_p[sub])  # [M, K]
                tokens[rows[sub]] = _draw(cand_logits, cand_ids, u[rows[sub].cpu()])
    return _to_sampled(tokens, raw_logprobs, want_logprobs)


def processed_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """[N, vocab] float32: the distribution the sampler draws row i from, given requests[i]'s context.

    The same steps as Sampler.__call__ (min_tokens masking, penalties, temperature, top-k -> top-p -> min-p);
    a greedy row is one-hot at its argmax. Speculative decoding verifies against, and drafts from, exactly these
    distributions (runtime/spec_decode/rejection.py), so both sides are processed the same way.
    """
    logits = logits.float().clone()
    vocab = logits.shape[1]
    t = SamplingTensors.from_requests(requests, vocab, logits.device)
    _mask_before_min_tokens(logits, requests)
    _apply_penalties(logits, requests, t)
    probs = torch.zeros_like(logits)
    greedy = torch.nonzero(t.temperature <= 0).flatten()
    if greedy.numel():
        probs[greedy, logits[greedy].argmax(dim=-1)] = 1.0
    rows = torch.nonzero(t.temperature > 0).flatten()
    if rows.numel():
        x = logits[rows] / t.temperature[rows, None]
        cand_logits, cand_ids = _candidates(x, t.top_k[rows], t.top_p[rows], t.min_p[rows])
        probs[rows] = torch.zeros_like(x).scatter_(1, cand_ids, torch.softmax(cand_logits, dim=-1))
    return probs


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Per row of logits [M, vocab]: (target token, its raw logprob, the top-k (token, logprob) best first)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(targets, dtype=torch.int64, device=logp.device)[:, None]).squeeze(1).tolist()
    if k > 0:
        vals, ids = logp.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in targets]
    return list(zip(targets, chosen, tops))


def _plain_greedy(r: Request) -> bool:
    """Greedy with nothing that changes the argmax or asks for more than the token."""
    p = r.params
    return r.grammar is None and p.plain_greedy and (p.min_tokens == 0 or r.num_output_tokens >= p.min_tokens)


def _draw(cand_logits: torch.Tensor, cand_ids: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling with the row's uniform u [M] (CPU). Returns token ids [M]."""
    cdf = torch.softmax(cand_logits, dim=-1).cumsum(dim=-1)  # [M, K]
    picks = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None]).clamp_(max=cdf.shape[1] - 1)
    return cand_ids.gather(1, picks).squeeze(1)


def _apply_token_controls(logits: torch.Tensor, requests: Sequence[Request], *, before_min_tokens: bool) -> None:
    """The per-request token controls, in place on logits [N, vocab] (on its device). Before min_tokens: the
    logits processors (user code, one call per row: a row is the request's own logits), then allowed_token_ids and
    bad_words as one masked write each for the whole batch; after it, logit_bias as one indexed add. Python loops
    run over requests and their listed ids, never over the vocabulary; rows without controls are untouched."""
    dev = logits.device
    if not before_min_tokens:
        biased = [i for i, r in enumerate(requests) if r.params.logit_bias]
        if biased:
            ids, vals = zip(*(_control_tensors(requests[i]).bias for i in biased))
            rows = _row_index(biased, ids)
            logits.index_put_((rows.to(dev), torch.cat(ids).to(dev)), torch.cat(vals).to(device=dev, dtype=logits.dtype),
                              accumulate=True)
        return
    for i, r in enumerate(requests):
        for proc in r.params.logits_processors:
            logits[i] = _run_processor(proc, r, logits[i])
    allowed_rows = [i for i, r in enumerate(requests) if r.params.allowed_token_ids is not None]
    if allowed_rows:
        ids = [_control_tensors(requests[i]).allowed for i in allowed_rows]
        keep = torch.zeros(len(allowed_rows), logits.shape[1], dtype=torch.bool, device=dev)
        keep[_row_index(range(len(allowed_rows)), ids).to(dev), torch.cat(ids).to(dev)] = True
        sel = torch.tensor(allowed_rows, dtype=torch.int64, device=dev)
        logits[sel] = logits[sel].masked_fill(~keep, float("-inf"))
    rows, cols = [], []
    for i, r in enumerate(requests):
        banned = _banned_by_bad_words(r)
        rows += [i] * len(banned)
        cols += banned
    if rows:
        logits[_index(rows, cols, logits.device)] = float("-inf")


@dataclasses.dataclass(frozen=True)
class _ControlTensors:
    """A request's allowed ids and logit_bias as CPU tensors, built once (a request keeps its params)."""

    allowed: torch.Tensor | None  # int64 [A]
    bias: tuple[torch.Tensor, torch.Tensor] | None  # (int64 ids [B], float32 biases [B])


def _control_tensors(r: Request) -> _ControlTensors:
    cached = getattr(r, "_control_tensors", None)
    if cached is None:
        p = r.params
        allowed = None if p.allowed_token_ids is None else torch.tensor(p.allowed_token_ids, dtype=torch.int64)
        bias = None if not p.logit_bias else (torch.tensor(list(p.logit_bias), dtype=torch.int64),
                                              torch.tensor(list(p.logit_bias.values()), dtype=torch.float32))
        cached = r._control_tensors = _ControlTensors(allowed, bias)
    return cached


def _row_index(rows: Sequence[int], per_row: Sequence[torch.Tensor]) -> torch.Tensor:
    """Row i repeated once per entry of per_row[i] (CPU int64)."""
    return torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.int64),
                                   torch.tensor([len(t) for t in per_row], dtype=torch.int64))


def _index(rows: list[int], cols: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(list(cols), dtype=torch.int64, device=device))


def _banned_by_bad_words(r: Request) -> list[int]:
    """vLLM's bad_words rule: a sequence's last token is banned where the output ends with the rest of it (a
    one-token word is always banned). Only output tokens count, as in vLLM: the prompt may contain the words."""
    out = r.output_token_ids if r.bad_words_token_ids else ()
    banned = []
    for seq in r.bad_words_token_ids:
        prefix = seq[:-1]
        if len(prefix) <= len(out) and (not prefix or tuple(out[len(out) - len(prefix):]) == prefix):
            banned.append(seq[-1])
    return banned


def _run_processor(proc: LogitsProcessor, r: Request, row: torch.Tensor) -> torch.Tensor:
    """Call a v0-style logits processor on a copy of the request's row; its result must be a [vocab] tensor."""
    args = (r.output_token_ids, row.clone()) if _processor_arity(proc) == 2 else (r.prompt_token_ids, r.output_token_ids, row.clone())
    result = proc(*args)
    if not isinstance(result, torch.Tensor) or result.shape != row.shape:
        raise TypeError(f"logits processor {proc!r} returned {type(result).__name__} "
                        f"{tuple(getattr(result, 'shape', ()))}; it must return the logits tensor of shape {tuple(row.shape)}.")
    return result.to(device=row.device, dtype=row.dtype)


def _mask_before_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    rows, cols = [], []
    for i, r in enumerate(requests):
        if r.num_output_tokens < r.params.min_tokens:
            banned = [t for t in (*r.eos_token_ids, *r.params.stop_token_ids) if t < logits.shape[1]]
            rows += [i] * len(banned)
            cols += banned
    if rows:  # one indexed write for the whole batch (one launch on a GPU, not one per row)
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")


def _has_penalties(t: SamplingTensors) -> bool:
    return not bool((t.repetition == 1).all() and (t.presence == 0).all() and (t.frequency == 0).all())


def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request], t: SamplingTensors) -> None:
    """Repetition (over prompt + output, CTRL-style), presence and frequency (over output) penalties."""
    if not _has_penalties(t):
        return
    n, vocab = logits.shape
    dev = logits.device
    out_rows = [i for i, r in enumerate(requests) for _ in range(r.num_output_tokens)]
    out_ids = [t for r in requests for t in r.output_token_ids]
    all_rows = [i for i, r in enumerate(requests) for _ in range(r.num_tokens)]
    all_ids = [t for r in requests for t in r.token_ids]
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=dev)  # occurrences in the output
    counts.index_put_((torch.tensor(out_rows, dtype=torch.int64, device=dev), torch.tensor(out_ids, dtype=torch.int64, device=dev)),
                      torch.ones(len(out_ids), device=dev), accumulate=True)
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)  # in prompt or output
    seen[torch.tensor(all_rows, dtype=torch.int64, device=dev), torch.tensor(all_ids, dtype=torch.int64, device=dev)] = True
    rep = t.repetition[:, None].expand(n, vocab)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= t.frequency[:, None] * counts + t.presence[:, None] * (counts > 0).float()


# Candidates taken with topk before any full sort: sorting [M, vocab] on a CPU costs ~10 ms per row.
_CANDIDATES = 1024


def _candidates(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, V] temperature-scaled logits -> (filtered logits [M, K], their token ids [M, K]).

    Filters in HF/vLLM order: top-k, then top-p over the top-k distribution, then min-p. Removed tokens are
    -inf. Only the top K tokens are kept when that provably loses nothing (every row's top-k, top-p or
    min-p cut falls inside them); otherwise K = V.
    """
    m, vocab = x.shape
    if bool((top_k >= vocab).all() and (top_p >= 1).all() and (min_p <= 0).all()):
        return x, torch.arange(vocab, device=x.device).expand(m, vocab)
    k = int(top_k.max()) if bool((top_k < vocab).all()) else min(vocab, _CANDIDATES)
    vals, ids = x.topk(k, dim=-1)  # sorted descending
    in_top_k = top_k <= k  # rows whose top-k cut lies inside the candidates; the others have top-k off
    full_logp = None  # [M, K] log-probs under the whole row, for the rows with top-k off
    if not bool(in_top_k.all()):
        full_logp = torch.log_softmax(x, dim=-1).gather(1, ids)
        if not bool(((top_k >= vocab) | in_top_k).all() and _cut_inside(full_logp, in_top_k, top_p, min_p).all()):
            vals, ids = x.sort(dim=-1, descending=True)
            k, full_logp = vocab, None
    vals = vals.masked_fill(torch.arange(k, device=x.device).expand(m, k) >= top_k[:, None], float("-inf"))
    logp = torch.log_softmax(vals, dim=-1)  # the top-k distribution where its cut is inside
    if full_logp is not None:
        logp = torch.where(in_top_k[:, None], logp, full_logp)
    probs = logp.exp()
    # Drop a token when the mass strictly before it already reaches top_p (top_p = 1 never drops: rounding).
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1)[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always stays
    return vals.masked_fill(drop, float("-inf")), ids


def _cut_inside(full_logp: torch.Tensor, in_top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[M] bool: every token outside the K candidates is removed anyway by top-k, top-p or min-p."""
    mass = full_logp.exp()  # [M, K]
    return in_top_k | (mass.sum(dim=-1) >= top_p) | (mass[:, -1] < min_p * mass[:, 0])


def _to_sampled(tokens: torch.Tensor, raw_logprobs: torch.Tensor | None, want: list[int | None]) -> list[SampledToken]:
    token_list = tokens.tolist()
    if raw_logprobs is None:
        return [SampledToken(token_id=t) for t in token_list]
    want = [None if k is None else num_logprobs(k, raw_logprobs.shape[-1]) for k in want]
    k_max = max(k for k in want if k is not None)
    top_vals, top_ids = raw_logprobs.topk(k_max, dim=-1) if k_max > 0 else (None, None)
    chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    out = []
    for i, (tok, k) in enumerate(zip(token_list, want)):
        if k is None:
            out.append(SampledToken(token_id=tok))
            continue
        top = {tok: chosen[i]}
        if k > 0:
            top.update(zip(top_ids[i, :k].tolist(), top_vals[i, :k].tolist()))
        out.append(SampledToken(token_id=tok, logprob=chosen[i], top_logprobs=top))
    return out
