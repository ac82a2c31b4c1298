"""Moving cached blocks between the device pools and the disk tier, host side: `swap_out` and the
inputs of `hkv.core.install.swap_in`.

`swap_out` is the host side of write-behind: from one host snapshot of the prefix index it copies
the rows a record's chain needs to host memory (one gather per group over the record's pages, run
before the donated eviction step, so no donated buffer is ever read later) and returns them as
`hkv.store.tier.BlockPayload`s: per block its COMPRESSED / INDEXER rows, and for the record's own block
the SWA window and TAIL snapshot at its boundary.

The transition that installs verified payloads, `hkv.core.install.swap_in`, extends a slot holding
a prefix of L0 tokens (0, or a device-restored prefix) to L1 tokens — reserves the pages (all or
nothing), writes the rows of every group, installs the TAIL at L1, advances and slides. It never
runs on unverified bytes: `hkv.store.tier.DiskTier.read` checks them first. This module builds its
inputs (`swap_in_inputs`, `swap_in_shapes`, the row buckets) on the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..core.layout import CacheLayout, TailState
from ..core.prefix import chain_page_row
from ..core.spec import ObjectKind
from ..core.state import HybridCache
from ..store.tier import BlockPayload
from .block_keys import key_bytes

TAIL_FIELDS = ("tail_kv", "tail_gate", "overlap_kv", "overlap_gate")


def has_indexer(layout: CacheLayout) -> bool:
    """Whether any group holds INDEXER keys (whose version a restored block must match)."""
    return any(g.kind == ObjectKind.INDEXER for g in layout.groups)


def bucket(n: int) -> int:
    """Static row capacity for n rows: the next power of two (>= 1); bounds recompilations."""
    return 1 << max(n - 1, 0).bit_length()


def window_rows(layout: CacheLayout, g: int, length: int) -> tuple[int, int]:
    """Rows [lo, hi) an SWA group holds at a boundary of `length` tokens."""
    grp = layout.groups[g]
    hi = length // grp.unit
    return (0 if grp.keep is None else max(hi - grp.keep, 0)), hi


def expected_objects(layout: CacheLayout, length: int, snapshot: bool) -> dict[str, tuple[np.dtype, tuple]]:
    """{object name: (dtype, shape)} of the block ending at boundary `length` (see hkv.disk_manifest)."""
    bt = layout.spec.block_tokens
    spec = layout.spec
    dt, rdt = np.dtype(spec.storage_dtype), np.dtype(spec.row_dtype())  # TAILs; pool rows (packed with kv_quant)
    out = {}
    for gi, grp in enumerate(layout.groups):
        if grp.kind == ObjectKind.SWA:
            if snapshot:
                lo, hi = window_rows(layout, gi, length)
                out[f"g{gi}.window"] = (rdt, (len(grp.layers), hi - lo, spec.row_width(grp.dim)))
        else:
            n = length // grp.unit - (length - bt) // grp.unit
            out[f"g{gi}.rows"] = (rdt, (len(grp.layers), n, spec.row_width(grp.dim)))
    if snapshot:
        for ci, (_, _, c) in enumerate(layout.spec.compressors()):
            ov = c.ratio if c.overlap else 0
            out[f"t{ci}.tail_kv"] = (dt, (c.ratio, c.proj_width))
            out[f"t{ci}.tail_gate"] = (dt, (c.ratio, c.proj_width))
            out[f"t{ci}.overlap_kv"] = (dt, (ov, c.entry_dim))
            out[f"t{ci}.overlap_gate"] = (np.dtype(np.float32), (ov, c.entry_dim))
    return out


@jax.jit
def _gather(pool: jax.Array, ids: jax.Array) -> jax.Array:
    """pool[:, ids]: [L_g, len(ids), page_size, dim] (a copy; the pool may be donated afterwards)."""
    return pool[:, ids]


def _rows_of(layout: CacheLayout, cache: HybridCache, gi: int, page_row: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Host copy of rows [lo, hi) of group gi through a record's page row int32[M]: [L_g, hi - lo, dim]."""
    grp, ps = layout.groups[gi], layout.page_size
    pool, rdt = cache.groups[gi].pool, np.dtype(layout.spec.row_dtype())
    if hi <= lo:
        return np.zeros((len(grp.layers), 0, pool.shape[-1]), rdt)
    p0, p1 = lo // ps, -(-hi // ps)
    ids = np.zeros((bucket(p1 - p0),), np.int32)
    ids[: p1 - p0] = page_row[p0:p1]
    if np.any(ids[: p1 - p0] < 0):
        raise RuntimeError(f"record maps no page for rows [{lo}, {hi}) of group {gi}")  # an invariant, not input
    got = np.asarray(jax.device_get(_gather(pool, jnp.asarray(ids))))  # [L_g, n, ps, dim]
    got = got.reshape(got.shape[0], -1, got.shape[-1]).view(rdt)  # a uint16 pool's bit patterns: its rows
    return got[:, lo - p0 * ps : hi - p0 * ps]


