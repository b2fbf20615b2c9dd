"""Prometheus metrics of one server: request counts and latencies observed by the HTTP layer, engine load read
from the step thread's latest EngineStats at scrape time.

Each server gets its own CollectorRegistry, so several apps in one process (tests) never clash.

Every trtopt_ metric that has a vLLM counterpart of the same meaning is also exposed under vLLM's name (VLLM_NAMES:
vllm:num_requests_running, vllm:time_to_first_token_seconds, ...), with vLLM's labels model_name and engine, so
vLLM's Grafana dashboards and alerts work unchanged. Always on, not behind a flag: the aliases are rendered from the
same samples at scrape time (they cannot disagree), cost a few dozen series, and a flag would be one more thing to
get wrong when switching a deployment from vLLM.
"""

from __future__ import annotations

import json
from typing import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from trtopt.runtime.batch import EngineStats, RequestOutput

# Seconds. CPU serving of small models sits in the 1 ms..10 s range; the buckets cover both ends.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# vLLM's buckets for the per-request phase histograms (vllm/v1/metrics/loggers.py), so dashboards carry over.
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                  480.0, 960.0, 1920.0, 7680.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)


def _buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's build_1_2_5_buckets for token-count histograms)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _EngineCollector(Collector):
    """Engine gauges, read when Prometheus scrapes (never stale by more than one step)."""

    def __init__(self, stats: Callable[[], EngineStats], sleep_level: Callable[[], int | None]) -> None:
        self._stats = stats
        self._sleep_level = sleep_level

    def collect(self) -> Iterator:
        level = self._sleep_level()
        # vLLM's engine_sleep_state: awake 1 or 0; weights_offloaded 1 at level 1, discard_all 1 at level 2 (a level,
        # not a memory fact: at level 1 trtopt frees the KV pools and keeps the weights where they are).
        sleep = GaugeMetricFamily("trtopt_engine_sleep_state", "1 in the engine's sleep state (awake; "
                                  "weights_offloaded = sleep level 1; discard_all = level 2)", labels=["sleep_state"])
        for state, value in (("awake", level is None), ("weights_offloaded", level == 1), ("discard_all", level == 2)):
            sleep.add_metric([state], float(value))
        yield sleep
        s = self._stats()
        yield GaugeMetricFamily("trtopt_kv_blocks_used", "KV cache blocks held by requests", value=s.num_blocks_used)
        yield GaugeMetricFamily("trtopt_kv_blocks_free", "KV cache blocks with no holder (prefix-cached ones included)",
                                value=s.num_blocks_free)
        yield GaugeMetricFamily("trtopt_kv_blocks_total", "usable KV cache blocks", value=s.num_blocks_total)
        yield InfoMetricFamily("trtopt_kv_cache_dtype", "dtype of the KV cache pools (build --kv-cache-dtype)",
                               value={"dtype": s.kv_cache_dtype})
        yield GaugeMetricFamily("trtopt_num_requests_running", "sequences scheduled every step", value=s.num_running)
        yield GaugeMetricFamily("trtopt_num_requests_waiting", "sequences waiting for admission", value=s.num_waiting)
        yield CounterMetricFamily("trtopt_num_preemptions", "requests preempted (freed and recomputed)",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("trtopt_engine_steps", "engine steps run", value=s.num_steps)
        yield CounterMetricFamily("trtopt_prompt_tokens", "prompt tokens of prefilled requests (whole prompts, as "
                                  "vLLM counts them)", value=s.num_prompt_tokens)
        yield CounterMetricFamily("trtopt_computed_prompt_tokens", "prompt tokens the model computed (prefix-cache "
                                  "hits excluded)", value=s.num_computed_prompt_tokens)
        yield CounterMetricFamily("trtopt_generation_tokens", "tokens generated", value=s.num_generated_tokens)
        yield CounterMetricFamily("trtopt_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache",
                                  value=s.num_prefix_cache_hit_tokens)
        # vLLM's kv_cache_usage_perc (a fraction in [0, 1], despite the name) and prefix-cache query/hit counters.
        yield GaugeMetricFamily("trtopt_kv_cache_usage_perc", "fraction of KV cache blocks held by requests (0-1)",
                                value=s.num_blocks_used / max(s.num_blocks_total, 1))
        yield CounterMetricFamily("trtopt_prefix_cache_queries", "prompt tokens looked up in the prefix cache "
                                  "(computed + hit; recomputation after preemption counts again)",
                                  value=s.num_computed_prompt_tokens + s.num_prefix_cache_hit_tokens)
        yield CounterMetricFamily("trtopt_prefix_cache_hits", "prompt tokens found in the prefix cache",
                                  value=s.num_prefix_cache_hit_tokens)
        # Speculative decoding (vLLM's spec_decode counters): zeros when it is off.
        yield CounterMetricFamily("trtopt_spec_decode_num_draft_tokens", "draft tokens proposed and verified",
                                  value=s.num_draft_tokens)
        yield CounterMetricFamily("trtopt_spec_decode_num_accepted_tokens", "draft tokens accepted",
                                  value=s.num_accepted_tokens)
        per_pos = CounterMetricFamily("trtopt_spec_decode_num_accepted_tokens_per_pos",
                                      "draft tokens accepted, by position in the draft (0 = first)", labels=["position"])
        for position, count in enumerate(s.num_accepted_per_position):
            per_pos.add_metric([str(position)], count)
        yield per_pos


# trtopt family name -> vLLM's names (vllm/v1/metrics/loggers.py). Counters are named without _total, as
# prometheus_client keeps them. time_per_output_token_seconds is vLLM's older name of the inter-token latency, which
# its shipped dashboard still plots.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "trtopt_num_requests_running": ("vllm:num_requests_running",),
    "trtopt_engine_sleep_state": ("vllm:engine_sleep_state",),
    "trtopt_num_requests_waiting": ("vllm:num_requests_waiting",),
    "trtopt_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc",),
    "trtopt_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "trtopt_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "trtopt_num_preemptions": ("vllm:num_preemptions",),
    "trtopt_prompt_tokens": ("vllm:prompt_tokens",),
    "trtopt_generation_tokens": ("vllm:generation_tokens",),
    "trtopt_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "trtopt_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "trtopt_spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
    "trtopt_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "trtopt_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "trtopt_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "trtopt_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "trtopt_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "trtopt_request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "trtopt_request_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "trtopt_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "trtopt_request_generation_tokens": ("vllm:request_generation_tokens",),
    "trtopt_request_success": ("vllm:request_success",),
}


