"""Prometheus metrics of one server: request counts and latencies observed by the HTTP layer, engine load read
from the step thread's latest EngineStats at scrape time.

Each server gets its own CollectorRegistry, so several apps in one process (tests) never clash.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from trtopt.runtime.batch import EngineStats

# Seconds. CPU serving of small models sits in the 1 ms..10 s range; the buckets cover both ends.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    """Engine gauges, read when Prometheus scrapes (never stale by more than one step)."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator:
        s = self._stats()
        yield GaugeMetricFamily("trtopt_kv_blocks_used", "KV cache blocks held by requests", value=s.num_blocks_used)
        yield GaugeMetricFamily("trtopt_kv_blocks_free", "KV cache blocks with no holder (prefix-cached ones included)",
                                value=s.num_blocks_free)
        yield GaugeMetricFamily("trtopt_kv_blocks_total", "usable KV cache blocks", value=s.num_blocks_total)
        yield GaugeMetricFamily("trtopt_num_requests_running", "sequences scheduled every step", value=s.num_running)
        yield GaugeMetricFamily("trtopt_num_requests_waiting", "sequences waiting for admission", value=s.num_waiting)
        yield CounterMetricFamily("trtopt_num_preemptions", "requests preempted (freed and recomputed)",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("trtopt_engine_steps", "engine steps run", value=s.num_steps)
        yield CounterMetricFamily("trtopt_prompt_tokens", "prompt tokens computed", value=s.num_prompt_tokens)
        yield CounterMetricFamily("trtopt_generation_tokens", "tokens generated", value=s.num_generated_tokens)
        yield CounterMetricFamily("trtopt_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache",
                                  value=s.num_prefix_cache_hit_tokens)


class ServingMetrics:
    """The metrics of one server and the registry /metrics renders."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("trtopt_requests", "HTTP generation requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.ttft = Histogram("trtopt_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("trtopt_inter_token_latency_seconds", "time between streamed tokens of a completion",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("trtopt_request_latency_seconds", "arrival to the last token",
                             buckets=_TTFT_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(stats))


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

    def on_finish(self, now: float) -> None:
        self._metrics.e2e.observe(now - self._arrival)