def record_page_row(layout: CacheLayout, gi: int, meta, rec: np.ndarray) -> np.ndarray:
    """Group gi's logical page -> physical page row (int32[M_g], -1 = none) at the boundary of the
    chain rec int32[n] (rec[j]: the record of block j), `chain_page_row` on the host. meta: a host
    snapshot of `cache.prefix`."""
    return chain_page_row(layout, gi, np.asarray(meta.pages[gi]), rec, len(rec), np)


def swap_out(
    layout: CacheLayout, cache: HybridCache, meta, record: int, blocks: list[int], chain: dict[int, int]
) -> list[BlockPayload]:
    """Host payloads for `blocks` (block indices along `record`'s chain, ascending) of alive record
    `record`. meta: a host snapshot (jax.device_get) of `cache.prefix`; chain: block index -> the
    record of that block on `record`'s parent chain (every block from 0). The block ending at the
    record's own boundary carries the SWA window and TAIL snapshot when the record holds one."""
    bt = layout.spec.block_tokens
    L = int(meta.length[record])
    last = L // bt - 1
    snap = bool(meta.swa_held[record]) and int(meta.tail_slot[record]) >= 0
    out_rows: dict[int, dict[str, tuple[np.ndarray, int]]] = {b: {} for b in blocks}
    lo_tok = min(blocks) * bt
    rec = np.asarray([chain[b] for b in range(last + 1)], np.int32)
    for gi, grp in enumerate(layout.groups):
        row = record_page_row(layout, gi, meta, rec)
        if grp.kind == ObjectKind.SWA:
            if snap and last in out_rows:
                lo, hi = window_rows(layout, gi, L)
                out_rows[last][f"g{gi}.window"] = (_rows_of(layout, cache, gi, row, lo, hi), lo)
            continue
        r_lo, r_hi = lo_tok // grp.unit, (max(blocks) + 1) * bt // grp.unit
        rows = _rows_of(layout, cache, gi, row, r_lo, r_hi)
        for b in blocks:
            a, z = b * bt // grp.unit, (b + 1) * bt // grp.unit
            out_rows[b][f"g{gi}.rows"] = (np.ascontiguousarray(rows[:, a - r_lo : z - r_lo]), a)
    if snap and last in out_rows:
        t = int(meta.tail_slot[record])
        for ci, s in enumerate(meta.snaps):
            for f in TAIL_FIELDS:
                out_rows[last][f"t{ci}.{f}"] = (np.ascontiguousarray(np.asarray(getattr(s, f))[t]), 0)
    payloads = []
    for b in blocks:
        q = chain[b]
        payloads.append(
            BlockPayload(
                key=key_bytes(meta.key[q]),
                parent=key_bytes(meta.key[chain[b - 1]]) if b > 0 else None,
                index=b,
                length=(b + 1) * bt,
                tokens=[int(x) for x in np.asarray(meta.tokens[q])],
                indexer_version=int(meta.iver[q]),
                snapshot=snap and b == last,
                objects=out_rows[b],
            )
        )
    return payloads


