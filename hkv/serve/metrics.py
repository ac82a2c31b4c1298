"""The server's Prometheus metrics (`GET /metrics`), in a `prometheus_client.CollectorRegistry` of its own.

Counted by the server (`ServeMetrics`), each labelled by `endpoint` ("completions" / "chat"):

    hkv_requests_total{endpoint,finish_reason}    choices finished: "stop", "length", "cancelled", "error"
    hkv_rejected_requests_total{endpoint,status}  requests refused before running (400, 404, 429, 503)
    hkv_prompt_tokens_total{endpoint}             prompt tokens submitted (once per prompt)
    hkv_generation_tokens_total{endpoint}         tokens generated
    hkv_time_to_first_token_seconds{endpoint}     histogram: submission to a choice's first token
    hkv_inter_token_latency_seconds{endpoint}     histogram: between a choice's tokens
    hkv_request_latency_seconds{endpoint}         histogram: submission to a choice's end

Read from the engine at each scrape (`EngineStatsCollector`, on the driver thread between steps):

    hkv_requests_running, hkv_requests_waiting    the engine's active slots, and requests queued behind them
    hkv_server_requests                           choices the server holds (what --max-queue bounds)
    hkv_prefix_*, hkv_evictions_total, hkv_transitions_total, hkv_failed_transitions_total, hkv_disk_*
                                                  the engine's figures (`hkv.engine.metrics`): prefix
                                                  hash-hit vs restored tokens, rejections by stage and
                                                  reason, records, snapshots, evictions
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hkv.engine.metrics import EngineCollector, EngineFigures, figures_from_stats

__all__ = ["EngineStatsCollector", "ServeMetrics", "engine_reading"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServeMetrics:
    """The server's own counters and histograms, registered in `registry`.

    Args:
      registry: the app's registry (not prometheus_client's global one, so that several apps in one
        process keep their own figures).
    """

    def __init__(self, registry: CollectorRegistry):
        ep = ["endpoint"]
        self.registry = registry
        self.requests = Counter(
            "hkv_requests",
            "Choices finished, by endpoint and finish reason.",
            [*ep, "finish_reason"],
            registry=registry,
        )
        self.rejected = Counter(
            "hkv_rejected_requests",
            "Requests refused before running, by HTTP status.",
            [*ep, "status"],
            registry=registry,
        )
        self.prompt_tokens = Counter("hkv_prompt_tokens", "Prompt tokens submitted.", ep, registry=registry)
        self.generation_tokens = Counter("hkv_generation_tokens", "Tokens generated.", ep, registry=registry)
        self.ttft = Histogram(
            "hkv_time_to_first_token_seconds",
            "Seconds from submission to a choice's first token.",
            ep,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "hkv_inter_token_latency_seconds",
            "Seconds between two tokens of a choice (a dispatch's tokens share its time).",
            ep,
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            "hkv_request_latency_seconds",
            "Seconds from submission to a choice's end.",
            ep,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )


class EngineStatsCollector(Collector):
    """The engine's figures at each scrape: running and waiting requests, prefix-cache and cache figures.

    Args:
      read: returns `(engine.stats(), engine.pending, hkv.engine.metrics.EngineFigures)`, read between engine steps
        (the server passes a function that runs on its driver thread); it may raise TimeoutError
        while a step runs long (a compile), and then only `held` is reported.
      held: returns the choices the server holds (waiting or running).
    """

    def __init__(self, read: Callable[[], tuple[dict[str, Any], int, EngineFigures]], held: Callable[[], int]):
        self._read, self._held = read, held

    def collect(self) -> Iterator[Metric]:
        """The families of this scrape."""
        yield GaugeMetricFamily("hkv_server_requests", "Choices the server holds (waiting or running).", self._held())
        try:
            stats, pending, figures = self._read()
        except TimeoutError:
            return
        running = int(stats.get("active_slots", 0))
        yield GaugeMetricFamily("hkv_requests_running", "Requests holding an engine slot.", running)
        yield GaugeMetricFamily(
            "hkv_requests_waiting", "Requests queued in the engine for a slot.", max(0, int(pending) - running)
        )
        yield from EngineCollector(lambda: figures).collect()


def engine_reading(engine: Any) -> tuple[dict[str, Any], int, EngineFigures]:
    """What `EngineStatsCollector` reads: `(engine.stats(), engine.pending, its EngineFigures)`.
    Call it between the engine's steps (on the thread that drives it)."""
    stats = engine.stats()
    return stats, int(engine.pending), figures_from_stats(stats, getattr(engine, "disk", None))
