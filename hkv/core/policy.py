"""Prefix-cache policies: what to retain at a block boundary, and what to evict under pressure.

Retention (`RetentionPolicy`): a record at every block boundary always keeps its COMPRESSED and
INDEXER rows (shared pages, nearly free). The SWA window and the TAIL snapshot are what dominate the
cost of caching, so they are kept only at boundaries the policy selects: every block, every N blocks,
or only at branch points (the last boundary of each request and the boundary a hit diverged at).

Eviction (`eviction_order`): candidates are ranked by reconstruction cost per byte, lowest first.
  * a record's SWA + TAIL snapshot: losing it costs recomputing back to the previous restorable
    boundary of the chain (at most the receptive field, layers x window tokens); its bytes are the
    window's rows in every layer plus the TAIL copy — cheap per byte, evicted first;
  * a whole record (its COMPRESSED / INDEXER references): losing it costs a full re-prefill of its
    L tokens for every request that would have hit it; only leaves (records no alive record extends)
    are candidates, so no cached block is ever left unrestorable while still holding memory — the
    cross-type coordinator rule. Ties go least recently used first.

Admission control (`eviction_order(..., used_before=, shorter_than=, never_hit=)`; the engine uses it
when a request needs a record slot only to cache its own new blocks — page pressure in a step keeps
the full policy): the request may evict only objects of chains
  * last used before `used_before` (the request's own previous use: e.g. a finished conversation),
  * reaching less far than `shorter_than` tokens (the request's own restored length), so losses
    concentrate on the chains already shortest instead of every chain losing its tail in turn,
  * or never reused (`never_hit`: no restore hit anywhere on the chain; one-shot content is
    probationary, and it is all a request that restored nothing may displace).
Otherwise it stops caching and keeps what it has. In a round-robin chat the user who just had its
turn is needed furthest in the future, so evicting the other users' more recent chains for it would
only make each of them miss and re-record in turn (a cascade of record evictions). Pinned records are
still never evicted whole, only leaves are, and snapshots still go before records.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .spec import CacheSpec


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """Where SWA + TAIL snapshots are kept. `every_n_blocks=1`: every boundary; `n`: boundaries whose
    block count is a multiple of n; `branch_points_only=True`: only request ends and divergence points."""

    every_n_blocks: int = 1
    branch_points_only: bool = False

    def __post_init__(self):
        if not isinstance(self.every_n_blocks, int) or self.every_n_blocks < 1:
            raise ValueError(f"every_n_blocks={self.every_n_blocks!r} must be a positive integer")

    def retain(self, block_count: int, *, request_end: bool, branch_point: bool) -> bool:
        """Keep the snapshot at the boundary after `block_count` blocks?"""
        if request_end or branch_point:
            return True
        return not self.branch_points_only and block_count % self.every_n_blocks == 0


def snapshot_bytes(spec: CacheSpec) -> int:
    """Bytes one SWA + TAIL snapshot holds (window rows of every layer, TAIL of every compressor)."""
    item = spec.storage_dtype.itemsize
    total = 0
    for l in spec.layers:
        total += (l.window - 1 if l.window else 0) * spec.row_bytes(l.kv_dim)
        for c in (l.compressor, l.indexer):
            if c is not None:
                total += 2 * c.ratio * c.proj_width * item + (c.ratio * c.entry_dim * (item + 4) if c.overlap else 0)
    return total


def record_bytes(spec: CacheSpec) -> int:
    """Bytes of rows one block of `block_tokens` tokens adds to a record: its COMPRESSED and INDEXER
    rows, and its full-attention layers' rows (a record holds its own block's rows of every group
    without a window, `hkv.core.prefix`)."""
    bt = spec.block_tokens
    entries = sum(
        max(bt // c.ratio, 1) * spec.row_bytes(c.entry_dim)
        for l in spec.layers
        for c in (l.compressor, l.indexer)
        if c is not None
    )
    full = sum(bt * spec.row_bytes(l.kv_dim) for l in spec.layers if l.window is None)
    return entries + full or 1


def receptive_field(spec: CacheSpec) -> int:
    """Tokens to recompute so that every layer's SWA window at a boundary is exact: layers x (window - 1)."""
    return sum((l.window - 1) for l in spec.layers if l.window)


def window_rebuild_tokens(spec: CacheSpec) -> int:
    """Tokens a window rebuild (`hkv.core.prefix.restore(recompute=R)`) recomputes, R = the receptive field;
    0 when no rebuild restores exactly: a full-attention layer (window=None) attends to every row
    before the boundary, and the rebuild claims no attention rows (only COMPRESSED / INDEXER ones),
    so a hit without a snapshot must shrink to the last snapshot (or come from disk), never rebuild."""
    if any(l.window is None for l in spec.layers):
        return 0
    return receptive_field(spec)