def swap_in_shapes(layout: CacheLayout, l0: int, l1: int) -> tuple[tuple, tuple]:
    """(rows, tails) as (dtype, shape) of the `swap_in` inputs that extend a slot from boundary l0 to
    l1: per group the row capacity (COMPRESSED / INDEXER: the rows of n = (l1 - l0) / block_tokens
    blocks, padded to a power of two of the most rows n blocks can hold; a windowed SWA group: its
    `keep` rows; a full-attention group: every row up to l1, padded to a power of two), per
    compressor its TAIL snapshot. So the shapes depend on n alone (and on l1 for full attention):
    one compilation of `swap_in` per value; `swap_in_inputs` builds its arrays from it, and
    `Engine.warmup` compiles them all up front."""
    bt = layout.spec.block_tokens
    n = (l1 - l0) // bt
    snap = expected_objects(layout, bt, snapshot=True)  # dtypes, layer counts, widths and TAIL shapes
    rows = []
    for gi, grp in enumerate(layout.groups):
        dt, (n_layers, _, dim) = snap[f"g{gi}.window" if grp.kind == ObjectKind.SWA else f"g{gi}.rows"]
        if grp.kind == ObjectKind.SWA:
            cap = grp.keep if grp.keep is not None else bucket(l1 // grp.unit)
        else:
            cap = bucket(-(-n * bt // grp.unit))  # n blocks cross at most ceil(n * bt / unit) row boundaries
        rows.append((dt, (n_layers, cap, dim)))
    tails = tuple(
        TailState(**{f: snap[f"t{ci}.{f}"] for f in TAIL_FIELDS}) for ci in range(len(layout.spec.compressors()))
    )
    return tuple(rows), tails


def swap_in_inputs(layout: CacheLayout, payloads: list[BlockPayload], l0: int) -> tuple[tuple, tuple]:
    """(rows, tails) for `swap_in` from verified payloads of consecutive blocks starting at boundary
    l0, the last of which carries the snapshot at l1 (shapes: `swap_in_shapes`)."""
    last = payloads[-1]
    shapes, _ = swap_in_shapes(layout, l0, last.length)
    rows = []
    for gi, grp in enumerate(layout.groups):
        if grp.kind == ObjectKind.SWA:
            a = last.objects[f"g{gi}.window"][0]
        else:
            a = np.concatenate([p.objects[f"g{gi}.rows"][0] for p in payloads], axis=1)
        buf = np.zeros(shapes[gi][1], a.dtype)
        buf[:, : a.shape[1]] = a
        rows.append(buf)
    tails = tuple(
        TailState(**{f: last.objects[f"t{ci}.{f}"][0] for f in TAIL_FIELDS})
        for ci in range(len(layout.spec.compressors()))
    )
    return tuple(rows), tails


def swap_in_size(rows: tuple) -> str:
    """The bucket label of `swap_in` inputs (its compiled-step name: "swap_in[4x2x8]", rows per group)."""
    return "x".join(str(r.shape[1]) for r in rows)


def swap_in_warmup_inputs(layout: CacheLayout) -> list[tuple[tuple, tuple]]:
    """Zero (rows, tails) for every distinct `swap_in_shapes` of a restore from disk (any l0 < l1 on
    block boundaries): what `Engine.warmup` compiles. With full-attention layers, a restore from
    l0 > 0 can need a shape not listed here (their rows follow l1), compiled at first use."""
    bt, seen, out = layout.spec.block_tokens, set(), []
    for l1 in range(bt, layout.config.max_context + 1, bt):
        rows, _ = swap_in_shapes(layout, 0, l1)
        if rows in seen:
            continue
        seen.add(rows)
        out.append(swap_in_zero_inputs(layout, 0, l1))
    return out


def swap_in_zero_inputs(layout: CacheLayout, l0: int, l1: int) -> tuple[tuple, tuple]:
    """Zero (rows, tails) host arrays of the `swap_in` inputs that extend a slot from boundary l0 to
    l1 (`swap_in_shapes`): what a build of that bucket's step lowers, without any block's bytes."""
    rows, tails = swap_in_shapes(layout, l0, l1)
    return (
        tuple(np.zeros(shape, dt) for dt, shape in rows),
        tuple(TailState(**{f: np.zeros(getattr(t, f)[1], getattr(t, f)[0]) for f in TAIL_FIELDS}) for t in tails),
    )


__all__ = [
    "bucket",
    "expected_objects",
    "has_indexer",
    "record_page_row",
    "swap_in_inputs",
    "swap_in_shapes",
    "swap_in_size",
    "swap_in_warmup_inputs",
    "swap_in_zero_inputs",
    "swap_out",
    "window_rows",
]