class _VLLMAliases(Collector):
    """The sources' families in VLLM_NAMES again, under vLLM's names and with its labels."""

    def __init__(self, sources: Sequence[Collector], labels: dict[str, str]) -> None:
        self._sources = sources
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            for family in source.collect():
                for name in VLLM_NAMES.get(family.name, ()):
                    alias = Metric(name, family.documentation, family.type)
                    for sample in family.samples:
                        alias.add_sample(name + sample.name[len(family.name):], {**self._labels, **sample.labels},
                                         sample.value, sample.timestamp, sample.exemplar)
                    yield alias


class ServingMetrics:
    """The metrics of one server and the registry /metrics renders."""

    def __init__(self, stats: Callable[[], EngineStats], max_model_len: int = 8192, model_name: str = "", *,
                 sleep_level: Callable[[], int | None] = lambda: None) -> None:
        """sleep_level: the engine's sleep level now, None while awake (the engine_sleep_state gauge)."""
        self.registry = CollectorRegistry()
        self.requests = Counter("trtopt_requests", "HTTP generation requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.ttft = Histogram("trtopt_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("trtopt_inter_token_latency_seconds", "time between streamed tokens of a completion",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("trtopt_request_latency_seconds", "arrival to the last token",
                             buckets=_TTFT_BUCKETS, registry=self.registry)
        # Per finished request, from the engine's RequestMetrics (vLLM's names with the trtopt_ prefix).
        self.queue_time = Histogram("trtopt_request_queue_time_seconds", "arrival at the engine to first scheduled",
                                    buckets=_PHASE_BUCKETS, registry=self.registry)
        self.prefill_time = Histogram("trtopt_request_prefill_time_seconds", "first scheduled to first token",
                                      buckets=_PHASE_BUCKETS, registry=self.registry)
        self.decode_time = Histogram("trtopt_request_decode_time_seconds", "first token to last token",
                                     buckets=_PHASE_BUCKETS, registry=self.registry)
        self.tpot = Histogram("trtopt_request_time_per_output_token_seconds", "decode time / (output tokens - 1)",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.request_success = Counter("trtopt_request_success", "finished requests by the finish reason of their "
                                       "first completion (stop, length, error)", ["finished_reason"],
                                       registry=self.registry)
        token_buckets = _buckets_1_2_5(max_model_len)
        self.prompt_tokens = Histogram("trtopt_request_prompt_tokens", "prompt tokens of a finished request",
                                       buckets=token_buckets, registry=self.registry)
        self.generation_tokens = Histogram("trtopt_request_generation_tokens", "tokens generated for a finished "
                                           "request (all n completions)", buckets=token_buckets, registry=self.registry)
        engine = _EngineCollector(stats, sleep_level)
        self.registry.register(engine)
        histograms = [self.ttft, self.itl, self.e2e, self.queue_time, self.prefill_time, self.decode_time, self.tpot,
                      self.prompt_tokens, self.generation_tokens, self.request_success]
        self.registry.register(_VLLMAliases([engine, *histograms], {"model_name": model_name, "engine": "0"}))

    def observe_finished(self, out: RequestOutput) -> None:
        """The phase and size histograms of one finished request (its metrics are those of completion 0)."""
        m = out.metrics
        self.request_success.labels(out.outputs[0].finish_reason or "stop").inc()
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None and m.last_token_time is not None:
            self.decode_time.observe(m.last_token_time - m.first_token_time)
            n = len(out.outputs[0].token_ids)
            if n > 1:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (n - 1))


ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"  # the request asks for a load report in this format
ORCA_HEADER = "endpoint-load-metrics"  # the response's load report


def orca_load_report(stats: EngineStats) -> dict[str, float]:
    """ORCA's named_metrics of the engine's load now: vLLM's kv_cache_usage_perc (a fraction in [0, 1]) and
    num_requests_waiting, plus num_requests_running (the same gauges as /metrics)."""
    return {"kv_cache_usage_perc": stats.num_blocks_used / max(stats.num_blocks_total, 1),
            "num_requests_waiting": float(stats.num_waiting), "num_requests_running": float(stats.num_running)}


def orca_headers(metrics_format: str | None, stats: Callable[[], EngineStats]) -> dict[str, str] | None:
    """vLLM's ORCA load report (https://github.com/cncf/xds/blob/main/xds/data/orca/v3/orca_load_report.proto) as
    the `endpoint-load-metrics` response header, for a request whose `endpoint-load-metrics-format` header is TEXT
    ("TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=0.0, ...") or JSON
    ('JSON {"named_metrics": {...}}'), in any case. None (no header) for no format or any other format, as vLLM."""
    kind = (metrics_format or "").strip().lower()
    if kind not in ("text", "json"):
        return None
    named = orca_load_report(stats())
    if kind == "text":
        return {ORCA_HEADER: "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named.items())}
    return {ORCA_HEADER: "JSON " + json.dumps({"named_metrics": named})}


class LatencyTracker:
    """Per request: turns output arrival times into TTFT and inter-token latency observations."""

    def __init__(self, metrics: ServingMetrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last: float | None = None

    def on_tokens(self, now: float, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        if self._last is None:
            self._metrics.ttft.observe(now - self._arrival)
        else:
            # One step can bring several tokens (n>1 completions share it); each saw the same gap.
            gap = now - self._last
            for _ in range(num_new_tokens):
                self._metrics.itl.observe(gap)
        self._last = now

    def on_finish(self, now: float, outs: Sequence[RequestOutput] = ()) -> None:
        self._metrics.e2e.observe(now - self._arrival)
        for out in outs:
            self._metrics.observe_finished(out)
