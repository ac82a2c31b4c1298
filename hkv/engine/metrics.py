"""Prometheus text exposition of an engine's metrics (`Engine.metrics_text`).

Each metric family is a row of a table (`Metric`): its name, type, a function from its group's source
(the prefix stats; the cache's counters and pages; the disk tier's counters) to its samples, and its
help line. One renderer (`_render`) writes the tables in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ..core.layout import CacheLayout
from ..store.tier import DiskTier

__all__ = ["metrics_text"]

Sample = tuple[dict[str, str], Any]


class Metric(NamedTuple):
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
    Metric("hkv_prefix_lookups_total", "counter", _one("lookups"), "Prefix lookups."),
    Metric("hkv_prefix_hash_hit_tokens_total", "counter", _one("hash_hit_tokens"),
           "Tokens matched by the chained block hash."),
    Metric("hkv_prefix_restored_tokens_total", "counter", _one("restored_tokens"),
           "Tokens restored after all four validation stages."),
    Metric("hkv_prefix_disk_restored_tokens_total", "counter", _one("disk_restored_tokens"),
           "Tokens installed from the disk tier after verification."),
    Metric("hkv_prefix_rejections_total", "counter", _rejections, "Plans shrunk, by validation stage and reason."),
    Metric("hkv_prefix_records", "gauge", _by("state", ("occupancy",), alive="records", tombstone="tombstones"),
           "Cached block records by state."),
    Metric("hkv_prefix_snapshots", "gauge", _one("occupancy", "snapshots"), "SWA+TAIL snapshots held."),
    Metric("hkv_evictions_total", "counter", _each("kind", "evictions"), "Evictions by object kind."),
)
_CACHE = (  # source: {"counters": the cache's counters, "pages": {object kind: [used pages, capacity]}}
    Metric("hkv_pages", "gauge", _page_states, "Pool pages by object kind and state."),
    Metric("hkv_transitions_total", "counter", _one("counters", "transitions"), "Cache transitions."),
    Metric("hkv_failed_transitions_total", "counter",
           _by("reason", ("counters",), no_pages="failed_no_pages", slot_cap="failed_slot_cap",
               context_cap="failed_context_cap"),
           "Transitions that returned the cache unchanged."),
)
_DISK = (  # source: the disk tier's counters and "stored_bytes"
    Metric("hkv_disk_bytes_total", "counter",
           _by("op", (), written="bytes_written", read="bytes_read", evicted="bytes_evicted"),
           "Disk tier bytes by direction."),
    Metric("hkv_disk_blocks_total", "counter", _by("op", (), written="blocks_written", read="blocks_read"),
           "Disk tier blocks by operation."),
    Metric("hkv_disk_write_failures_total", "counter", _one("write_failures"),
           "Disk tier writes that published nothing."),
    Metric("hkv_disk_writes_dropped_total", "counter", _one("writes_dropped"),
           "Disk tier writes refused because the writer's queue was full (max_queued_bytes)."),
    Metric("hkv_disk_stored_bytes", "gauge", _one("stored_bytes"), "Bytes the disk tier holds."),
)
# fmt: on


def _render(metrics: Sequence[Metric], source: Any) -> list[str]:
    """The exposition lines of `metrics` read from `source`: HELP, TYPE, then one line per sample."""
    lines = []
    for m in metrics:
        lines += [f"# HELP {m.name} {m.help}", f"# TYPE {m.name} {m.kind}"]
        for labels, value in m.samples(source):
            lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
            lines.append(f"{m.name}{lab} {value}")
    return lines


def _pages(layout: CacheLayout, view) -> dict[str, list[int]]:
    """Object kind name -> [pages in use (refcount > 0), pool capacity], summed over its groups."""
    used = {}
    for gi, grp in enumerate(layout.groups):
        rc = np.asarray(jax.device_get(view.groups[gi].refcount))
        used.setdefault(grp.kind.name, [0, 0])
        used[grp.kind.name][0] += int((rc > 0).sum())
        used[grp.kind.name][1] += int(rc.shape[0])
    return used


def metrics_text(layout: CacheLayout, view, prefix_stats: dict[str, Any], disk: DiskTier | None) -> str:
    """Prometheus text exposition of a cache's transition, pool and prefix metrics.

    Args:
      layout: the cache layout; view: the cache (host reads of its counters and refcounts).
      prefix_stats: `Engine.prefix_stats()`. disk: the engine's disk tier, or None.
    Returns:
      the exposition text, one sample per line, ending in a newline.
    """
    counters = {k: int(v) for k, v in jax.device_get(view.counters).items()}
    lines = _render(_PREFIX, prefix_stats) + _render(_CACHE, {"counters": counters, "pages": _pages(layout, view)})
    if disk is not None:
        lines += _render(_DISK, {**disk.counters, "stored_bytes": disk.stored_bytes()})
    return "\n".join(lines) + "\n"
