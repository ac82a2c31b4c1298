"""The disk tier's read path (`BlockReader`): blocks read concurrently and verified before anything is
returned (stage 2: ABI; stage 4: dtype, shape, alignment, per-object digest — `sum64`, or a version
1-2 manifest's crc32 — on top of zarr's crc32c,
and in a keyed store the manifest's HMAC and each object's sha256). A failure is a reason
(`disk_missing`, `disk_checksum`, `disk_truncated`, `disk_abi`, `disk_auth`, `disk_malformed`) with
a detail, classified by the raw shard files where the data failed (`BlockReader.probe`).

The objects a read needs from one segment are read as pieces: runs of objects adjacent in the
segment's bytes (a chain's blocks are written one after another) of up to `PIECE_BYTES`, all issued
at once; each object is a view of its piece. The digests (sum64 or crc32, sha256) are computed on a
thread pool as the pieces arrive (numpy, zlib and hashlib release the GIL), overlapping the reads
still in flight.
A piece that fails is read again object by object, so a failure is found, and classified, exactly
where it lies: an object is refused only for its own bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from . import manifest as mf
from .blocks import AUTH, CHECKSUM, MALFORMED, MISSING, TRUNCATED, BlockPayload, BlockRef, ReadResult, dtype_of
from .context import SmallFile, TierContext, manifest_key
from .digest import LazyPool, digest
from .hits import HitCounts
from .index import SegmentIndex, entry_map
from .layout import Layout, data_prefix, open_array

MAX_PROBED_SHARDS = 64  # shard files `probe` reads to classify one failed read
PIECE_BYTES = 4 << 20  # the most bytes one read of adjacent objects covers

# entry -> {object name: (dtype, shape)} the running engine needs for that block
Expect = Callable[[BlockRef], dict[str, tuple[np.dtype, tuple]]]


class ManifestCheck(NamedTuple):
    """A segment's re-read manifest: (None, "", doc) when it passed, else (reason, detail, None)."""

    reason: str | None
    detail: str
    doc: dict | None


class BlockCheck(NamedTuple):
    """One block's verification: (None, "", payload) when every check passed, else (reason, detail, None)."""

    reason: str | None
    detail: str
    payload: BlockPayload | None


def listed(entries: dict[str, list[dict]], ref: BlockRef) -> dict | None:
    """The entry of a re-read manifest that is exactly the one `ref` was found by (a segment may
    list a key twice: with and without its snapshot, from two requests committed together).

    Args:
        entries: the checked manifest's `index.entry_map` ({block id: its entries}).
        ref: the block as it was indexed.
    Returns:
        The entry, or None.
    """
    return next((b for b in entries.get(ref.entry["key"], ()) if b == ref.entry), None)


class Digests(NamedTuple):
    """An object's bytes as read, with their digest (`sum64` or `crc32`: what its manifest's version
    carries, `manifest.digest_field`) and (keyed store) sha256 hex digest (else None)."""

    raw: np.ndarray
    digest: int
    sha256: str | None


def _digests(raw: np.ndarray, keyed: bool, check: str) -> Digests:
    return Digests(raw, digest(raw, check), hashlib.sha256(raw).hexdigest() if keyed else None)


# the threads that wait for pieces and compute their objects' digests (shared by every tier)
_READS = LazyPool(min(8, os.cpu_count() or 1), "hkv-read")


class _Piece:
    """One read of adjacent objects [lo, hi) of a segment's data array, and the digests of each object
    (`spans`: (start, stop) byte ranges inside [lo, hi); `check`: "sum64" or "crc32") computed on
    `_READS` once it arrives."""

    def __init__(self, arr, lo: int, hi: int, spans: list[tuple[int, int]], keyed: bool, check: str):
        self.arr, self.lo, self.keyed, self.check = arr, lo, keyed, check
        read = arr[lo:hi].read()
        self.done = _READS.get().submit(self._check, read, spans)

    def _check(self, read, spans: list[tuple[int, int]]) -> dict[tuple[int, int], Digests]:
        data = read.result()
        return {(a, b): _digests(data[a - self.lo : b - self.lo], self.keyed, self.check) for a, b in spans}

    def get(self, start: int, stop: int) -> Digests:
        """The object [start, stop): from the piece, or (the piece failed) read again on its own, so
        only a failure in its own bytes raises (zarr's crc32c, a short or a missing chunk)."""
        try:
            return self.done.result()[(start, stop)]
        except Exception:
            return _digests(self.arr[start:stop].read().result(), self.keyed, self.check)


class _ObjectRead(NamedTuple):
    """One object of a block: `result()` gives its `Digests` or raises what its read raised."""

    piece: _Piece
    start: int
    stop: int

    def result(self) -> Digests:
        return self.piece.get(self.start, self.stop)


