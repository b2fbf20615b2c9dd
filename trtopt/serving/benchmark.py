"""Online serving benchmark with `vllm bench serve`'s definitions (the library behind `trtopt bench serve`).

A run sends N requests to a running server at a request rate: arrivals are a Poisson process (gamma intervals with
shape `burstiness`, 1 = Poisson, as vLLM draws them) or all at once for rate = inf, optionally capped at
`max_concurrency` in flight. Every request streams, and the client timestamps each chunk that carries text:

  - TTFT: send -> first text chunk.
  - ITL: the gaps between successive text chunks (pooled over all requests).
  - TPOT: per request, (latency - TTFT) / (output tokens - 1), for requests with more than one output token.
  - E2EL: send -> last byte.
  - request throughput = completed / duration; output throughput = output tokens / duration, where duration runs
    from the first send to the last completion and output tokens are the server's `usage` count when it reports
    one (OpenAI endpoints with stream_options.include_usage), else the generated text re-tokenized (Triton).

Backends: an OpenAI-compatible /v1/completions or /v1/chat/completions (trtopt serve, vLLM, SGLang, ...), and
Triton's generate extension (/v2/models/<model>/generate_stream with text_input/max_tokens, as the repositories of
`trtopt triton-repo` and TensorRT-LLM's ensemble take it).

Datasets: `random` (token ids drawn uniformly from the ordinary vocabulary, decoded to a prompt of input_len tokens;
lengths vary by +-range_ratio; ignore_eos so every request produces output_len tokens) and `conversations` (the
first user turn of each conversation of a ShareGPT-format file; output length = the tokens of the first reply).
A synthetic conversation set ships with trtopt (`SYNTHETIC_CONVERSATIONS`), so no download is needed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

import httpx
import numpy as np

from trtopt.errors import ConfigError

SYNTHETIC_CONVERSATIONS = Path(__file__).parent / "data" / "synthetic_conversations.json"
BACKENDS = ("openai", "openai-chat", "triton")
PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One request of the dataset."""

    prompt: str
    prompt_len: int  # tokens of `prompt` under the benchmark's tokenizer
    output_len: int  # max_tokens to ask for


@dataclasses.dataclass
class RequestResult:
    """What the client saw of one request (times in seconds, from time.perf_counter)."""

    success: bool = False
    start: float = 0.0  # when the request was sent
    prompt_len: int = 0
    output_len: int = 0  # output tokens (usage, or re-tokenized text)
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    generated_text: str = ""
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    backend: str  # one of BACKENDS
    base_url: str  # http://host:port
    model: str
    api_key: str | None = None
    ignore_eos: bool = True  # ask for exactly output_len tokens (vLLM's --ignore-eos; trtopt serve and Triton take it)
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}.")


# ---- datasets ------------------------------------------------------------------------------------------------


def random_dataset(tokenizer: Any, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0) -> list[BenchRequest]:
    """vLLM's random dataset: lengths uniform in [len*(1-r), len*(1+r)], prompts of random ordinary tokens."""
    if not 0 <= range_ratio < 1:
        raise ConfigError(f"--random-range-ratio={range_ratio} must be in [0, 1).")
    rng = np.random.default_rng(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ordinary = np.array([t for t in range(len(tokenizer)) if t not in special])
    lo_in, hi_in = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
    lo_out, hi_out = max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio))
    out = []
    for _ in range(num_prompts):
        n_in = int(rng.integers(lo_in, hi_in + 1))
        ids = rng.choice(ordinary, size=n_in).tolist()
        # Decoding and re-encoding can merge tokens; re-encode and cut so the prompt really has about n_in tokens.
        text = tokenizer.decode(tokenizer(tokenizer.decode(ids), add_special_tokens=False).input_ids[:n_in])
        out.append(BenchRequest(text, _count(tokenizer, text), int(rng.integers(lo_out, hi_out + 1))))
    return out


