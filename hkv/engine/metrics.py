"""An engine's metrics in Prometheus form, through `prometheus_client` (`Engine.metrics_text`, and the
`/metrics` endpoint of `hkv serve`).

The figures are read once into an `EngineFigures` (plain host values: the prefix stats, the cache's
transition counters, pool pages, the disk tier's counters); `EngineCollector` turns figures into metric
families on every collection, so it can be registered in any `prometheus_client.CollectorRegistry`
(the server registers one whose figures are read between engine steps). Each family is a row of a
table (`Metric`): its name, type, a function from its group's source to its samples, and its help line.

Metric names (unchanged since the hand-written exposition): `hkv_prefix_lookups_total`,
`hkv_prefix_hash_hit_tokens_total`, `hkv_prefix_restored_tokens_total`,
`hkv_prefix_disk_restored_tokens_total`, `hkv_prefix_rejections_total{stage,reason}`,
`hkv_prefix_records{state}`, `hkv_prefix_snapshots`, `hkv_evictions_total{kind}`,
`hkv_pages{kind,state}`, `hkv_transitions_total`, `hkv_failed_transitions_total{reason}`, and with a disk
tier `hkv_disk_bytes_total{op}`, `hkv_disk_blocks_total{op}`, `hkv_disk_write_failures_total`,
`hkv_disk_writes_dropped_total`, `hkv_disk_stored_bytes`. Since prometheus_client writes them, values
are floats (`hkv_prefix_lookups_total 2.0`) and labels are in alphabetical order
(`{reason="disk_auth",stage="byte"}`); a Prometheus parser reads both forms alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core.layout import CacheLayout
from ..store.tier import DiskTier

__all__ = ["EngineCollector", "EngineFigures", "engine_figures", "figures_from_stats", "metrics_text"]

Sample = tuple[dict[str, str], Any]


class Family(NamedTuple):
    """One metric family: `samples(source)` gives its (labels, value) pairs, in exposition order."""

    name: str
    kind: str  # "counter" or "gauge"
    samples: Callable[[Any], list[Sample]]
    help: str


def _get(source: Any, path: Sequence[str]) -> Any:
    """`source[path[0]][path[1]]...`."""
    for key in path:
        source = source[key]
    return source


def _one(*path: str) -> Callable[[Any], list[Sample]]:
    """One unlabelled sample: the source's value at `path` (nested keys)."""
    return lambda s: [({}, _get(s, path))]


def _by(label: str, path: Sequence[str], **keys: str) -> Callable[[Any], list[Sample]]:
    """One sample per `label_value=key` of `keys`, in order: the value at `path` + (key,), labelled `label`."""
    return lambda s: [({label: v}, _get(s, path)[k]) for v, k in keys.items()]


def _each(label: str, *path: str) -> Callable[[Any], list[Sample]]:
    """One sample per item of the mapping at `path`, labelled `label` = its key."""
    return lambda s: [({label: k}, v) for k, v in _get(s, path).items()]


def _rejections(ps: dict[str, Any]) -> list[Sample]:
    """One sample per (validation stage, reason) of the prefix stats' rejection counts."""
    return [({"stage": st, "reason": r}, n) for st, rs in ps["rejections"].items() for r, n in rs.items()]


def _page_states(s: dict[str, Any]) -> list[Sample]:
    """Pages in use for every object kind, then every kind's capacity."""
    return [
        ({"kind": k, "state": st}, n[i]) for i, st in enumerate(("used", "capacity")) for k, n in s["pages"].items()
    ]


# fmt: off
_PREFIX = (  # source: Engine.prefix_stats()
    Family("hkv_prefix_lookups_total", "counter", _one("lookups"), "Prefix lookups."),
    Family("hkv_prefix_hash_hit_tokens_total", "counter", _one("hash_hit_tokens"),
           "Tokens matched by the chained block hash."),
    Family("hkv_prefix_restored_tokens_total", "counter", _one("restored_tokens"),
           "Tokens restored after all four validation stages."),
    Family("hkv_prefix_disk_restored_tokens_total", "counter", _one("disk_restored_tokens"),
           "Tokens installed from the disk tier after verification."),
    Family("hkv_prefix_rejections_total", "counter", _rejections, "Plans shrunk, by validation stage and reason."),
    Family("hkv_prefix_records", "gauge", _by("state", ("occupancy",), alive="records", tombstone="tombstones"),
           "Cached block records by state."),
    Family("hkv_prefix_snapshots", "gauge", _one("occupancy", "snapshots"), "SWA+TAIL snapshots held."),
    Family("hkv_evictions_total", "counter", _each("kind", "evictions"), "Evictions by object kind."),
)
_PAGES = (  # source: {"pages": {object kind: [used pages, capacity]}}
    Family("hkv_pages", "gauge", _page_states, "Pool pages by object kind and state."),
)
_CACHE = (  # source: the cache's transition counters
    Family("hkv_transitions_total", "counter", _one("transitions"), "Cache transitions."),
    Family("hkv_failed_transitions_total", "counter",
           _by("reason", (), no_pages="failed_no_pages", slot_cap="failed_slot_cap", context_cap="failed_context_cap"),
           "Transitions that returned the cache unchanged."),
)
_DISK = (  # source: the disk tier's counters and "stored_bytes"
    Family("hkv_disk_bytes_total", "counter",
           _by("op", (), written="bytes_written", read="bytes_read", evicted="bytes_evicted"),
           "Disk tier bytes by direction."),
    Family("hkv_disk_blocks_total", "counter", _by("op", (), written="blocks_written", read="blocks_read"),
           "Disk tier blocks by operation."),
    Family("hkv_disk_write_failures_total", "counter", _one("write_failures"),
           "Disk tier writes that published nothing."),
    Family("hkv_disk_writes_dropped_total", "counter", _one("writes_dropped"),
           "Disk tier writes refused because the writer's queue was full (max_queued_bytes)."),
    Family("hkv_disk_stored_bytes", "gauge", _one("stored_bytes"), "Bytes the disk tier holds."),
)
# fmt: on


