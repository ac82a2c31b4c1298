"""`DiskTier`: the on-disk prefix tier — checksummed, atomic, asynchronous, verified before use.

The fifth cache object. Sealed prefix blocks that leave device memory are written here and come back
on a later hit, but only after every byte is proven complete and intact; otherwise the hit is a
shorter plan with a reason (`disk_missing`, `disk_checksum`, `disk_truncated`, `disk_abi`,
`disk_auth`, `disk_malformed`), never an exception in the decode loop and never a wrong token.

Storage (any tensorstore kvstore: `file` by default, `memory`, `ocdbt`, `gcs`, `s3`):

    manifests/<abi>/<segment>.json     the segment's manifest (`hkv.disk_manifest`), published after
                                       its data
    blocks/<id[:2]>/<id>.json          the block's pointer: the segments holding block <id> (its key
                                       hex, or keyed hash), updated after the manifest
                                       (`hkv.store.records`); what a lookup reads
    data/<abi>/<segment>/c/<i>         a zarr3 uint8 array: shards (files) of `shard_bytes` made of
                                       `chunk_bytes` inner chunks, crc32c in the chunk and the
                                       shard-index codecs (its zarr.json is not stored: the
                                       manifest's data_bytes / chunk_bytes / shard_bytes determine it)
    hits/<abi>/<writer>.json           restore counts per block key of one writer (for `stats`)
    budget/usage.json, budget/lease.json, budget/hot/<writer>.json
                                       the usage ledger, the eviction lease and each writer's recently
                                       hit segments (`hkv.store.coord`)

Lookups read computed keys only, never a listing: a chain's pointers, then the manifests they name,
through bounded caches (`hkv.store.index`), so a lookup's cost and a process's memory do not grow
with the store. Whole-store operations (`verify`, `stats`, the evictor) list it in key ranges and
read its manifests a page at a time (`hkv.store.listing`). Stores written before pointers existed
(hkv before issue 47) are not read back: without pointers a lookup finds nothing (no error); `verify`
and `stats` still see their segments, and the budget evicts them.

A *segment* is one write batch (one or more blocks, every object of each block: its COMPRESSED and
INDEXER rows and, when the retention policy kept one, the SWA window and TAIL at its end boundary).
Content addressing: a block is found by (block key, ABI fingerprint); the ABI is also inside the
manifest, so a manifest that claims another fingerprint is rejected as `disk_abi`. The bytes are
written shard by shard (each a whole-file write, pipelined with the copy and checksum of the next)
and the manifest is written only after every shard has committed (a single-key write, atomic in
every kvstore); a reader never sees a partial block, and a writer killed mid-write leaves only
unreferenced data that `verify` reports as orphaned (or, killed between publishing a manifest and
naming the segment in its blocks' pointers, a segment no lookup reaches: `unindexed_blocks`). A
write that fails in the process publishes nothing. Two writers never share a segment name
(random ids), so engines sharing a store cannot corrupt each other.

Writes are asynchronous (`write_async` returns a `concurrent.futures.Future` that resolves once the
manifest is published); reads are issued concurrently and verified (stage 2: ABI; stage 4: dtype,
shape, alignment, per-object sum64 on top of zarr's crc32c) before anything is returned.
No pickle anywhere: manifests are JSON, arrays are raw bytes.

One bad file never disables the store: every manifest and hit file is read with a size cap and
parsed with bounded depth and bounded fields (`hkv.disk_manifest`), and one that is unreadable
(a symlink loop, a permission error), oversized, too deep, malformed, misnamed, stored under
another segment name or ABI directory, or unauthenticated is one *bad segment* counted with its
reason (`disk_malformed`, `disk_checksum`, `disk_abi`, `disk_auth`) by `verify` and `stats`;
every other segment is still found and restored.

Authenticated, private stores (opt-in): with a key (`key=` or the `HKV_STORE_KEY` environment
variable, hex), every manifest carries an HMAC-SHA256 over its content bound to its segment name and
ABI directory, every object its sha256, and block keys and token ids are stored only as keyed
hashes. Someone who can write the store but lacks the key can delete or damage segments (a shorter
plan with `disk_missing` / `disk_checksum` / `disk_auth`), but can no longer make a block restore
another block's bytes or confirm a guessed prompt from the manifests; the cached K/V bytes
themselves are not encrypted. Without a key the store gives integrity against accidents (crc32c,
sum64, schema) but no authenticity: anyone who can write it can forge a block. A store written
with a key restores nothing without it or with another key (`disk_auth`), and vice versa.

The parts (each its own module, composed here): `hkv.store.index` (the bounded lookup caches and the
chain lookups), `hkv.store.records` (block pointers), `hkv.store.read` (verified reads),
`hkv.store.write` (the writer and publisher threads), `hkv.store.layout` (the zarr3 layout of a
segment's bytes), `hkv.store.budget` (eviction), `hkv.store.coord` (ledger, lease, hot segments),
`hkv.store.listing` (paged listings), `hkv.store.hits` (restore counts), `hkv.store.verify` (`verify`
and `stats`), over the state they share (`hkv.store.context.TierContext`) and the values they pass
(`hkv.store.blocks`).
"""