def conversation_dataset(tokenizer: Any, num_prompts: int, path: Path = SYNTHETIC_CONVERSATIONS,
                         output_len: int | None = None, seed: int = 0) -> list[BenchRequest]:
    """ShareGPT-format conversations ([{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]):
    the first human turn is the prompt, the first reply's token count the output length (unless output_len).
    Sampled with replacement-free shuffling, and cycled when num_prompts exceeds the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read conversations from {path}: {e}") from e
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
             if len(c.get("conversations", ())) >= 2]
    if not pairs:
        raise ConfigError(f"{path} has no conversation with a prompt and a reply.")
    order = np.random.default_rng(seed).permutation(len(pairs))
    out = []
    for i in range(num_prompts):
        prompt, reply = pairs[order[i % len(pairs)]]
        n_out = output_len if output_len is not None else max(1, _count(tokenizer, reply))
        out.append(BenchRequest(prompt, _count(tokenizer, prompt), n_out))
    return out


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


# ---- sending -------------------------------------------------------------------------------------------------


def _payload(target: Target, req: BenchRequest) -> tuple[str, dict[str, Any]]:
    if target.backend == "triton":
        return f"/v2/models/{target.model}/generate_stream", {
            "text_input": req.prompt, "max_tokens": req.output_len, "stream": True,
            "ignore_eos": target.ignore_eos, "temperature": target.temperature}
    common = {"model": target.model, "stream": True, "stream_options": {"include_usage": True},
              "temperature": target.temperature, "ignore_eos": target.ignore_eos}
    if target.backend == "openai-chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": req.prompt}],
                                        "max_completion_tokens": req.output_len}
    return "/v1/completions", {**common, "prompt": req.prompt, "max_tokens": req.output_len}


def _chunk_text(backend: str, event: dict[str, Any]) -> str:
    if backend == "triton":
        return str(event.get("text_output", ""))
    choices = event.get("choices") or []
    if not choices:
        return ""
    if backend == "openai-chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def send_request(client: httpx.AsyncClient, target: Target, req: BenchRequest, tokenizer: Any) -> RequestResult:
    """Send one streaming request and time its chunks; failures are recorded, never raised."""
    path, body = _payload(target, req)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    result = RequestResult(prompt_len=req.prompt_len)
    usage_tokens = None
    start = last = result.start = time.perf_counter()
    try:
        async with client.stream("POST", target.base_url + path, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return result
            async for event in _sse_events(response):
                if "error" in event:
                    result.error = json.dumps(event["error"])[:300]
                    return result
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                text = _chunk_text(target.backend, event)
                if not text:
                    continue
                now = time.perf_counter()
                if not result.generated_text:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                result.generated_text += text
        result.latency = time.perf_counter() - start
        result.output_len = usage_tokens if usage_tokens is not None else _count(tokenizer, result.generated_text)
        result.success = bool(result.generated_text)
        if not result.success:
            result.error = "the stream ended without any text"
    except (httpx.HTTPError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def arrival_gaps(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """vLLM's arrival process: n gaps (s) after each request, gamma-distributed with mean 1/rate and shape
    `burstiness` (1 = exponential gaps, a Poisson process); rate inf = all zero (a burst)."""
    if math.isinf(rate):
        return np.zeros(n)
    return np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


async def _arrivals(requests: Sequence[BenchRequest], rate: float, burstiness: float, seed: int) -> AsyncIterator[BenchRequest]:
    for req, gap in zip(requests, arrival_gaps(len(requests), rate, burstiness, seed)):
        yield req
        if gap > 0:
            await asyncio.sleep(float(gap))


async def run_load(target: Target, requests: Sequence[BenchRequest], tokenizer: Any, *, request_rate: float,
                   burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                   on_done: Callable[[RequestResult], None] | None = None, timeout_s: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send every request at `request_rate`; return (results in dataset order, benchmark duration in seconds)."""
    if request_rate <= 0 or burstiness <= 0:
        raise ConfigError("request rate and burstiness must be > 0 (use inf for a burst).")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def one(req: BenchRequest) -> RequestResult:
            if limit is None:
                res = await send_request(client, target, req, tokenizer)
            else:
                async with limit:
                    res = await send_request(client, target, req, tokenizer)
            if on_done is not None:
                on_done(res)
            return res

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(req)) async for req in _arrivals(requests, request_rate, burstiness, seed)]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


# ---- metrics -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchMetrics:
    """vLLM bench serve's summary; latencies in ms, each as {"mean", "median", "std", "p50", "p90", "p99"}."""

    request_rate: float
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    max_concurrent_requests: int  # most requests in flight at once, as the client saw them
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    errors: tuple[str, ...]  # the first few error messages


def _stats(values_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    if ms.size == 0:
        return {k: float("nan") for k in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))}
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std()),
            **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def compute_metrics(results: Sequence[RequestResult], duration_s: float, request_rate: float) -> BenchMetrics:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    return BenchMetrics(
        request_rate=request_rate,
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=out_tokens / duration_s,
        total_token_throughput=(in_tokens + out_tokens) / duration_s,
        max_concurrent_requests=_max_overlap([(r.start, r.start + r.latency) for r in ok]),
        ttft_ms=_stats([r.ttft for r in ok]),
        tpot_ms=_stats([(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]),
        itl_ms=_stats([x for r in ok for x in r.itl]),
        e2el_ms=_stats([r.latency for r in ok]),
        errors=tuple(dict.fromkeys(r.error for r in results if not r.success))[:5],
    )


def _max_overlap(intervals: Sequence[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])  # ends sort before starts
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best