def _subtree_max(meta: dict[str, np.ndarray], values: np.ndarray) -> np.ndarray:
    """int[NR]: the max of `values` over each alive record and every alive record extending it;
    -1 for records not alive."""
    state, parent, length = meta["state"], meta["parent"], meta["length"]
    alive = state == 1
    out = np.where(alive, values, -1).astype(np.int64)
    for r in sorted(np.nonzero(alive)[0], key=lambda q: -int(length[q])):  # children before parents
        q = int(parent[r])
        if q >= 0 and alive[q]:
            out[q] = max(out[q], out[r])
    return out


def chain_last_used(meta: dict[str, np.ndarray]) -> np.ndarray:
    """int[NR]: the most recent `last_used` over each alive record and every alive record extending it
    (the last use of any chain through it); -1 for records not alive."""
    return _subtree_max(meta, meta["last_used"])


def chain_max_length(meta: dict[str, np.ndarray]) -> np.ndarray:
    """int[NR]: the longest boundary over each alive record and every alive record extending it (how far
    the longest chain through it reaches); -1 for records not alive."""
    return _subtree_max(meta, meta["length"])


def chain_hits(meta: dict[str, np.ndarray]) -> np.ndarray:
    """int[NR]: the most hits (restores) of any alive record on a chain through each alive record (its
    ancestors, itself and every record extending it); 0 means that content was never reused."""
    state, parent, length = meta["state"], meta["parent"], meta["length"]
    alive = state == 1
    up = np.where(alive, meta["hits"], 0).astype(np.int64)
    for r in sorted(np.nonzero(alive)[0], key=lambda q: int(length[q])):  # parents before children
        q = int(parent[r])
        if q >= 0 and alive[q]:
            up[r] = max(up[r], up[q])
    return np.maximum(up, _subtree_max(meta, meta["hits"]))  # the most hits on the path / below


def eviction_order(
    spec: CacheSpec,
    meta: dict[str, np.ndarray],
    pinned: set[int] = frozenset(),
    used_before: int | None = None,
    shorter_than: int | None = None,
    never_hit: bool = False,
) -> list[tuple[str, int]]:
    """[("snapshot" | "record", record index), ...] lowest reconstruction cost per byte first.

    meta: host snapshot of the prefix index — state, parent, length, last_used, swa_held, tail_slot.
    pinned: records running sequences are extending (never evicted whole, so their chains go on).
    used_before, shorter_than, never_hit: admission control — when any is given, only objects whose
    chain (the record and every record extending it) was last used before clock `used_before`, or
    reaches no further than `shorter_than` tokens (exclusive), or (never_hit; meta then needs `hits`)
    whose chains were never restored (one-shot content) are candidates.
    """
    state, parent, length = meta["state"], meta["parent"], meta["length"]
    alive = state == 1
    admission = used_before is not None or shorter_than is not None or never_hit
    if admission:
        old = np.zeros(len(state), bool)
        if never_hit:
            old |= chain_hits(meta) == 0
        if used_before is not None:
            old |= chain_last_used(meta) < used_before
        if shorter_than is not None:
            old |= chain_max_length(meta) < shorter_than
    has_snap = alive & (meta["swa_held"] | (meta["tail_slot"] >= 0))
    children = np.zeros(len(state), int)
    for r in np.nonzero(alive)[0]:
        if parent[r] >= 0:
            children[parent[r]] += 1
    # (a spec of full-attention layers only holds no snapshot bytes: its snapshots go last)
    snap_b, rec_b = max(snapshot_bytes(spec), 1), record_bytes(spec)
    rf = max(receptive_field(spec), 1)
    out = []
    for r in np.nonzero(has_snap)[0]:
        if admission and not old[r]:
            continue
        prev, back, seen = parent[r], spec.block_tokens, {int(r)}
        while prev >= 0 and not has_snap[prev] and prev not in seen:
            seen.add(int(prev))
            back += spec.block_tokens
            prev = parent[prev]
        out.append((min(back, rf) / snap_b, int(meta["last_used"][r]), "snapshot", int(r)))
    for r in np.nonzero(alive & (children == 0))[0]:
        if int(r) in pinned or (admission and not old[r]):
            continue
        out.append((float(length[r]) / rec_b, int(meta["last_used"][r]), "record", int(r)))
    out.sort()
    return [(kind, r) for _, _, kind, r in out]