def _pieces(arr, spans: list[tuple[int, int]], keyed: bool, check: str) -> dict[tuple[int, int], _ObjectRead]:
    """Issue the reads of one segment's object byte ranges `spans` as pieces (runs of objects at most
    `manifest.ALIGN` bytes apart, up to `PIECE_BYTES` each, or one object larger than that), their
    objects' digests of kind `check`."""
    out: dict[tuple[int, int], _ObjectRead] = {}
    run: list[tuple[int, int]] = []

    def flush() -> None:
        if run:
            piece = _Piece(arr, run[0][0], run[-1][1], list(run), keyed, check)
            out.update({sp: _ObjectRead(piece, *sp) for sp in run})
            run.clear()

    for a, b in sorted(set(spans)):
        if run and (a - run[-1][1] >= mf.ALIGN or a < run[-1][1] or b - run[0][0] > PIECE_BYTES):
            flush()
        run.append((a, b))
    flush()
    return out


class BlockReader:
    """Reads and verifies blocks.

    Args:
        ctx: the tier's shared state.
        index: the segment index (the size and digest each manifest was indexed at; restore times).
        hits: where restores are counted.
    """

    def __init__(self, ctx: TierContext, index: SegmentIndex, hits: HitCounts):
        self.ctx, self.index, self.hits = ctx, index, hits

    def read(self, refs: list[BlockRef], expect: Expect | None = None, count: bool = True) -> ReadResult:
        """Read and verify the blocks `refs` (in order; reads issued concurrently). See `DiskTier.read`.

        Args:
            refs: blocks from `find_chain` (or built from a manifest's entries).
            expect: `BlockRef` -> {object name: (dtype, shape)} the running engine needs for that block.
            count: False (used by `verify`): no hit or rejection is counted.
        Returns:
            A `ReadResult`. Nothing in the store raises out of here.
        """
        checked: dict[tuple[str, str], ManifestCheck] = {}
        arrays: dict[tuple[str, str], object] = {}
        entries: dict[tuple[str, str], dict[str, list[dict]]] = {}
        for sid, fut in self._manifest_reads(refs).items():
            checked[sid] = self.checked_manifest(sid, fut)
            if checked[sid].doc is not None:
                arrays[sid] = self._open(sid, checked[sid].doc)
                entries[sid] = entry_map(checked[sid].doc)
        reads = self._object_reads(refs, checked, entries, arrays)
        out: list[BlockPayload] = []
        for r, objs in zip(refs, reads, strict=True):
            sid = (r.abi, r.segment)
            reason, detail, doc = checked[sid]
            if reason is None:
                reason, detail, payload = self.check_block(r, doc, entries[sid], objs, expect)
            if reason is not None:
                with self.ctx.lock:
                    self.ctx.counters[f"rejected_{reason}"] += count
                self._publish_hits(out, count)
                return ReadResult(out, reason, detail)
            out.append(payload)
            if count:
                self._count(r, payload)
        self._publish_hits(out, count)
        return ReadResult(out)

    def _publish_hits(self, payloads: list, count: bool) -> None:
        """After a counted read that restored blocks: publish this writer's hot segments (when a
        segment was hit that the published file does not list as recent), so every evictor ranks them."""
        if count and payloads:
            self.index.hot.publish()

    def _count(self, ref: BlockRef, payload: BlockPayload) -> None:
        """Count one verified block: read counters, its hit, its segment's restore time."""
        with self.ctx.lock:
            self.ctx.counters["blocks_read"] += 1
            self.ctx.counters["bytes_read"] += sum(int(a.nbytes) for a, _ in payload.objects.values())
            self.hits.record(ref.abi, ref.entry["key"])
            self.index.touch((ref.abi, ref.segment))

    def _manifest_reads(self, refs: list[BlockRef]) -> dict[tuple[str, str], object]:
        """The manifest read of every segment `refs` name, issued at once: a read future of the size it
        was indexed at, or (for a segment not indexed) the `SmallFile` of a bounded read."""
        manifests: dict[tuple[str, str], object] = {}
        for r in refs:
            sid = (r.abi, r.segment)
            if sid not in manifests:
                seg = self.index.get(sid)
                name = manifest_key(r.abi, r.segment)
                # a manifest is immutable: re-read exactly the bytes it was indexed at (one that grew
                # fails its checksum, one that shrank is unreadable); never more than the cap
                manifests[sid] = (
                    self.ctx.kv.read(name, byte_range=slice(0, seg.manifest_bytes))
                    if seg is not None
                    else self.ctx.read_bounded([name], mf.MAX_MANIFEST_BYTES)[name]
                )
        return manifests

    def _open(self, sid: tuple[str, str], doc: dict):
        """The open future of segment `sid`'s data array, or None where it cannot be opened."""
        try:
            return open_array(self.ctx.kv, sid[0], sid[1], Layout.of(doc), self.ctx.context)
        except Exception:  # classified per block (`probe`)
            return None

    def _object_reads(self, refs: list[BlockRef], checked: dict, entries: dict, arrays: dict) -> list:
        """Per ref, its objects' reads (`result()` -> `Digests`): [] where its manifest failed or no
        longer lists it, None where its data array could not be opened (both classified by
        `check_block`). Every segment's objects are read in pieces, all issued at once (`_pieces`)."""
        listed_refs: list[tuple[tuple[str, str], dict | None]] = []
        spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for r in refs:
            sid = (r.abi, r.segment)
            entry = None if checked[sid].reason is not None else listed(entries[sid], r)
            listed_refs.append((sid, entry))
            if entry is not None:
                spans.setdefault(sid, []).extend((o["offset"], o["offset"] + o["nbytes"]) for o in entry["objects"])
        keyed = self.ctx.key is not None
        pieces: dict[tuple[str, str], dict | None] = {}
        for sid, sp in spans.items():
            try:
                pieces[sid] = _pieces(arrays[sid].result(), sp, keyed, mf.digest_field(checked[sid].doc))
            except Exception:  # checked (and classified) per block below
                pieces[sid] = None
        reads: list = []
        for sid, entry in listed_refs:
            if entry is None:
                reads.append([])
            elif pieces[sid] is None:
                reads.append(None)
            else:
                reads.append([pieces[sid][(o["offset"], o["offset"] + o["nbytes"])] for o in entry["objects"]])
        return reads

    def checked_manifest(self, sid: tuple[str, str], fut) -> ManifestCheck:
        """The re-read manifest of segment `sid`, checked. A manifest whose size changed since it was
        indexed is re-read whole (bounded) so it is refused for what it now is.

        Args:
            sid: (abi, segment).
            fut: a read of the size it was indexed at, or the `SmallFile` of `TierContext.read_bounded`.
        Returns:
            A `ManifestCheck`.
        """
        ctx = self.ctx
        name = manifest_key(*sid)
        if not isinstance(fut, tuple):
            try:
                res = fut.result()
                fut = SmallFile(bytes(res.value), None) if res.state == "value" else SmallFile(None, None)
            except Exception:  # its size changed, or it became unreadable: look again
                fut = ctx.read_bounded([name], mf.MAX_MANIFEST_BYTES)[name]
        raw, why = fut
        seg = self.index.get(sid)
        if raw is not None and seg is not None and hashlib.blake2b(raw, digest_size=16).digest() == seg.digest:
            return ManifestCheck(None, "", seg.doc)  # the very bytes that passed `parse` when it was indexed
        for second in (False, True):
            if raw is None:
                return (
                    ManifestCheck(MISSING, f"manifest of segment {sid[1]} is gone", None)
                    if why is None
                    else ManifestCheck(MALFORMED, f"manifest of segment {sid[1]}: {why}", None)
                )
            try:
                doc = mf.parse(raw, key=ctx.key, abi=sid[0], segment=sid[1], max_data_bytes=ctx.budget_bytes)
                return ManifestCheck(None, "", doc)
            except mf.ManifestError as e:
                err = e
            if second:
                break
            fresh = ctx.read_bounded([name], mf.MAX_MANIFEST_BYTES)[name]  # grown since it was indexed?
            if fresh.raw == raw:
                break
            raw, why = fresh
        return ManifestCheck(err.reason, f"manifest of segment {sid[1]}: {err}", None)

    def check_block(
        self, ref: BlockRef, doc: dict, entries: dict, objs: list | None, expect: Expect | None
    ) -> BlockCheck:
        """Verify one block of a checked manifest against the engine's expectation and its bytes.

        Args:
            ref: the block.
            doc: its segment's checked manifest.
            entries: `index.entry_map(doc)`.
            objs: its objects' reads (`result()` -> `Digests`), in entry order ([] when the manifest
                no longer lists it, None when the data array could not be opened).
            expect: see `read`.
        Returns:
            A `BlockCheck`.
        """
        sid = (ref.abi, ref.segment)
        entry = listed(entries, ref)
        if entry is None:
            return BlockCheck(
                CHECKSUM, f"segment {sid[1]}'s manifest no longer lists block {ref.entry['key']} as indexed", None
            )
        want = expect(dataclasses.replace(ref, entry=entry)) if expect is not None else None  # (the manifest's)
        if want is not None and set(want) != {o["name"] for o in entry["objects"]}:
            return BlockCheck(
                CHECKSUM,
                (
                    f"block {entry['index']} holds objects {sorted(o['name'] for o in entry['objects'])}, "
                    f"the engine needs {sorted(want)}"
                ),
                None,
            )
        if objs is None:
            return self.probe(sid, doc, "data array unreadable", 0, doc["data_bytes"])
        objects = {}
        field = mf.digest_field(doc)
        for o, fut in zip(entry["objects"], objs, strict=True):
            dt = dtype_of(o["dtype"])
            n = math.prod(o["shape"]) * dt.itemsize
            if o["offset"] % mf.ALIGN or n != o["nbytes"]:
                return BlockCheck(
                    CHECKSUM,
                    f"object {o['name']}: offset {o['offset']} / {o['nbytes']} bytes disagree with "
                    f"{o['dtype']}{o['shape']} at alignment {mf.ALIGN}",
                    None,
                )
            if want is not None and (
                np.dtype(want[o["name"]][0]) != dt or tuple(want[o["name"]][1]) != tuple(o["shape"])
            ):
                return BlockCheck(
                    CHECKSUM,
                    (
                        f"object {o['name']} is {o['dtype']}{o['shape']}, the engine needs "
                        f"{np.dtype(want[o['name']][0]).name}{list(want[o['name']][1])}"
                    ),
                    None,
                )
            try:
                raw, got, sha = fut.result()
            except Exception as e:  # zarr's crc32c, a short or a missing chunk
                return self.probe(sid, doc, str(e), o["offset"], o["nbytes"])
            if got != o[field]:
                return self.probe(sid, doc, f"object {o['name']} fails its {field}", o["offset"], o["nbytes"])
            if self.ctx.key is not None and sha != o["sha256"]:
                return BlockCheck(
                    AUTH,
                    (
                        f"segment {sid[1]} object {o['name']} of block {entry['index']} fails its sha256 "
                        f"(its bytes were replaced by someone without the key)"
                    ),
                    None,
                )
            objects[o["name"]] = (raw.view(dt).reshape(o["shape"]), o["row_start"])
        return BlockCheck(None, "", self._payload(ref, entry, objects))

    def _payload(self, ref: BlockRef, entry: dict, objects: dict) -> BlockPayload:
        """The verified block as the engine gets it back."""
        if self.ctx.key is None:
            key = bytes.fromhex(entry["key"])
            parent = bytes.fromhex(entry["parent"]) if entry["parent"] else None
            tokens = list(entry["tokens"])
        else:  # the manifest holds keyed hashes: the raw values are what find_chain was asked for
            key = ref.raw_key if ref.raw_key is not None else bytes.fromhex(entry["key"])
            parent, tokens = ref.raw_parent, list(ref.raw_tokens or ())
        return BlockPayload(
            key, parent, entry["index"], entry["length"], tokens, entry["indexer_version"], entry["snapshot"], objects
        )

    def probe(self, sid: tuple[str, str], doc: dict, detail: str, offset: int, nbytes: int) -> BlockCheck:
        """Classify a data failure of bytes [offset, offset + nbytes) by the raw shard files holding
        them (at most `MAX_PROBED_SHARDS`, indices computed, never listed): one gone or unreadable,
        one shorter than written, or (all whole) corrupted.

        Args:
            sid: (abi, segment).
            doc: the segment's checked manifest.
            detail: what failed (kept in the `disk_checksum` and `disk_missing` details).
            offset: the first byte that failed.
            nbytes: how many bytes from there.
        Returns:
            A failed `BlockCheck`: `disk_missing`, `disk_truncated` or `disk_checksum`.
        """
        lay = Layout.of(doc)
        first = min(offset // lay.shard, lay.count - 1)
        last = min((offset + max(nbytes, 1) - 1) // lay.shard, lay.count - 1, first + MAX_PROBED_SHARDS - 1)
        for i in range(first, last + 1):
            try:
                raw = self.ctx.kv.read(f"{data_prefix(*sid)}c/{i}").result()
            except Exception as e:  # a symlink loop, a permission error, a directory
                return BlockCheck(MISSING, f"segment {sid[1]}'s data shard {i} is unreadable ({str(e)[:300]})", None)
            if raw.state != "value":
                return BlockCheck(MISSING, f"segment {sid[1]}'s data shard {i} is gone ({detail})", None)
            if len(raw.value) < lay.file_bytes(i):
                return BlockCheck(
                    TRUNCATED,
                    (f"segment {sid[1]}'s data shard {i} has {len(raw.value)} of {lay.file_bytes(i)} bytes"),
                    None,
                )
        return BlockCheck(CHECKSUM, f"segment {sid[1]}: {detail}", None)