def _families(table: Sequence[Family], source: Any) -> Iterator[Metric]:
    """The prometheus_client metric families of `table`, read from `source`."""
    for f in table:
        samples = f.samples(source)
        labels = list(samples[0][0]) if samples else []
        cls = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
        family = cls(f.name, f.help, labels=labels)
        for sample_labels, value in samples:
            family.add_metric([str(sample_labels[k]) for k in labels], float(value))
        yield family


@dataclasses.dataclass(frozen=True)
class EngineFigures:
    """An engine's figures at one moment, as host values.

    Attributes:
      prefix: `Engine.prefix_stats()` (None: leave the prefix families out).
      counters: the cache's transition counters (`Engine.stats()["cache"]`; None: leave them out).
      pages: object kind name -> [pages in use, pool capacity] (None: leave `hkv_pages` out).
      disk: the disk tier's counters with "stored_bytes" (None: no disk tier).
    """

    prefix: Mapping[str, Any] | None = None
    counters: Mapping[str, int] | None = None
    pages: Mapping[str, Sequence[int]] | None = None
    disk: Mapping[str, Any] | None = None


class EngineCollector(Collector):
    """A prometheus_client collector of an engine's figures, read afresh at every collection.

    Args:
      source: returns the current `EngineFigures` (None: collect nothing this time). It is called from
        the thread that collects; reading an engine's device cache is safe only between its steps, so
        a server passes a function that reads them on the thread that drives the engine.
    """

    def __init__(self, source: Callable[[], EngineFigures | None]):
        self._source = source

    def collect(self) -> Iterator[Metric]:
        """The metric families of the figures `source` returns now."""
        f = self._source()
        if f is None:
            return
        if f.prefix is not None:
            yield from _families(_PREFIX, f.prefix)
        if f.pages is not None:
            yield from _families(_PAGES, {"pages": f.pages})
        if f.counters is not None:
            yield from _families(_CACHE, f.counters)
        if f.disk is not None:
            yield from _families(_DISK, f.disk)


def _pages(layout: CacheLayout, view) -> dict[str, list[int]]:
    """Object kind name -> [pages in use (refcount > 0), pool capacity], summed over its groups."""
    used = {}
    for gi, grp in enumerate(layout.groups):
        rc = np.asarray(jax.device_get(view.groups[gi].refcount))
        used.setdefault(grp.kind.name, [0, 0])
        used[grp.kind.name][0] += int((rc > 0).sum())
        used[grp.kind.name][1] += int(rc.shape[0])
    return used


def _disk_figures(disk: DiskTier | None) -> dict[str, Any] | None:
    return None if disk is None else {**disk.counters, "stored_bytes": disk.stored_bytes()}


def engine_figures(layout: CacheLayout, view, prefix_stats: Mapping[str, Any], disk: DiskTier | None) -> EngineFigures:
    """Read an engine's figures from its cache (between steps).

    Args:
      layout: the cache layout; view: the cache (host reads of its counters and refcounts).
      prefix_stats: `Engine.prefix_stats()`. disk: the engine's disk tier, or None.
    Returns:
      the `EngineFigures`, every group present (disk only with a tier).
    """
    counters = {k: int(v) for k, v in jax.device_get(view.counters).items()}
    return EngineFigures(prefix_stats, counters, _pages(layout, view), _disk_figures(disk))


def _summed(parts: Sequence[Any]) -> Any:
    """Numbers summed, mappings merged key by key (recursively); other values: the first's."""
    first = parts[0]
    if isinstance(first, Mapping):
        keys = dict.fromkeys(k for p in parts for k in p)
        return {k: _summed([p[k] for p in parts if k in p]) for k in keys}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(p for p in parts if p is not None)
    return first


def figures_from_stats(stats: Mapping[str, Any], disk: DiskTier | None = None) -> EngineFigures:
    """An engine's figures from its `stats()` (an `hkv.MeshEngine`'s shards summed), without pages.

    Args:
      stats: `Engine.stats()` or `MeshEngine.stats()` (whose "shards" hold each shard's).
      disk: the engine's disk tier, or None.
    Returns:
      the `EngineFigures` (prefix figures only when the prefix cache is on).
    """
    shards = stats.get("shards") or [stats]
    prefixes = [s["prefix"] for s in shards if s.get("prefix") is not None]
    counters = [s["cache"] for s in shards if s.get("cache") is not None]
    prefix = _summed(prefixes) if prefixes else None
    if prefix is not None:  # a ratio of sums, not a sum of ratios
        hh = prefix.get("hash_hit_tokens")
        prefix["complete_restoration_ratio"] = prefix.get("restored_tokens", 0) / hh if hh else None
    return EngineFigures(
        prefix=prefix,
        counters=_summed(counters) if counters else None,
        disk=_disk_figures(disk),
    )


def metrics_text(layout: CacheLayout, view, prefix_stats: dict[str, Any], disk: DiskTier | None) -> str:
    """Prometheus text exposition of a cache's transition, pool and prefix metrics.

    Args:
      layout: the cache layout; view: the cache (host reads of its counters and refcounts).
      prefix_stats: `Engine.prefix_stats()`. disk: the engine's disk tier, or None.
    Returns:
      the exposition text (prometheus_client's `generate_latest`), one sample per line, ending in a newline.
    """
    figures = engine_figures(layout, view, prefix_stats, disk)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(lambda: figures))
    return generate_latest(registry).decode()