from __future__ import annotations

import concurrent.futures
import os
import uuid
from collections.abc import Callable

import numpy as np
import tensorstore as ts

from ..core.reasons import DISK_REASONS
from . import manifest as mf
from .blocks import (
    ABI,
    AUTH,
    CHECKSUM,
    MALFORMED,
    MISSING,
    TRUNCATED,
    BlockObject,
    BlockPayload,
    BlockRef,
    ChainLookup,
    ReadResult,
    dtype_of,
)
from .budget import Budget
from .context import TierContext
from .hits import HitCounts
from .index import IndexSize, SegmentIndex
from .listing import manifest_pages
from .read import BlockReader
from .verify import store_stats, verify_store
from .write import DiskBacklogError, SegmentWriter

ENV_KEY = "HKV_STORE_KEY"


class DiskTierClosedError(RuntimeError):
    """A `DiskTier` used after `close()` (write, read, find_chain, flush)."""


def resolve_key(key: bytes | str | None) -> mf.StoreKey | None:
    """The store key a `DiskTier` uses.

    Args:
        key: bytes (the raw secret, at least 16 bytes), a str of hex digits (at least 32), b"" or ""
            (explicitly no key: the environment is ignored), or None (the default: the environment
            variable `HKV_STORE_KEY`, hex digits, if set and non-empty; else no key).
    Returns:
        The `hkv.disk_manifest.StoreKey`, or None for an unauthenticated store.
    Raises:
        ValueError: a key that is too short or not hex (the secret is never echoed).
    """
    if key is None:
        env = os.environ.get(ENV_KEY, "").strip()
        if not env:
            return None
        try:
            secret = bytes.fromhex(env)
        except ValueError:
            secret = b""
        if len(secret) < 16:
            raise ValueError(
                f"{ENV_KEY} must be at least 32 hex digits (16 bytes), e.g. the output of "
                f"`python -c 'import os; print(os.urandom(32).hex())'`; it holds {len(env)} "
                f"characters that are not"
            )
        return mf.StoreKey(secret)
    if isinstance(key, str):
        if not key:
            return None
        try:
            key = bytes.fromhex(key)
        except ValueError:
            raise ValueError("key given as a str must be hex digits (at least 32); pass raw bytes as bytes") from None
    if isinstance(key, (bytes, bytearray)):
        return mf.StoreKey(bytes(key)) if key else None
    raise ValueError(f"key must be bytes, a hex str, b'' (no key) or None (read {ENV_KEY}), not {type(key).__name__}")


class _Part:
    """A `DiskTier` attribute that lives on one of its parts: read and assigned through, so that
    `tier.kv = ...` or `tier.budget_bytes = ...` reaches every part that uses it."""

    def __init__(self, part: str, doc: str):
        self.part, self.__doc__ = part, doc

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj, value) -> None:
        setattr(getattr(obj, self.part), self.name, value)


