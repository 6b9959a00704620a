"""`/metrics`: a `Snapshot` of the engine loop as Prometheus text (prometheus_client).

Counters are monotonic since start-up (the server never resets the engine's stats); rates,
latencies and hit rates are gauges over the whole run. Each scrape builds its own registry, so
nothing is process-global.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from strata_runtime.serving.loop import Snapshot

PREFIX = "strata_"
ENGINE_COUNTERS = {  # Engine.stats() key -> (metric name, help)
    "decode_steps": ("decode_steps", "Decode steps (after the decode program's compilation)"),
    "h2d_bytes": ("h2d_bytes", "Expert bytes copied host -> device"),
    "h2d_wasted_bytes": ("h2d_wasted_bytes", "Prefetched expert bytes that were not used"),
    "disk_bytes": ("disk_bytes", "Expert bytes read from disk"),
    "disk_loads": ("disk_loads", "Experts read from disk into tier 1"),
    "disk_stall_s": ("disk_stall_seconds", "Seconds steps waited on disk reads"),
    "admissions": ("cache_admissions", "Tier 1 -> cache slot copies"),
    "rebalance_swaps": ("rebalance_swaps", "Rebalancing swaps of pinned experts"),
    "read_ahead_loads": ("read_ahead_loads", "Experts read from disk into tier 1 ahead of need"),
    "failed_requests": ("expert_failed_rows", "Rows failed by unreadable experts"),
    "compile_s": ("decode_compile_seconds", "Seconds of the decode program's first call"),
}
ENGINE_GAUGES = {
    "decode_tok_s": ("decode_tokens_per_second", "Decoded tokens per second of step time"),
    "prefill_tok_s": ("prefill_tokens_per_second", "Prefilled tokens per second of prefill"),
    "tier0_hit_rate": ("tier0_hit_rate", "Routed experts found in an HBM slot"),
    "prefetch_hit_rate": ("prefetch_hit_rate", "Routed experts found in the prefetch half"),
    "misses_per_step": ("misses_per_step", "Experts copied on demand per decode step"),
    "link_busy": ("link_busy", "Share of step time the host -> device link was busy"),
    "link_gbps": ("link_gbps", "Measured host -> device GB/s"),
    "tier0_experts": ("tier0_experts", "Experts with an HBM slot"),
    "tier1_experts": ("tier1_experts", "Experts in pinned host memory"),
    "staging_slots": ("staging_slots", "Experts per staging half"),
}
REQUEST_STATES = ("finished", "failed", "cancelled", "rejected")
REQUESTS_HELP = ("Requests by how they ended: finished (a stop id or string, or the token "
                 "limit), failed (an error), cancelled (client gone, shutdown), rejected "
                 "(queue full)")


class _SnapshotCollector(Collector):
    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        s, stats = self.snap, self.snap.engine
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield _counter(name, doc, stats.get(key))
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield _gauge(name, doc, stats.get(key))
        steps = GaugeMetricFamily(PREFIX + "step_seconds", "Decode step time quantiles",
                                  labels=["quantile"])
        for q, key in (("0.5", "step_ms_p50"), ("0.99", "step_ms_p99")):
            if stats.get(key) is not None:
                steps.add_metric([q], stats[key] / 1e3)
        yield steps
        prediction = stats.get("prediction") or {}
        for name in ("precision", "recall"):
            yield _gauge(f"predictor_{name}", f"Predictor {name}", prediction.get(name))
        yield _counter("decode_tokens", "Tokens decoded by steps", s.decode_tokens)
        yield _counter("prefill_tokens", "Prompt tokens prefilled", s.prefill_tokens)
        yield _counter("generated_tokens", "Tokens generated for requests",
                       s.counters.generated_tokens)
        yield _counter("engine_errors", "Exceptions out of a step", s.counters.engine_errors)
        yield _counter("xla_compiles", "XLA compilations in the server process (cache loads "
                       "included)", s.compiles)
        yield _counter("xla_compile_seconds", "Seconds of XLA compilation", s.compile_s)
        requests = CounterMetricFamily(PREFIX + "requests", REQUESTS_HELP, labels=["state"])
        for state in REQUEST_STATES:
            requests.add_metric([state], getattr(s.counters, state))
        yield requests
        yield _gauge("active_rows", "Rows decoding a request", s.active_rows)
        yield _gauge("queue_depth", "Requests waiting for a row", s.queue_depth)
        yield _gauge("batch_capacity", "Rows of the batch", s.capacity)
        yield _gauge("uptime_seconds", "Seconds since the engine loop started", s.uptime_s)


def _counter(name: str, doc: str, value: object) -> Metric:
    metric = CounterMetricFamily(PREFIX + name, doc)
    if value is not None:
        metric.add_metric([], float(value))
    return metric


def _gauge(name: str, doc: str, value: object) -> Metric:
    metric = GaugeMetricFamily(PREFIX + name, doc)
    if value is not None:
        metric.add_metric([], float(value))
    return metric


def render(snap: Snapshot) -> bytes:
    """Prometheus text exposition of `snap`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap))
    return generate_latest(registry)
