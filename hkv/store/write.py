"""The disk tier's write path (`SegmentWriter`): asynchronous, group-committed, pipelined writes.

Requests queue for one writer thread, which merges those of one ABI into a segment (group commit, up
to `max_segment_bytes`), lays its bytes out (`hkv.store.layout.Layout`), issues its shard writes one
by one while it copies and checksums the next, and hands it to a publisher thread, which publishes
its manifest once every shard has committed (then the blocks exist), then names the segment in each
of its blocks' pointers (then the blocks are found by lookups) and resolves the requests' futures. A
manifest that would be refused is never written, nor its data; one whose pointers fail is deleted
again (a writer killed between the two leaves blocks `verify` reports as `unindexed_blocks`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import threading
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from . import manifest as mf
from .blocks import BlockPayload
from .context import TierContext, manifest_key
from .coord import add_usage
from .digest import digest
from .index import SegmentIndex
from .layout import Layout, open_array
from .records import pointer_adds, update_pointers


class DiskBacklogError(RuntimeError):
    """A write refused because the writer's queue already holds `max_queued_bytes` (the blocks are
    simply not stored: a later hit on them is a miss)."""


@dataclasses.dataclass
class _Request:
    """One `write_async` call waiting for the writer thread."""

    abi: str
    blocks: list[BlockPayload]
    fut: concurrent.futures.Future
    nbytes: int


@dataclasses.dataclass
class _Staged:
    """A segment whose shard writes are issued: its manifest (`doc` and sealed bytes `raw`), to be
    published once every write in `writes` (tensorstore WriteFutures) has committed."""

    doc: dict
    raw: bytes
    writes: list
    blocks: int


class _Plan(NamedTuple):
    """A segment before any I/O: its manifest (sum64 fields still 0), the (object entry, bytes) parts
    and the layout."""

    doc: dict
    parts: list[tuple[dict, np.ndarray]]
    layout: Layout


class SegmentWriter:
    """The writer thread, the publisher thread and the queue between the tier's callers and them.

    Args:
        ctx: the tier's shared state.
        index: where a published segment is indexed.
        published: called (on the publisher thread) after each segment is published: the budget.
        chunk_bytes: inner chunk size of the zarr3 shards.
        shard_bytes: a segment larger than this is cut into shards (files) of this size.
        max_segment_bytes: queued requests are merged into one segment up to this size.
        max_queued_bytes: host bytes the queue may hold (None = unbounded).
        linger_seconds: how long a batch smaller than one shard waits for more requests.

    Attributes:
        queued_bytes: host bytes of the requests queued or being staged (guarded by `ctx.lock`).
        chunk_bytes, shard_bytes, max_segment_bytes, max_queued_bytes, linger_seconds: as above.
    """

    def __init__(
        self,
        ctx: TierContext,
        index: SegmentIndex,
        published: Callable[[], object],
        *,
        chunk_bytes: int,
        shard_bytes: int,
        max_segment_bytes: int,
        max_queued_bytes: int | None,
        linger_seconds: float,
    ):
        self.ctx, self.index, self.published = ctx, index, published
        self.chunk_bytes = chunk_bytes
        self.shard_bytes = shard_bytes
        self.max_segment_bytes = max_segment_bytes
        self.max_queued_bytes = max_queued_bytes
        self.linger_seconds = float(linger_seconds)
        self._cv = threading.Condition(ctx.lock)  # the writer's linger waits on it
        self._hurry = 0  # callers waiting for the queue (flush, write): no lingering
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hkv-disk")
        self._publisher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hkv-disk-publish")
        self._pending: set[concurrent.futures.Future] = set()
        self._queue: collections.deque[_Request] = collections.deque()  # requests not yet staged
        self.queued_bytes = 0
        self._staging = np.empty((0,), np.uint8)  # the writer thread's segment buffer (largest segment so far)

    def write_async(self, abi: str, blocks: list[BlockPayload]) -> concurrent.futures.Future:
        """Queue `blocks` for the writer thread (see `DiskTier.write_async`).

        Args:
            abi: the ABI fingerprint (32 hex digits).
            blocks: at least one block.
        Returns:
            A future of the block keys, resolved once the segment holding them is published; failed at
            once with `DiskBacklogError` when the queue is full.
        Raises:
            ValueError: no blocks. ManifestError: an `abi` that is not 32 hex digits.
            RuntimeError: the writer was shut down.
        """
        if not blocks:
            raise ValueError("write_async needs at least one block")
        mf.check_hex(abi, 32, "abi")
        nbytes = sum(int(np.asarray(a).nbytes) for b in blocks for a, _ in b.objects.values())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._queue and self.max_queued_bytes is not None and self.queued_bytes + nbytes > self.max_queued_bytes:
                self.ctx.counters["writes_dropped"] += 1
                fut.set_exception(
                    DiskBacklogError(
                        f"disk tier backlog: {self.queued_bytes:,} bytes queued + {nbytes:,} would exceed "
                        f"max_queued_bytes={self.max_queued_bytes:,}; these {len(blocks)} blocks are not written"
                    )
                )
                return fut
            self._queue.append(_Request(abi, blocks, fut, nbytes))
            self.queued_bytes += nbytes
            self._pending.add(fut)
            self._cv.notify_all()
        fut.add_done_callback(self._written)
        try:
            self._pool.submit(self._drain)
        except RuntimeError:  # closed
            with self._cv:
                self._queue = collections.deque(r for r in self._queue if r.fut is not fut)
                self.queued_bytes -= nbytes
                self._pending.discard(fut)
            raise
        return fut

    def _take(self) -> tuple[str, list[_Request], int] | None:
        """Writer thread: after the linger, the queued requests of one segment (one ABI, up to
        `max_segment_bytes`, at least one) and their bytes; None if the queue is empty."""
        with self._cv:
            if not self._queue:
                return None  # an earlier drain took this call's request
            # linger: a batch smaller than one shard waits a little for more requests to share its
            # segment (fewer, larger files), unless a caller is waiting (flush, write, close)
            deadline = time.monotonic() + self.linger_seconds
            while not self._hurry and self.queued_bytes < self.shard_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            abi, take, size = self._queue[0].abi, [], 0
            while (
                self._queue
                and self._queue[0].abi == abi
                and (not take or size + self._queue[0].nbytes <= self.max_segment_bytes)
            ):
                take.append(self._queue.popleft())
                size += take[-1].nbytes
        return abi, take, size

    def _drain(self) -> None:
        """Writer thread: take the queued requests (one ABI, up to `max_segment_bytes`, at least one),
        stage them as one segment, then queue its publication and go on with the next segment while
        this one's shards are still being written (manifests are published in write order)."""
        taken = self._take()
        if taken is None:
            return
        abi, take, size = taken
        try:
            try:
                batches = [(self.write_segment(abi, [b for r in take for b in r.blocks]), take)]
            except mf.ManifestError:
                if len(take) == 1:
                    raise
                good = []  # a request whose own manifest would be refused fails alone
                for r in take:
                    try:
                        self._plan(abi, r.blocks)
                        good.append(r)
                    except mf.ManifestError as e:
                        r.fut.set_exception(e)
                batches = [(self.write_segment(abi, [b for r in good for b in r.blocks]), good)] if good else []
        except BaseException as e:  # the callers' futures carry it
            for r in take:
                if not r.fut.done():
                    r.fut.set_exception(e)
            batches = []
        finally:
            with self._cv:
                self.queued_bytes -= size
        for staged, reqs in batches:
            self._publisher.submit(self._publish, staged, reqs)

    def _written(self, fut: concurrent.futures.Future) -> None:
        with self._cv:
            self._pending.discard(fut)
            if fut.exception() is not None:
                self.ctx.counters["write_failures"] += 1

    @contextlib.contextmanager
    def hurrying(self):
        """While inside: the writer does not linger (a caller is waiting for the queue)."""
        with self._cv:
            self._hurry += 1
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                self._hurry -= 1

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every write issued so far (its manifest published or its failure recorded);
        queued writes are written at once (no lingering).

        Args:
            timeout: seconds at most (None: no limit).
        """
        with self.hurrying():
            with self._cv:
                pending = list(self._pending)
            concurrent.futures.wait(pending, timeout=timeout)

    def shutdown(self) -> None:
        """Stop the writer and publisher threads (after what they hold); later writes raise RuntimeError."""
        self._pool.shutdown(wait=True)
        self._publisher.shutdown(wait=True)

    def _plan(self, abi: str, blocks: list[BlockPayload]) -> _Plan:
        """The manifest (sum64 fields still 0), the (object entry, bytes) parts and the layout of a
        segment holding `blocks`; raises `ManifestError` for a manifest that would be refused. No I/O."""
        ctx = self.ctx
        entries, parts, off = [], [], 0
        for b in blocks:
            objs = []
            for name, (arr, row_start) in b.objects.items():
                a = np.ascontiguousarray(arr)
                o = {
                    "name": name,
                    "dtype": a.dtype.name,
                    "shape": list(a.shape),
                    "row_start": int(row_start),
                    "offset": off,
                    "nbytes": int(a.nbytes),
                    "sum64": 0,
                }
                if ctx.key is not None:
                    o["sha256"] = "0" * 64  # computed with the sum64 once the bytes are staged
                objs.append(o)
                parts.append((o, a.reshape(-1).view(np.uint8)))
                off += -(-a.nbytes // mf.ALIGN) * mf.ALIGN
            entries.append(
                {
                    "key": ctx.block_id(b.key),
                    "parent": ctx.block_id(b.parent) if b.parent else "",
                    "index": int(b.index),
                    "length": int(b.length),
                    "tokens": ctx.tokens_field(b.tokens),
                    "indexer_version": int(b.indexer_version),
                    "snapshot": bool(b.snapshot),
                    "objects": objs,
                }
            )
        data_bytes = max(off, 1)
        lay = Layout.plan(data_bytes, self.chunk_bytes, self.shard_bytes)
        # random hex first: the names spread evenly over the key ranges a listing is cut into
        seg = f"{uuid.uuid4().hex[:8]}-{time.strftime('%Y%m%dT%H%M%S')}-{ctx.writer_id}"
        doc = {
            "abi": abi,
            "segment": seg,
            "writer": ctx.writer_id,
            "created": time.time(),
            "data_bytes": data_bytes,
            "stored_bytes": sum(lay.files),
            "chunk_bytes": lay.chunk,
            "shard_bytes": lay.shard,
            "blocks": entries,
        }
        # a manifest that would be refused is never written, nor its data
        mf.check(doc, keyed=ctx.key is not None, max_data_bytes=ctx.budget_bytes)
        return _Plan(doc, parts, lay)

    def write_segment(self, abi: str, blocks: list[BlockPayload]) -> _Staged:
        """Writer thread: lay out, checksum and issue the writes of one segment; returns once
        tensorstore holds a copy of every byte (the staging buffer can take the next segment).

        Args:
            abi: the ABI fingerprint.
            blocks: the blocks of one or more requests.
        Returns:
            The staged segment, for the publisher.
        Raises:
            ManifestError: a manifest that would be refused (nothing written). What tensorstore raises.
        """
        doc, parts, lay = self._plan(abi, blocks)
        arr = open_array(self.ctx.kv, abi, doc["segment"], lay, self.ctx.context).result()
        # Shard k's bytes are copied into the staging buffer and its write is issued at once
        # (tensorstore encodes, writes and fsyncs it on its own threads) before shard k + 1 is
        # copied; the per-object sum64 runs after the last write is issued, while the shards are
        # being written. Every shard write is a whole-shard write (no read-modify-write) and needs no
        # transaction: nothing is visible before the manifest, which is published only after every
        # shard has committed. The staging buffer is reused by the next segment (segments are staged
        # one at a time on the writer thread), so its pages are faulted in once.
        if self._staging.size < lay.padded:
            self._staging = np.empty((lay.padded,), np.uint8)
        buf = self._staging[: lay.padded]
        writes, i = [], 0
        try:
            for lo, hi in lay.shards:
                end = lo
                while i < len(parts) and parts[i][0]["offset"] < hi:
                    o, src = parts[i]
                    s0, s1 = max(o["offset"], lo), min(o["offset"] + o["nbytes"], hi)
                    buf[end:s0] = 0  # alignment padding
                    buf[s0:s1] = src[s0 - o["offset"] : s1 - o["offset"]]
                    end = max(end, s1)
                    if o["offset"] + o["nbytes"] > hi:
                        break  # the object continues in the next shard
                    i += 1
                buf[end:hi] = 0
                writes.append(arr[lo:hi].write(buf[lo:hi]))
            for o, _ in parts:
                o["sum64"] = digest(buf[o["offset"] : o["offset"] + o["nbytes"]])
                if self.ctx.key is not None:
                    o["sha256"] = hashlib.sha256(buf[o["offset"] : o["offset"] + o["nbytes"]]).hexdigest()
            raw = mf.seal(doc, key=self.ctx.key)
            for w in writes:  # tensorstore holds its own copy of every shard: the buffer is free again
                w.copy.result()
        except BaseException:
            for w in writes:  # the staging buffer is not reused while tensorstore may still read it
                with contextlib.suppress(Exception):  # the first failure is the one raised
                    w.result()
            raise
        return _Staged(doc, raw, writes, len(blocks))

    def _publish(self, staged: _Staged, reqs: list[_Request]) -> None:
        """Publisher thread: wait until every shard of the segment has committed, then publish its
        manifest (from here on its blocks exist) and resolve the futures of the requests it holds."""
        ctx = self.ctx
        try:
            for w in staged.writes:
                w.result()
            doc, raw = staged.doc, staged.raw
            key = manifest_key(doc["abi"], doc["segment"])
            with contextlib.suppress(Exception):  # advisory (before the manifest: see hkv.store.coord)
                add_usage(ctx, doc["abi"], 1, doc["stored_bytes"])
            ctx.kv.write(key, raw).result()  # published: from here on the blocks exist
            # then findable: each block's pointer names the segment (compare-and-swap). A pointer
            # naming a segment without a manifest would be a `disk_missing` ref to a concurrent
            # reader, so the manifest goes first; a write that fails here is unpublished again.
            try:
                pointers = update_pointers(ctx.kv, ctx.key, pointer_adds(doc, len(raw)))
            except BaseException:
                with contextlib.suppress(Exception):  # the pointer failure is the one raised
                    ctx.kv.write(key, None).result()  # None: delete the key
                raise
            self.index.add(key, doc, raw, pointers)
            with ctx.lock:
                ctx.counters["segments_written"] += 1
                ctx.counters["blocks_written"] += staged.blocks
                ctx.counters["bytes_written"] += doc["stored_bytes"] + len(raw)
            ctx.say(
                f"disk tier: wrote {staged.blocks} blocks ({doc['stored_bytes']:,} bytes) as segment {doc['segment']}"
            )
            self.published()
        except BaseException as e:  # the callers' futures carry it
            for r in reqs:
                r.fut.set_exception(e)
            return
        for r in reqs:
            r.fut.set_result([b.key for b in r.blocks])