class DiskTier:
    """The on-disk prefix tier. See the module docstring for the format.

    store: a directory (file kvstore), a kvstore URL, or a tensorstore kvstore spec dict (e.g.
    {"driver": "ocdbt", "base": "file:///path"} or {"driver": "memory"}).
    budget_bytes: stored bytes the tier may hold (None = unbounded); over it, whole segments are
    deleted, leaves of the block chains first, least recently hit first.
    chunk_bytes: inner chunk size of the zarr3 shards (a few hundred KiB: large sequential I/O).
    shard_bytes: a segment larger than this is cut into shards (files) of this size, written as a
    pipeline: one shard is copied and checksummed while the previous one is written.
    max_segment_bytes: queued write requests are merged into one segment up to this size (group
    commit; a single larger request is written alone).
    max_queued_bytes: host bytes the writer's queue may hold (None = unbounded); a request beyond it
    fails at once with `DiskBacklogError`.
    linger_seconds: queued writes smaller than one shard wait up to this long for more to share their
    segment (write-behind batches are often one block); `flush` and `write` never wait for it.
    writer_id: this writer's name in manifests and hit files (default: random); 1 to 128 characters
    of [A-Za-z0-9_.-], not starting with '.' or '-'.
    refresh_seconds: how long a block pointer read by a lookup is trusted (how stale the view of other
    writers' segments may get; 0: every lookup reads them).
    max_index_entries: the most block pointers the lookup index caches (manifests: a sixteenth of it,
    at least 16); memory does not grow with the store beyond it.
    key: the store's secret (see `resolve_key`): bytes (at least 16), a hex str, b"" for none, or
    None (default) to read the `HKV_STORE_KEY` environment variable (hex). An explicit argument wins
    over the environment. With a key, manifests are authenticated and block keys and token ids are
    stored only as keyed hashes; manifests written without this key (or with none) are `disk_auth`.
    context: a tensorstore context (None: a new one).
    progress: called with a line per segment written or evicted (None: silent).

    Every argument but `store` and `key` stays an attribute of the same name (`budget_bytes`,
    `refresh_seconds`, `progress`, ... may be reassigned), as do `spec` (the store's kvstore spec), `kv`
    (the opened kvstore) and `counters` (writes, reads, failures, evictions, rejections per reason).
    """

    spec = _Part("_ctx", "The kvstore spec the store was opened from (a URL or a spec dict).")
    context = _Part("_ctx", "The tensorstore context.")
    kv = _Part("_ctx", "The opened tensorstore KvStore.")
    writer_id = _Part("_ctx", "This writer's name in manifests and hit files.")
    budget_bytes = _Part("_ctx", "Stored bytes the tier may hold (None = unbounded).")
    progress = _Part("_ctx", "Called with a line per segment written or evicted (None: silent).")
    counters = _Part(
        "_ctx", "Writes, reads, failures, evictions and rejections per reason (hkv.store.context.new_counters)."
    )
    refresh_seconds = _Part("_index", "How long a block pointer read by a lookup is trusted.")
    chunk_bytes = _Part("_writer", "Inner chunk size of the zarr3 shards.")
    shard_bytes = _Part("_writer", "A segment larger than this is cut into shards (files) of this size.")
    max_segment_bytes = _Part("_writer", "Queued write requests are merged into one segment up to this size.")
    max_queued_bytes = _Part("_writer", "Host bytes the writer's queue may hold (None = unbounded).")
    linger_seconds = _Part("_writer", "How long queued writes smaller than one shard wait for more.")

    def __init__(
        self,
        store="hkv-store",
        *,
        budget_bytes: int | None = None,
        chunk_bytes: int = 1 << 19,
        shard_bytes: int = 1 << 24,
        max_segment_bytes: int = 1 << 26,
        max_queued_bytes: int | None = 1 << 30,
        linger_seconds: float = 0.2,
        writer_id: str | None = None,
        refresh_seconds: float = 0.5,
        max_index_entries: int = 65536,
        context: ts.Context | None = None,
        progress: Callable[[str], None] | None = None,
        key: bytes | str | None = None,
    ):
        if writer_id is not None and (
            not isinstance(writer_id, str) or not 0 < len(writer_id) <= mf.MAX_NAME or mf.NAME.match(writer_id) is None
        ):
            raise ValueError(
                f"{writer_id=} must be 1 to {mf.MAX_NAME} characters of [A-Za-z0-9_.-], not starting with '.' or '-'"
            )
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"{budget_bytes=} must be an integer >= 0 or None")
        if not isinstance(chunk_bytes, int) or chunk_bytes < 4096 or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"{chunk_bytes=} must be a power of two >= 4096")
        if not isinstance(shard_bytes, int) or shard_bytes < chunk_bytes or shard_bytes & (shard_bytes - 1):
            raise ValueError(f"{shard_bytes=} must be a power of two >= chunk_bytes={chunk_bytes}")
        if not isinstance(max_segment_bytes, int) or max_segment_bytes < 1:
            raise ValueError(f"{max_segment_bytes=} must be an integer >= 1")
        if max_queued_bytes is not None and (not isinstance(max_queued_bytes, int) or max_queued_bytes < 1):
            raise ValueError(f"{max_queued_bytes=} must be an integer >= 1 or None")
        if not isinstance(linger_seconds, (int, float)) or not 0 <= linger_seconds <= 60:
            raise ValueError(f"{linger_seconds=} must be a number of seconds in [0, 60]")
        self._ctx = TierContext.open(
            store,
            context=context,
            key=resolve_key(key),
            writer_id=writer_id or uuid.uuid4().hex[:12],
            budget_bytes=budget_bytes,
            progress=progress,
        )
        self._closed = False
        self._index = SegmentIndex(self._ctx, refresh_seconds, max_index_entries)
        self._hits = HitCounts(self._ctx)
        self._reader = BlockReader(self._ctx, self._index, self._hits)
        self._budget = Budget(self._ctx, self._index)
        self._writer = SegmentWriter(
            self._ctx,
            self._index,
            lambda: self.enforce_budget(),  # looked up at each publication, as a method call would be
            chunk_bytes=chunk_bytes,
            shard_bytes=shard_bytes,
            max_segment_bytes=max_segment_bytes,
            max_queued_bytes=max_queued_bytes,
            linger_seconds=linger_seconds,
        )
        self.refresh(force=True)
        self._hits.load_own()

    @property
    def keyed(self) -> bool:
        """Whether this tier authenticates its manifests and hashes block keys and token ids."""
        return self._ctx.key is not None

    @property
    def closed(self) -> bool:
        """Whether `close()` was called (the tier then refuses every write, read and lookup)."""
        return self._closed

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise DiskTierClosedError(
                f"DiskTier.{op}: this DiskTier was closed (close() was called) and no longer reads or writes its "
                f"store; open a new DiskTier on the same store to use it again"
            )

    # ------------------------------------------------------------------------------- index
    def refresh(self, force: bool = False) -> None:
        """Make the next lookups see other writers' segments: with `force`, forget every cached block
        pointer (they are read again); without, nothing (a cached pointer is read again once it is
        `refresh_seconds` old). No I/O: nothing is listed.

        Args:
            force: forget the cached pointers now.
        """
        self._index.refresh(force)

    def index_size(self) -> IndexSize:
        """What the lookup index caches now and its bounds (pointers, manifests)."""
        return self._index.size()

    def contains(self, abi: str, key: bytes) -> tuple[bool, bool]:
        """(stored under `abi`, stored with a snapshot) for block `key`, as its pointer says (read now,
        or cached for at most `refresh_seconds`).

        Args:
            abi: the ABI fingerprint.
            key: the engine's block key.
        Returns:
            (stored, stored with a snapshot).
        """
        return self._index.contains(abi, key)

    def find_chain(self, abi: str, keys: list[bytes], tokens: list[list[int]], start: int = 0) -> ChainLookup:
        """The stored blocks keys[start], keys[start + 1], ... as long as each is present under `abi`
        with equal token ids (a key collision stops the chain). Prefers a copy with a snapshot.
        Reads the chain's block pointers and the manifests they name (GETs of computed keys, issued
        together; cached, see `refresh`), never a listing. A pointer that is damaged or written without
        the store key stops the chain with `disk_malformed` / `disk_auth` (counted as a rejection); a
        segment that is gone or whose manifest is refused is a miss (`absent`).
        In a keyed store the lookup is by the keyed hashes of `keys` and `tokens`; the refs carry the
        raw key, parent and token ids, which `read` returns.

        Args:
            abi: the ABI fingerprint.
            keys: the prompt's block keys.
            tokens: the token ids of each block.
            start: the first block looked up.
        Returns:
            A `ChainLookup`.
        """
        self._check_open("find_chain")
        self.refresh()
        return self._index.find_chain(abi, keys, tokens, start)

    # ------------------------------------------------------------------------------- write
    def write_async(self, abi: str, blocks: list[BlockPayload]) -> concurrent.futures.Future:
        """Write `blocks` in the background. The future resolves to the list of block keys once the
        manifest of the segment holding them is published (an exception if the write failed:
        nothing was published). The arrays must not be modified afterwards (they are host copies).

        Group commit: the requests queued while the writer is busy are written together as one
        segment (same ABI, up to `max_segment_bytes`), so a backlog of small write-behind batches
        becomes a few large segments instead of many small files. A request that would take the
        queued bytes over `max_queued_bytes` is refused at once: its future fails with
        `DiskBacklogError` (counted as `writes_dropped`) and host memory stays bounded; the decode
        loop never waits for the disk.

        Args:
            abi: the ABI fingerprint (32 hex digits).
            blocks: at least one block.
        Returns:
            The future.
        """
        self._check_open("write_async")
        return self._writer.write_async(abi, blocks)

    def write(self, abi: str, blocks: list[BlockPayload]) -> list[bytes]:
        """Synchronous `write_async` (written without lingering).

        Args:
            abi: the ABI fingerprint (32 hex digits).
            blocks: at least one block.
        Returns:
            The block keys, once their segment is published.
        """
        self._check_open("write")
        fut = self.write_async(abi, blocks)
        with self._writer.hurrying():
            return fut.result()

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every write issued so far (its manifest published or its failure recorded);
        queued writes are written at once (no lingering).

        Args:
            timeout: seconds at most (None: no limit).
        """
        self._check_open("flush")
        self._writer.wait(timeout)
        self._hits.save_advisory()

    # -------------------------------------------------------------------------------- read
    def read(
        self,
        refs: list[BlockRef],
        expect: Callable[[BlockRef], dict[str, tuple[np.dtype, tuple]]] | None = None,
        count: bool = True,
    ) -> ReadResult:
        """Read and verify the blocks `refs` (in order; reads issued concurrently). Returns the
        leading blocks that passed every check and the reason the first failing one did not:
        `disk_missing` (manifest or data gone or unreadable), `disk_checksum` (manifest or bytes
        corrupted), `disk_truncated` (data shorter than written), `disk_abi` (manifest claims another
        ABI), `disk_auth` (keyed store: the manifest's HMAC or an object's sha256 is missing or
        wrong), `disk_malformed` (the manifest is unreadable, oversized, outside its schema or
        bounds, or names another segment).

        Args:
            refs: blocks from `find_chain` (or built from a manifest's entries).
            expect: `BlockRef` (as the manifest lists it now) -> {object name: (dtype, shape)} the running
              engine needs for that block.
            count: False (used by `verify`): no hit or rejection is counted.
        Returns:
            A `ReadResult`. Nothing in the store raises out of here (only `DiskTierClosedError`).
        """
        self._check_open("read")
        return self._reader.read(refs, expect, count)

    # ------------------------------------------------------------------------------ budget
    def stored_bytes(self) -> int:
        """Bytes of every published segment's shard files, as the store's usage ledger counts them
        (one GET; corrected by each eviction's listing)."""
        return self._budget.stored_bytes()

    def enforce_budget(self) -> int:
        """Delete whole segments until the stored bytes fit `budget_bytes`: segments no other
        segment's blocks extend first (leaves of the chains), least recently hit (by any writer of the
        store) or written first. A deleted segment's manifest goes first, so a concurrent reader sees
        `disk_missing`, never half a segment. Processes sharing the store never evict at once (a
        lease, `hkv.store.budget`): one that finds another evicting deletes nothing. Returns the
        number of segments deleted."""
        return self._budget.enforce()

    def delete_segment(self, abi: str, segment: str) -> None:
        """Unpublish a segment (manifest first), then delete its data and (in a `file` store) its
        folders, take it off the usage ledger and out of its blocks' pointers: nothing is left behind.

        Args:
            abi: the ABI fingerprint (32 hex digits).
            segment: the segment name.
        Raises:
            ValueError: an `abi` or `segment` that cannot name a segment.
        """
        self._budget.delete_segment(abi, segment)

    # ---------------------------------------------------------------------- verify / stats
    def verify(self) -> dict:
        """Check every manifest, hit file and object's bytes; every problem is reported and the
        check goes on (nothing in the store raises out of here). Safe on a live shared store: a
        segment another writer unpublishes (evicts) while the check runs is left out (neither counted
        nor a problem), and data published since the listing is not an orphan.

        Returns:
            {"segments": published segments indexed, "blocks_ok": n, per reason in `DISK_REASONS`: n
            (blocks, bad manifests and bad hit files), "orphaned_segments": data with no manifest,
            "unindexed_blocks": published blocks whose pointer does not name their segment,
            "unindexed": a line per such block,
            "problems": ["<key>: <reason>: <why>", ..., "data/<abi>/<segment>/: no manifest ..."]}.
        """
        self._check_open("verify")
        self.refresh(force=True)
        return verify_store(self._ctx, self._index, self._hits, self.read).as_dict()

    def iter_segments(self):
        """Every published segment's checked manifest, listed and read a page at a time (never the whole
        store in memory); refused manifests are left out (`verify` reports them).

        Yields:
            (abi, segment, manifest fields) per segment.
        """
        for page in manifest_pages(self._ctx):
            for m in page:
                if m.doc is not None:
                    yield m.sid[0], m.sid[1], m.doc

    def save_hits(self) -> None:
        """Persist this writer's restore counts (read by `stats` of any process); raises what the
        kvstore raises (`flush` and `close` save them without raising)."""
        self._hits.save()

    def stats(self) -> dict:
        """Size, segments, blocks (per ABI) and restore hit counts (all writers that saved them).

        Returns:
            {"store", "segments", "stored_bytes", "budget_bytes", "abis": {abi: {"segments", "blocks",
            "snapshots", "stored_bytes", "hits"}}, "counters", "bad_files": {reason: manifests and hit
            files skipped}}.
        """
        return store_stats(self._ctx, self._hits).as_dict()

    def close(self) -> None:
        """Wait for pending writes, persist hit counts and stop the writer thread. Afterwards
        `closed` is True and writes, reads, lookups and flushes raise `DiskTierClosedError`; a
        second `close()` does nothing."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._writer.shutdown()


__all__ = [
    "ABI",
    "AUTH",
    "CHECKSUM",
    "DISK_REASONS",
    "ENV_KEY",
    "MALFORMED",
    "MISSING",
    "TRUNCATED",
    "BlockObject",
    "BlockPayload",
    "BlockRef",
    "ChainLookup",
    "DiskBacklogError",
    "DiskTier",
    "DiskTierClosedError",
    "ReadResult",
    "dtype_of",
    "resolve_key",
]
