"""`DiskTier`: the on-disk prefix tier — checksummed, atomic, asynchronous, verified before use.

The fifth cache object. Sealed prefix blocks that leave device memory are written here and come back
on a later hit, but only after every byte is proven complete and intact; otherwise the hit is a
shorter plan with a reason (`disk_missing`, `disk_checksum`, `disk_truncated`, `disk_abi`,
`disk_auth`, `disk_malformed`), never an exception in the decode loop and never a wrong token.

Storage (any tensorstore kvstore: `file` by default, `memory`, `ocdbt`, `gcs`, `s3`):

    manifests/<abi>/<segment>.json     the segment's manifest (`hkv.disk_manifest`), published LAST
    data/<abi>/<segment>/c/<i>         a zarr3 uint8 array: shards (files) of `shard_bytes` made of
                                       `chunk_bytes` inner chunks, crc32c in the chunk and the
                                       shard-index codecs (its zarr.json is not stored: the
                                       manifest's data_bytes / chunk_bytes / shard_bytes determine it)
    hits/<abi>/<writer>.json           restore counts per block key of one writer (for `stats`)

A *segment* is one write batch (one or more blocks, every object of each block: its COMPRESSED and
INDEXER rows and, when the retention policy kept one, the SWA window and TAIL at its end boundary).
Content addressing: a block is found by (block key, ABI fingerprint); the ABI is also inside the
manifest, so a manifest that claims another fingerprint is rejected as `disk_abi`. The bytes are
written shard by shard (each a whole-file write, pipelined with the copy and checksum of the next)
and the manifest is written only after every shard has committed (a single-key write, atomic in
every kvstore); a reader never sees a partial block, and a writer killed mid-write leaves only
unreferenced data that `verify` reports as orphaned. Two writers never share a segment name
(random ids), so engines sharing a store cannot corrupt each other.

Writes are asynchronous (`write_async` returns a `concurrent.futures.Future` that resolves once the
manifest is published); reads are issued concurrently and verified (stage 2: ABI; stage 4: dtype,
shape, alignment, per-object crc32 on top of zarr's crc32c) before anything is returned.
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
crc32, schema) but no authenticity: anyone who can write it can forge a block. A store written
with a key restores nothing without it or with another key (`disk_auth`), and vice versa.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import threading
import time
import uuid
import zlib
from collections.abc import Callable

import ml_dtypes
import numpy as np
import tensorstore as ts

from ..core.reasons import DISK_REASONS, Reason
from . import manifest as mf

# why a read stops: members of the one `Reason` enum (str labels such as "disk_missing")
MISSING, CHECKSUM, TRUNCATED = Reason.DISK_MISSING, Reason.DISK_CHECKSUM, Reason.DISK_TRUNCATED
ABI, AUTH, MALFORMED = Reason.DISK_ABI, Reason.DISK_AUTH, Reason.DISK_MALFORMED
ENV_KEY = "HKV_STORE_KEY"
MAX_HITS_BYTES = 16 << 20  # a hit file: {"hits": {block key: restores}}
MAX_HITS = 1 << 20  # block keys in one hit file
MAX_PROBED_SHARDS = 64  # shard files `_probe` reads to classify one failed read
# a value's size in a kvstore's OUT_OF_RANGE answer: tensorstore's own wording (file, memory, a short
# ranged response) or the body of S3's HTTP 416 (InvalidRange, ActualObjectSize)
_SIZE_OF = re.compile(r"value of size (\d+)|total size (\d+)|<ActualObjectSize>(\d+)</ActualObjectSize>")


def _size_in(msg: str) -> int | None:
    """The value's size an OUT_OF_RANGE error message states, if it states one."""
    m = _SIZE_OF.search(msg)
    return None if m is None else int(next(g for g in m.groups() if g is not None))


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


def _manifest_where(name: str) -> tuple[str, str] | None:
    """(abi, segment) of a well-formed manifest key `manifests/<32 hex>/<segment>.json`, else None."""
    parts = name.split("/")
    if len(parts) != 3 or parts[0] != "manifests" or not parts[2].endswith(".json"):
        return None
    abi, seg = parts[1], parts[2][:-5]
    if len(abi) != 32 or any(c not in "0123456789abcdef" for c in abi):
        return None
    if not 0 < len(seg) <= mf.MAX_NAME or mf.NAME.match(seg) is None:
        return None
    return abi, seg


def dtype_of(name: str) -> np.dtype:
    """numpy dtype for a manifest dtype name (bfloat16 / float8 via ml_dtypes)."""
    if name not in mf.DTYPES:
        raise ValueError(f"dtype {name!r} must be one of {mf.DTYPES}")
    return np.dtype(getattr(ml_dtypes, name)) if name in ("bfloat16", "float8_e4m3fn") else np.dtype(name)


@dataclasses.dataclass
class BlockPayload:
    """One block's bytes on the host. objects: name -> (array, row_start) (see `hkv.disk_manifest`)."""

    key: bytes
    parent: bytes | None  # None for the first block of a prompt
    index: int
    length: int
    tokens: list[int]
    indexer_version: int
    snapshot: bool
    objects: dict[str, tuple[np.ndarray, int]]


@dataclasses.dataclass(frozen=True)
class BlockRef:
    """A block as a manifest lists it: where its objects are."""

    abi: str
    segment: str
    entry: dict  # the manifest's block entry
    # what `find_chain` was asked for (a keyed store lists only keyed hashes of them)
    raw_key: bytes | None = None
    raw_parent: bytes | None = None
    raw_tokens: tuple[int, ...] | None = None

    @property
    def snapshot(self) -> bool:
        return self.entry["snapshot"]


@dataclasses.dataclass
class ChainLookup:
    """`DiskTier.find_chain`: refs[i] is block start + i (ours, tokens equal); `stop` says why the chain
    ended before the keys did: None (it did not), "absent", "collision" or `disk_abi`."""

    refs: list[BlockRef]
    stop: str | None


@dataclasses.dataclass
class ReadResult:
    """`DiskTier.read`: the verified payloads of refs[:len(payloads)]; `reason` why the next one failed."""

    payloads: list[BlockPayload]
    reason: str | None = None
    detail: str = ""


@dataclasses.dataclass
class _Segment:
    abi: str
    name: str
    manifest_key: str
    manifest_bytes: int  # the size it was indexed at: a re-read reads exactly this many bytes
    digest: bytes  # blake2b of the bytes it was indexed from: an unchanged re-read needs no re-parse
    doc: dict  # the checked manifest
    stored_bytes: int
    created: float
    keys: tuple[str, ...]
    parents: tuple[str, ...]
    last_hit: float = 0.0


def _kvstore_spec(store) -> dict | str:
    if isinstance(store, (str, os.PathLike)):
        s = os.fspath(store)
        if "://" in s:
            return s
        return {"driver": "file", "path": os.path.abspath(s).rstrip("/") + "/"}
    if isinstance(store, dict) and "driver" in store:
        return store
    raise ValueError(
        f"store={store!r} must be a directory path, a kvstore URL (file://, memory://, gs://, s3://) "
        f"or a tensorstore kvstore spec dict with a 'driver'"
    )


def _array_spec(kv: ts.KvStore, n: int, chunk: int, shard: int) -> dict:
    """The zarr3 spec of a segment's data: `n` bytes (uint8), shards of `shard` bytes made of inner
    chunks of `chunk` bytes, crc32c in the chunk and the shard-index codecs."""
    return {
        "driver": "zarr3",
        "kvstore": kv.spec().to_json(),
        "store_data_equal_to_fill_value": True,
        "fill_missing_data_reads": False,  # a missing shard is an error (disk_missing), never zeros
        "metadata": {
            "shape": [n],
            "data_type": "uint8",
            "fill_value": 0,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [shard]}},
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": [chunk],
                        "codecs": [{"name": "bytes"}, {"name": "crc32c"}],
                        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                        "index_location": "end",
                    },
                }
            ],
        },
    }


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a segment's `data_bytes` live: inner `chunk`, the array's `padded` bytes (whole chunks),
    shards of `shard` bytes (the last may be shorter), one file each (`c/<i>`, `files[i]` bytes)."""

    chunk: int
    padded: int
    shard: int

    @property
    def count(self) -> int:
        """Number of shards (bounded by `hkv.disk_manifest.MAX_SHARDS` for a checked manifest)."""
        return -(-self.padded // self.shard)

    def shard_range(self, i: int) -> tuple[int, int]:
        """[lo, hi) byte range of shard i."""
        return i * self.shard, min((i + 1) * self.shard, self.padded)

    def file_bytes(self, i: int) -> int:
        """Bytes of shard i's file: its chunks with their crc32c, and an index over every chunk
        position of a whole shard (16 bytes each) with its crc32c."""
        lo, hi = self.shard_range(i)
        return (hi - lo) // self.chunk * (self.chunk + 4) + self.shard // self.chunk * 16 + 4

    @property
    def shards(self) -> list[tuple[int, int]]:
        """[lo, hi) byte range of every shard."""
        return [self.shard_range(i) for i in range(self.count)]

    @property
    def files(self) -> list[int]:
        """Bytes of each shard file (see `file_bytes`)."""
        return [self.file_bytes(i) for i in range(self.count)]

    @classmethod
    def plan(cls, data_bytes: int, chunk_bytes: int, shard_bytes: int) -> _Layout:
        """The layout a writer picks: a segment smaller than `chunk_bytes` is one chunk rounded up to
        4 KiB (padding stays under 4 KiB); one larger than `shard_bytes` is cut into shards."""
        chunk = min(chunk_bytes, -(-max(data_bytes, 1) // 4096) * 4096)
        padded = -(-max(data_bytes, 1) // chunk) * chunk
        return cls(chunk, padded, min(shard_bytes, padded))

    @classmethod
    def of(cls, doc: dict) -> _Layout:
        """The layout a checked manifest recorded (version 1, no `shard_bytes`: one shard)."""
        chunk = doc["chunk_bytes"]
        padded = -(-max(doc["data_bytes"], 1) // chunk) * chunk
        return cls(chunk, padded, doc.get("shard_bytes") or padded)


def _parse_hits(raw: bytes) -> dict[str, int]:
    """A hit file's {block key hex: restores}, bounded like a manifest.

    Args:
        raw: the file's bytes (at most `MAX_HITS_BYTES`).
    Returns:
        The counts.
    Raises:
        ManifestError: not JSON (`disk_checksum`), too deep or outside the schema (`disk_malformed`).
    """
    doc = mf.load_json(raw, "hit file", MAX_HITS_BYTES, max_depth=2)
    mf._need(
        isinstance(doc, dict) and set(doc) == {"hits"} and isinstance(doc["hits"], dict),
        'a hit file must be {"hits": {block key: restores}}',
    )
    h = doc["hits"]
    mf._need(len(h) <= MAX_HITS, f"a hit file lists {len(h)} blocks, more than {MAX_HITS}")
    for k, n in h.items():
        mf._hex(k, 32, "hit block key")
        mf._int(n, f"hits of block {k}", 0, 1 << 62)
    return h


def _listed(doc: dict, ref: BlockRef) -> dict | None:
    """The entry of a re-read manifest that is exactly the one `ref` was found by (a segment may
    list a key twice: with and without its snapshot, from two requests committed together)."""
    return next((b for b in doc["blocks"] if b["key"] == ref.entry["key"] and b == ref.entry), None)


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
    refresh_seconds: how stale the in-memory view of other writers' manifests may get.
    key: the store's secret (see `resolve_key`): bytes (at least 16), a hex str, b"" for none, or
    None (default) to read the `HKV_STORE_KEY` environment variable (hex). An explicit argument wins
    over the environment. With a key, manifests are authenticated and block keys and token ids are
    stored only as keyed hashes; manifests written without this key (or with none) are `disk_auth`.
    """

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
        self._key = resolve_key(key)
        self.spec = _kvstore_spec(store)
        self.context = context or ts.Context()
        try:
            self.kv = ts.KvStore.open(self.spec, context=self.context).result()
        except Exception as e:  # tensorstore raises ValueError/RuntimeError by driver
            raise ValueError(f"cannot open disk tier store {self.spec!r}: {e}") from None
        self.budget_bytes = budget_bytes
        self.chunk_bytes = chunk_bytes
        self.shard_bytes = shard_bytes
        self.max_segment_bytes = max_segment_bytes
        self.max_queued_bytes = max_queued_bytes
        self.linger_seconds = float(linger_seconds)
        self.writer_id = writer_id or uuid.uuid4().hex[:12]
        self.refresh_seconds = refresh_seconds
        self.progress = progress
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)  # the writer's linger waits on it
        self._hurry = 0  # callers waiting for the queue (flush, write): no lingering
        self._segments: dict[tuple[str, str], _Segment] = {}
        self._blocks: dict[str, list[BlockRef]] = {}  # key hex -> refs in any ABI
        self._bad: dict[str, tuple[str, str]] = {}  # manifest key -> (reason, why) it was rejected
        self._bad_hits: dict[str, tuple[str, str]] = {}  # hit file key -> (reason, why) it was skipped
        self._closed = False
        self._refreshed = -math.inf
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hkv-disk")
        self._publisher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hkv-disk-publish")
        self._pending: set[concurrent.futures.Future] = set()
        self._queue: collections.deque[_Request] = collections.deque()  # requests not yet staged
        self._queued_bytes = 0
        self._staging = np.empty((0,), np.uint8)  # the writer thread's segment buffer (largest segment so far)
        self._hits: dict[str, dict[str, int]] = {}
        self.counters = {
            "segments_written": 0,
            "blocks_written": 0,
            "bytes_written": 0,
            "write_failures": 0,
            "hit_write_failures": 0,
            "writes_dropped": 0,
            "blocks_read": 0,
            "bytes_read": 0,
            "segments_evicted": 0,
            "bytes_evicted": 0,
            **{f"rejected_{r}": 0 for r in DISK_REASONS},
        }
        self.refresh(force=True)
        self._load_own_hits()

    @property
    def keyed(self) -> bool:
        """Whether this tier authenticates its manifests and hashes block keys and token ids."""
        return self._key is not None

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

    def _id(self, key: bytes) -> str:
        """The hex id a manifest lists for block key `key` (a keyed hash of it in a keyed store)."""
        return self._key.block_id(key) if self._key is not None else key.hex()

    def _tokens(self, tokens) -> list[int] | str:
        """What a manifest lists for a block's token ids (a keyed digest in a keyed store)."""
        return self._key.tokens_digest(tokens) if self._key is not None else [int(t) for t in tokens]

    def _read_bounded(self, keys: list[str], cap: int) -> dict[str, tuple[bytes | None, str | None]]:
        """Read small files without ever loading more than `cap` bytes of one: {key: (bytes, None)},
        (None, None) for a missing key, (None, why) for one that is larger than `cap` or cannot be
        read (a symlink loop, a permission error). A 1-byte probe at offset `cap` first (the kvstore
        answers OUT_OF_RANGE with the value's size), then a read of exactly that many bytes (of at most
        `cap` where the answer did not state the size: its OUT_OF_RANGE states it, then exactly that)."""
        out: dict[str, tuple[bytes | None, str | None]] = {}
        sizes: dict[str, int | None] = {}
        probes = {k: self.kv.read(k, byte_range=slice(cap, cap + 1)) for k in keys}
        for k, fut in probes.items():
            try:
                r = fut.result()
            except Exception as e:  # classified: smaller than the cap, or unreadable
                msg = str(e)
                if "OUT_OF_RANGE" in msg:
                    sizes[k] = _size_in(msg)
                else:
                    out[k] = (None, f"unreadable: {msg[:300]}")
                continue
            out[k] = (
                (None, None)
                if r.state != "value"
                else (None, f"more than {cap:,} bytes, the most such a file may have")
            )
        # never an unbounded read: the object may have grown since the probe (another writer)
        reads = {k: self.kv.read(k, byte_range=slice(0, cap if n is None else n)) for k, n in sizes.items()}
        for k, fut in reads.items():
            try:
                r = fut.result()
            except Exception as e:  # e.g. replaced by a shorter file between the reads
                n = _size_in(str(e)) if sizes[k] is None else None  # a store whose probe answer had no size
                if n is None or n > cap:
                    out[k] = (None, f"unreadable: {str(e)[:300]}")
                    continue
                try:
                    r = self.kv.read(k, byte_range=slice(0, n)).result()
                except Exception as e2:  # changed again since: unreadable
                    out[k] = (None, f"unreadable: {str(e2)[:300]}")
                    continue
            out[k] = (bytes(r.value), None) if r.state == "value" else (None, None)
        return out

    def _saved_hits(self):
        """[(abi, writer, {block key hex: restores})] of every valid hit file in the store; a bad or
        unreadable one only loses statistics: it is skipped and recorded in `_bad_hits` (reported
        by `verify` and `stats`)."""
        names = [k.decode(errors="replace") for k in self.kv.list(ts.KvStore.KeyRange("hits/", "hits0")).result()]
        bad, where = {}, {}
        for n in names:
            parts = n.split("/")
            if not n.endswith(".json"):
                continue
            if len(parts) != 3 or _manifest_where(f"manifests/{parts[1]}/{parts[2]}") is None:
                bad[n] = (MALFORMED, "not a hit file name (hits/<32 hex abi>/<writer>.json)")
                continue
            where[n] = (parts[1], parts[2][:-5])
        out = []
        for n, (raw, why) in self._read_bounded(list(where), MAX_HITS_BYTES).items():
            if raw is None:
                if why:
                    bad[n] = (MALFORMED, why)
                continue
            try:
                out.append((*where[n], _parse_hits(raw)))
            except mf.ManifestError as e:
                bad[n] = (e.reason, str(e))
        self._bad_hits = bad
        return out

    def _load_own_hits(self) -> None:
        """A writer reopened under the same `writer_id` continues its saved hit counts."""
        for abi, writer, h in self._saved_hits():
            if writer == self.writer_id:
                self._hits[abi] = h

    # ------------------------------------------------------------------------------- index
    def refresh(self, force: bool = False) -> None:
        """Re-list the published manifests (other writers', other processes'). Cheap when fresh.
        A manifest that cannot be read or fails `hkv.disk_manifest.parse` (its size, depth, schema,
        bounds, checksum, HMAC, or its name and ABI directory against its content) is recorded as
        bad with its reason and never indexed; nothing it holds raises out of here."""
        if not force and time.monotonic() - self._refreshed < self.refresh_seconds:
            return
        names = [
            k.decode(errors="replace") for k in self.kv.list(ts.KvStore.KeyRange("manifests/", "manifests0")).result()
        ]
        names = [n for n in names if n.endswith(".json")]
        with self._lock:
            known = {s.manifest_key: sid for sid, s in self._segments.items()}
            for gone in set(known) - set(names):
                self._drop_segment(known[gone])
            for gone in set(self._bad) - set(names):  # a rejected manifest deleted since
                del self._bad[gone]
            new = [n for n in names if n not in known and n not in self._bad]
        where = {}
        for n in new:
            w = _manifest_where(n)
            if w is None:
                self._bad[n] = (MALFORMED, "not a manifest name (manifests/<32 hex abi>/<segment>.json)")
            else:
                where[n] = w
        for n, (raw, why) in self._read_bounded(list(where), mf.MAX_MANIFEST_BYTES).items():
            if raw is None:
                if why is not None:
                    self._bad[n] = (MALFORMED, why)
                continue
            try:
                doc = mf.parse(
                    raw, key=self._key, abi=where[n][0], segment=where[n][1], max_data_bytes=self.budget_bytes
                )
            except mf.ManifestError as e:
                self._bad[n] = (e.reason, str(e))
                continue
            self._add_segment(n, doc, raw)
        self._refreshed = time.monotonic()

    def _add_segment(self, manifest_key: str, doc: dict, raw: bytes) -> None:
        seg = _Segment(
            abi=doc["abi"],
            name=doc["segment"],
            manifest_key=manifest_key,
            manifest_bytes=len(raw),
            digest=hashlib.blake2b(raw, digest_size=16).digest(),
            doc=doc,
            stored_bytes=doc["stored_bytes"],
            created=float(doc.get("created", 0.0)),
            keys=tuple(b["key"] for b in doc["blocks"]),
            parents=tuple(b["parent"] for b in doc["blocks"]),
        )
        with self._lock:
            if (seg.abi, seg.name) in self._segments:  # a refresh and the writer thread both saw it published
                return
            self._segments[(seg.abi, seg.name)] = seg
            for b in doc["blocks"]:
                self._blocks.setdefault(b["key"], []).append(BlockRef(seg.abi, seg.name, b))

    def _drop_segment(self, sid: tuple[str, str]) -> None:
        with self._lock:
            seg = self._segments.pop(sid, None)
            if seg is None:
                return
            for k in seg.keys:
                refs = [r for r in self._blocks.get(k, []) if (r.abi, r.segment) != sid]
                if refs:
                    self._blocks[k] = refs
                else:
                    self._blocks.pop(k, None)

    def contains(self, abi: str, key: bytes) -> tuple[bool, bool]:
        """(stored under `abi`, stored with a snapshot) for block `key`, as of the last refresh."""
        refs = [r for r in self._blocks.get(self._id(key), []) if r.abi == abi]
        return bool(refs), any(r.snapshot for r in refs)

    def find_chain(self, abi: str, keys: list[bytes], tokens: list[list[int]], start: int = 0) -> ChainLookup:
        """The stored blocks keys[start], keys[start + 1], ... as long as each is present under `abi`
        with equal token ids (a key collision stops the chain). Prefers a copy with a snapshot.
        In a keyed store the lookup is by the keyed hashes of `keys` and `tokens`; the refs carry the
        raw key, parent and token ids, which `read` returns."""
        self._check_open("find_chain")
        self.refresh()
        refs: list[BlockRef] = []
        with self._lock:
            for i in range(start, len(keys)):
                cands = self._blocks.get(self._id(keys[i]), [])
                ours = [r for r in cands if r.abi == abi]
                if not ours:
                    return ChainLookup(refs, ABI if cands else "absent")
                want = self._tokens(tokens[i])
                same = [r for r in ours if r.entry["tokens"] == want and r.entry["index"] == i]
                if not same:
                    return ChainLookup(refs, "collision")
                best = max(same, key=lambda r: (r.snapshot, self._segments[(r.abi, r.segment)].created))
                parent = keys[i - 1] if i > 0 and best.entry["parent"] == self._id(keys[i - 1]) else None
                refs.append(
                    dataclasses.replace(
                        best, raw_key=bytes(keys[i]), raw_parent=parent, raw_tokens=tuple(int(t) for t in tokens[i])
                    )
                )
        return ChainLookup(refs, None)

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
        loop never waits for the disk."""
        self._check_open("write_async")
        if not blocks:
            raise ValueError("write_async needs at least one block")
        mf._hex(abi, 32, "abi")
        nbytes = sum(int(np.asarray(a).nbytes) for b in blocks for a, _ in b.objects.values())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if (
                self._queue
                and self.max_queued_bytes is not None
                and self._queued_bytes + nbytes > self.max_queued_bytes
            ):
                self.counters["writes_dropped"] += 1
                fut.set_exception(
                    DiskBacklogError(
                        f"disk tier backlog: {self._queued_bytes:,} bytes queued + {nbytes:,} would exceed "
                        f"max_queued_bytes={self.max_queued_bytes:,}; these {len(blocks)} blocks are not written"
                    )
                )
                return fut
            self._queue.append(_Request(abi, blocks, fut, nbytes))
            self._queued_bytes += nbytes
            self._pending.add(fut)
            self._cv.notify_all()
        fut.add_done_callback(self._written)
        try:
            self._pool.submit(self._drain)
        except RuntimeError:  # closed
            with self._lock:
                self._queue = collections.deque(r for r in self._queue if r.fut is not fut)
                self._queued_bytes -= nbytes
                self._pending.discard(fut)
            raise
        return fut

    def _drain(self) -> None:
        """Writer thread: take the queued requests (one ABI, up to `max_segment_bytes`, at least one),
        stage them as one segment, then queue its publication and go on with the next segment while
        this one's shards are still being written (manifests are published in write order)."""
        with self._cv:
            if not self._queue:
                return  # an earlier drain took this call's request
            # linger: a batch smaller than one shard waits a little for more requests to share its
            # segment (fewer, larger files), unless a caller is waiting (flush, write, close)
            deadline = time.monotonic() + self.linger_seconds
            while not self._hurry and self._queued_bytes < self.shard_bytes:
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
        try:
            try:
                batches = [(self._write_segment(abi, [b for r in take for b in r.blocks]), take)]
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
                batches = [(self._write_segment(abi, [b for r in good for b in r.blocks]), good)] if good else []
        except BaseException as e:  # the callers' futures carry it
            for r in take:
                if not r.fut.done():
                    r.fut.set_exception(e)
            batches = []
        finally:
            with self._lock:
                self._queued_bytes -= size
        for staged, reqs in batches:
            self._publisher.submit(self._publish, staged, reqs)

    def _written(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.discard(fut)
            if fut.exception() is not None:
                self.counters["write_failures"] += 1

    def write(self, abi: str, blocks: list[BlockPayload]) -> list[bytes]:
        """Synchronous `write_async` (written without lingering)."""
        self._check_open("write")
        fut = self.write_async(abi, blocks)
        with self._hurrying():
            return fut.result()

    @contextlib.contextmanager
    def _hurrying(self):
        """While inside: the writer does not linger (a caller is waiting for the queue)."""
        with self._cv:
            self._hurry += 1
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                self._hurry -= 1

    def _plan(self, abi: str, blocks: list[BlockPayload]) -> tuple[dict, list, _Layout]:
        """The manifest (crc32 fields still 0), the (object entry, bytes) parts and the layout of a
        segment holding `blocks`; raises `ManifestError` for a manifest that would be refused. No I/O."""
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
                    "crc32": 0,
                }
                if self._key is not None:
                    o["sha256"] = "0" * 64  # computed with the crc32 once the bytes are staged
                objs.append(o)
                parts.append((o, a.reshape(-1).view(np.uint8)))
                off += -(-a.nbytes // mf.ALIGN) * mf.ALIGN
            entries.append(
                {
                    "key": self._id(b.key),
                    "parent": self._id(b.parent) if b.parent else "",
                    "index": int(b.index),
                    "length": int(b.length),
                    "tokens": self._tokens(b.tokens),
                    "indexer_version": int(b.indexer_version),
                    "snapshot": bool(b.snapshot),
                    "objects": objs,
                }
            )
        data_bytes = max(off, 1)
        lay = _Layout.plan(data_bytes, self.chunk_bytes, self.shard_bytes)
        seg = f"{time.strftime('%Y%m%dT%H%M%S')}-{self.writer_id}-{uuid.uuid4().hex[:8]}"
        doc = {
            "abi": abi,
            "segment": seg,
            "writer": self.writer_id,
            "created": time.time(),
            "data_bytes": data_bytes,
            "stored_bytes": sum(lay.files),
            "chunk_bytes": lay.chunk,
            "shard_bytes": lay.shard,
            "blocks": entries,
        }
        # a manifest that would be refused is never written, nor its data
        mf.check(doc, keyed=self._key is not None, max_data_bytes=self.budget_bytes)
        return doc, parts, lay

    def _write_segment(self, abi: str, blocks: list[BlockPayload]) -> _Staged:
        """Writer thread: lay out, checksum and issue the writes of one segment; returns once
        tensorstore holds a copy of every byte (the staging buffer can take the next segment)."""
        doc, parts, lay = self._plan(abi, blocks)
        seg = doc["segment"]
        arr = ts.open(
            _array_spec(self.kv / f"data/{abi}/{seg}/", lay.padded, lay.chunk, lay.shard),
            open=True,
            assume_metadata=True,
            context=self.context,
        ).result()
        # Shard k's bytes are copied into the staging buffer and its write is issued at once
        # (tensorstore encodes, writes and fsyncs it on its own threads) before shard k + 1 is
        # copied; the per-object crc32 runs after the last write is issued, while the shards are
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
                o["crc32"] = zlib.crc32(buf[o["offset"] : o["offset"] + o["nbytes"]])
                if self._key is not None:
                    o["sha256"] = hashlib.sha256(buf[o["offset"] : o["offset"] + o["nbytes"]]).hexdigest()
            raw = mf.seal(doc, key=self._key)
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
        try:
            for w in staged.writes:
                w.result()
            doc, raw = staged.doc, staged.raw
            key = f"manifests/{doc['abi']}/{doc['segment']}.json"
            self.kv.write(key, raw).result()  # published: from here on the blocks exist
            self._add_segment(key, doc, raw)
            with self._lock:
                self.counters["segments_written"] += 1
                self.counters["blocks_written"] += staged.blocks
                self.counters["bytes_written"] += doc["stored_bytes"] + len(raw)
            self._say(
                f"disk tier: wrote {staged.blocks} blocks ({doc['stored_bytes']:,} bytes) as segment {doc['segment']}"
            )
            self.enforce_budget()
        except BaseException as e:  # the callers' futures carry it
            for r in reqs:
                r.fut.set_exception(e)
            return
        for r in reqs:
            r.fut.set_result([b.key for b in r.blocks])

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every write issued so far (its manifest published or its failure recorded);
        queued writes are written at once (no lingering)."""
        self._check_open("flush")
        with self._hurrying():
            with self._lock:
                pending = list(self._pending)
            concurrent.futures.wait(pending, timeout=timeout)
        self._save_hits_advisory()

    # -------------------------------------------------------------------------------- read
    def read(
        self,
        refs: list[BlockRef],
        expect: Callable[[dict], dict[str, tuple[np.dtype, tuple]]] | None = None,
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
            expect: entry -> {object name: (dtype, shape)} the running engine needs for that block.
            count: False (used by `verify`): no hit or rejection is counted.
        Returns:
            A `ReadResult`. Nothing in the store raises out of here (only `DiskTierClosedError`).
        """
        self._check_open("read")
        manifests: dict[tuple[str, str], object] = {}
        for r in refs:
            sid = (r.abi, r.segment)
            if sid not in manifests:
                with self._lock:
                    seg = self._segments.get(sid)
                name = f"manifests/{r.abi}/{r.segment}.json"
                # a manifest is immutable: re-read exactly the bytes it was indexed at (one that grew
                # fails its checksum, one that shrank is unreadable); never more than the cap
                manifests[sid] = (
                    self.kv.read(name, byte_range=slice(0, seg.manifest_bytes))
                    if seg is not None
                    else self._read_bounded([name], mf.MAX_MANIFEST_BYTES)[name]
                )
        checked: dict[tuple[str, str], tuple[str | None, str, dict | None]] = {}
        arrays: dict[tuple[str, str], object] = {}
        for sid, fut in manifests.items():
            checked[sid] = self._checked_manifest(sid, fut)
            doc = checked[sid][2]
            if doc is None:
                continue
            lay = _Layout.of(doc)
            try:
                arrays[sid] = ts.open(
                    _array_spec(self.kv / f"data/{sid[0]}/{sid[1]}/", lay.padded, lay.chunk, lay.shard),
                    open=True,
                    assume_metadata=True,
                    context=self.context,
                )
            except Exception:  # classified per block (`_probe`)
                arrays[sid] = None
        # every object read issued at once (tensorstore decodes concurrent reads in parallel, which
        # measured faster than one read over a segment's byte span)
        reads: list = []
        for r in refs:
            sid = (r.abi, r.segment)
            reason, _, doc = checked[sid]
            entry = None if reason is not None else _listed(doc, r)
            if entry is None:
                reads.append([])
                continue
            try:
                arr = arrays[sid].result()
                reads.append([arr[o["offset"] : o["offset"] + o["nbytes"]].read() for o in entry["objects"]])
            except Exception:  # checked (and classified) per block below
                reads.append(None)
        out: list[BlockPayload] = []
        for r, objs in zip(refs, reads, strict=True):
            sid = (r.abi, r.segment)
            reason, detail, doc = checked[sid]
            if reason is None:
                reason, detail, payload = self._check_block(r, doc, objs, expect)
            if reason is not None:
                with self._lock:
                    self.counters[f"rejected_{reason}"] += count
                return ReadResult(out, reason, detail)
            out.append(payload)
            if not count:
                continue
            with self._lock:
                self.counters["blocks_read"] += 1
                self.counters["bytes_read"] += sum(int(a.nbytes) for a, _ in payload.objects.values())
                h = self._hits.setdefault(r.abi, {})
                h[r.entry["key"]] = h.get(r.entry["key"], 0) + 1
                if sid in self._segments:
                    self._segments[sid].last_hit = time.time()
        return ReadResult(out)

    def _checked_manifest(self, sid: tuple[str, str], fut) -> tuple[str | None, str, dict | None]:
        """(reason, detail, None) or (None, "", doc) for the re-read manifest of segment `sid`: `fut` is
        a read of the size it was indexed at, or the (bytes, why) of `_read_bounded`. A manifest whose
        size changed since is re-read whole (bounded) so it is refused for what it now is."""
        name = f"manifests/{sid[0]}/{sid[1]}.json"
        if not isinstance(fut, tuple):
            try:
                res = fut.result()
                fut = (bytes(res.value), None) if res.state == "value" else (None, None)
            except Exception:  # its size changed, or it became unreadable: look again
                fut = self._read_bounded([name], mf.MAX_MANIFEST_BYTES)[name]
        raw, why = fut
        with self._lock:
            seg = self._segments.get(sid)
        if raw is not None and seg is not None and hashlib.blake2b(raw, digest_size=16).digest() == seg.digest:
            return None, "", seg.doc  # the very bytes that passed `parse` when it was indexed
        for second in (False, True):
            if raw is None:
                return (
                    (MISSING, f"manifest of segment {sid[1]} is gone", None)
                    if why is None
                    else (MALFORMED, f"manifest of segment {sid[1]}: {why}", None)
                )
            try:
                return (
                    None,
                    "",
                    mf.parse(raw, key=self._key, abi=sid[0], segment=sid[1], max_data_bytes=self.budget_bytes),
                )
            except mf.ManifestError as e:
                err = e
            if second:
                break
            fresh = self._read_bounded([name], mf.MAX_MANIFEST_BYTES)[name]  # grown since it was indexed?
            if fresh[0] == raw:
                break
            raw, why = fresh
        return err.reason, f"manifest of segment {sid[1]}: {err}", None

    def _check_block(self, ref: BlockRef, doc: dict, objs, expect):
        sid = (ref.abi, ref.segment)
        entry = _listed(doc, ref)
        if entry is None:
            return CHECKSUM, f"segment {sid[1]}'s manifest no longer lists block {ref.entry['key']} as indexed", None
        want = expect(entry) if expect is not None else None
        if want is not None and set(want) != {o["name"] for o in entry["objects"]}:
            return (
                CHECKSUM,
                (
                    f"block {entry['index']} holds objects {sorted(o['name'] for o in entry['objects'])}, "
                    f"the engine needs {sorted(want)}"
                ),
                None,
            )
        if objs is None:
            return self._probe(sid, doc, "data array unreadable", 0, doc["data_bytes"])
        objects = {}
        for o, fut in zip(entry["objects"], objs, strict=True):
            dt = dtype_of(o["dtype"])
            n = int(np.prod(o["shape"], dtype=np.int64)) * dt.itemsize
            if o["offset"] % mf.ALIGN or n != o["nbytes"]:
                return (
                    CHECKSUM,
                    f"object {o['name']}: offset {o['offset']} / {o['nbytes']} bytes disagree with "
                    f"{o['dtype']}{o['shape']} at alignment {mf.ALIGN}",
                    None,
                )
            if want is not None and (
                np.dtype(want[o["name"]][0]) != dt or tuple(want[o["name"]][1]) != tuple(o["shape"])
            ):
                return (
                    CHECKSUM,
                    (
                        f"object {o['name']} is {o['dtype']}{o['shape']}, the engine needs "
                        f"{np.dtype(want[o['name']][0]).name}{list(want[o['name']][1])}"
                    ),
                    None,
                )
            try:
                raw = fut.result()
            except Exception as e:  # zarr's crc32c, a short or a missing chunk
                return self._probe(sid, doc, str(e), o["offset"], o["nbytes"])
            if zlib.crc32(raw) != o["crc32"]:
                return self._probe(sid, doc, f"object {o['name']} fails its crc32", o["offset"], o["nbytes"])
            if self._key is not None and hashlib.sha256(raw).hexdigest() != o["sha256"]:
                return (
                    AUTH,
                    (
                        f"segment {sid[1]} object {o['name']} of block {entry['index']} fails its sha256 "
                        f"(its bytes were replaced by someone without the key)"
                    ),
                    None,
                )
            objects[o["name"]] = (raw.view(dt).reshape(o["shape"]), o["row_start"])
        if self._key is None:
            key = bytes.fromhex(entry["key"])
            parent = bytes.fromhex(entry["parent"]) if entry["parent"] else None
            tokens = list(entry["tokens"])
        else:  # the manifest holds keyed hashes: the raw values are what find_chain was asked for
            key = ref.raw_key if ref.raw_key is not None else bytes.fromhex(entry["key"])
            parent, tokens = ref.raw_parent, list(ref.raw_tokens or ())
        return (
            None,
            "",
            BlockPayload(
                key,
                parent,
                entry["index"],
                entry["length"],
                tokens,
                entry["indexer_version"],
                entry["snapshot"],
                objects,
            ),
        )

    def _probe(self, sid: tuple[str, str], doc: dict, detail: str, offset: int, nbytes: int):
        """Classify a data failure of bytes [offset, offset + nbytes) by the raw shard files holding
        them (at most `MAX_PROBED_SHARDS`, indices computed, never listed): one gone or unreadable,
        one shorter than written, or (all whole) corrupted."""
        lay = _Layout.of(doc)
        first = min(offset // lay.shard, lay.count - 1)
        last = min((offset + max(nbytes, 1) - 1) // lay.shard, lay.count - 1, first + MAX_PROBED_SHARDS - 1)
        for i in range(first, last + 1):
            try:
                raw = self.kv.read(f"data/{sid[0]}/{sid[1]}/c/{i}").result()
            except Exception as e:  # a symlink loop, a permission error, a directory
                return MISSING, f"segment {sid[1]}'s data shard {i} is unreadable ({str(e)[:300]})", None
            if raw.state != "value":
                return MISSING, f"segment {sid[1]}'s data shard {i} is gone ({detail})", None
            if len(raw.value) < lay.file_bytes(i):
                return (
                    TRUNCATED,
                    (f"segment {sid[1]}'s data shard {i} has {len(raw.value)} of {lay.file_bytes(i)} bytes"),
                    None,
                )
        return CHECKSUM, f"segment {sid[1]}: {detail}", None

    # ------------------------------------------------------------------------------ budget
    def stored_bytes(self) -> int:
        with self._lock:
            return sum(s.stored_bytes for s in self._segments.values())

    def enforce_budget(self) -> int:
        """Delete whole segments until the stored bytes fit `budget_bytes`: segments no other
        segment's blocks extend first (leaves of the chains), least recently hit (or written) first.
        A deleted segment's manifest goes first, so a concurrent reader sees `disk_missing`, never
        half a segment. Returns the number of segments deleted."""
        if self.budget_bytes is None:
            return 0
        n = 0
        while True:
            with self._lock:
                total = sum(s.stored_bytes for s in self._segments.values())
                if total <= self.budget_bytes or not self._segments:
                    return n
                # (abi, key) -> segments holding a block whose parent is that key
                extended: dict[tuple[str, str], set[str]] = {}
                for s in self._segments.values():
                    for p in s.parents:
                        extended.setdefault((s.abi, p), set()).add(s.name)
                covered = {}
                for s in self._segments.values():
                    for k in s.keys:
                        covered[(s.abi, k)] = covered.get((s.abi, k), 0) + 1

                def rank(s: _Segment, extended=extended, covered=covered):
                    inner = any(extended.get((s.abi, k), set()) - {s.name} and covered[(s.abi, k)] == 1 for k in s.keys)
                    return (inner, max(s.last_hit, s.created))

                victim = min(self._segments.values(), key=rank)
            self.delete_segment(victim.abi, victim.name)
            n += 1

    def delete_segment(self, abi: str, segment: str) -> None:
        """Unpublish a segment (manifest first), then delete its data and (in a `file` store) its
        folders: nothing is left behind."""
        if _manifest_where(f"manifests/{abi}/{segment}.json") is None:
            raise ValueError(f"abi={abi!r} / segment={segment!r} must be 32 hex digits / a segment name")
        with self._lock:
            seg = self._segments.get((abi, segment))
        self.kv.write(f"manifests/{abi}/{segment}.json", None).result()  # None: delete the key
        prefix = f"data/{abi}/{segment}/"
        self.kv.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()
        self._remove_folders(abi, segment)
        self._drop_segment((abi, segment))
        if seg is not None:
            with self._lock:
                self.counters["segments_evicted"] += 1
                self.counters["bytes_evicted"] += seg.stored_bytes
            self._say(f"disk tier: evicted segment {segment} ({seg.stored_bytes:,} bytes) over budget")

    def _remove_folders(self, abi: str, segment: str) -> None:
        """A `file` store keeps the folders of deleted keys: remove the (now empty) data/<abi>/<segment>/c/
        and data/<abi>/<segment>/ so a deleted segment leaves nothing behind (other kvstores have no
        folders: the range delete was all)."""
        try:
            spec = self.kv.spec().to_json()
        except Exception:  # not a local store
            return
        if spec.get("driver") != "file" or not isinstance(spec.get("path"), str):
            return
        seg_dir = os.path.join(spec["path"], "data", abi, segment)
        for d in (os.path.join(seg_dir, "c"), seg_dir):
            with contextlib.suppress(OSError):  # not empty (a concurrent writer's temporary file) or gone
                os.rmdir(d)

    # ---------------------------------------------------------------------- verify / stats
    def verify(self) -> dict:
        """Check every manifest, hit file and object's bytes; every problem is reported and the
        check goes on (nothing in the store raises out of here). Safe on a live shared store: a
        segment another writer unpublishes (evicts) while the check runs is left out (neither counted
        nor a problem), and data published since the listing is not an orphan.

        Returns:
            {"segments": published segments indexed, "blocks_ok": n, per reason in `DISK_REASONS`: n
            (blocks, bad manifests and bad hit files), "orphaned_segments": data with no manifest,
            "problems": ["<key>: <reason>: <why>", ..., "data/<abi>/<segment>/: no manifest ..."]}.
        """
        self._check_open("verify")
        self.refresh(force=True)
        self._saved_hits()
        report = {
            "segments": 0,
            "blocks_ok": 0,
            **dict.fromkeys(DISK_REASONS, 0),
            "orphaned_segments": 0,
            "problems": [],
        }
        for key, (reason, why) in sorted({**self._bad, **self._bad_hits}.items()):
            report[reason] += 1
            report["problems"].append(f"{key}: {reason}: {why}")
        with self._lock:
            segs = list(self._segments.values())
        gone: set[tuple[str, str]] = set()  # unpublished by another writer while this check ran
        for s in segs:
            refs = [
                BlockRef(s.abi, s.name, r.entry)
                for k in dict.fromkeys(s.keys)
                for r in self._blocks.get(k, [])
                if (r.abi, r.segment) == (s.abi, s.name)
            ]
            ok, problems = 0, []
            while refs:
                try:
                    res = self.read(refs, count=False)
                except Exception as e:  # never expected; still reported, and the check goes on
                    res = ReadResult([], MALFORMED, f"{type(e).__name__}: {e}")
                ok += len(res.payloads)
                if res.reason is None:
                    break
                problems.append((res.reason, f"block {refs[len(res.payloads)].entry['index']}", res.detail))
                refs = refs[len(res.payloads) + 1 :]
            if problems and all(p[0] == MISSING for p in problems) and self._unpublished(s):
                # evicted (manifest first, then data) by another writer sharing the store since the
                # listing: a segment that is gone, not a bad one (`hkv store verify` on a live store)
                gone.add((s.abi, s.name))
                self._drop_segment((s.abi, s.name))
                continue
            report["segments"] += 1
            report["blocks_ok"] += ok
            for reason, where, detail in problems:
                report[reason] += 1
                report["problems"].append(f"{s.manifest_key} {where}: {reason}: {detail}")
        published = {(s.abi, s.name) for s in segs}
        published |= {w for w in map(_manifest_where, list(self._bad)) if w}  # rejected above, not orphans
        data = {
            tuple(k.decode(errors="replace").split("/")[1:3])
            for k in self.kv.list(ts.KvStore.KeyRange("data/", "data0")).result()
        }
        if data - published - gone:  # published since the listing (a write in flight then), or not at all
            published |= {
                w
                for k in self.kv.list(ts.KvStore.KeyRange("manifests/", "manifests0")).result()
                if (w := _manifest_where(k.decode(errors="replace"))) is not None
            }
        orphans = sorted(d for d in data if len(d) == 2 and d not in published and d not in gone)
        report["orphaned_segments"] = len(orphans)
        report["problems"] += [f"data/{a}/{s}/: no manifest (an interrupted write; ignored)" for a, s in orphans]
        return report

    def _unpublished(self, seg: _Segment) -> bool:
        """Whether `seg`'s manifest is no longer in the store (deleted since it was listed)."""
        try:
            return self.kv.read(seg.manifest_key).result().state == "missing"
        except Exception:  # an unreadable store proves nothing: the problems stand
            return False

    def _save_hits_advisory(self) -> None:
        """`save_hits` for `flush` / `close`: hit counts are statistics, so a write that fails (a full
        disk, a read-only store) is counted in `counters["hit_write_failures"]`, never raised."""
        try:
            self.save_hits()
        except Exception as e:  # statistics must not fail a flush (or the engine calling it)
            self.counters["hit_write_failures"] += 1
            self._say(f"disk tier: hit counts not saved ({type(e).__name__}: {str(e)[:200]})")

    def save_hits(self) -> None:
        """Persist this writer's restore counts (read by `stats` of any process); raises what the
        kvstore raises (`flush` and `close` call it through `_save_hits_advisory`)."""
        with self._lock:
            hits = {abi: dict(h) for abi, h in self._hits.items()}
        for abi, h in hits.items():
            self.kv.write(f"hits/{abi}/{self.writer_id}.json", json.dumps({"hits": h}).encode()).result()

    def stats(self) -> dict:
        """Size, segments, blocks (per ABI) and restore hit counts (all writers that saved them).

        Returns:
            {"store", "segments", "stored_bytes", "budget_bytes", "abis": {abi: {"segments", "blocks",
            "snapshots", "stored_bytes", "hits"}}, "counters", "bad_files": {reason: manifests and hit
            files skipped}}.
        """
        self.refresh(force=True)
        saved = self._saved_hits()
        with self._lock:
            segs = list(self._segments.values())
            per_abi: dict[str, dict] = {}
            for s in segs:
                d = per_abi.setdefault(
                    s.abi, {"segments": 0, "blocks": 0, "snapshots": 0, "stored_bytes": 0, "hits": 0}
                )
                d["segments"] += 1
                d["stored_bytes"] += s.stored_bytes
            for refs in self._blocks.values():
                for abi in {r.abi for r in refs}:
                    per_abi[abi]["blocks"] += 1
                    per_abi[abi]["snapshots"] += any(r.snapshot for r in refs if r.abi == abi)
            local = {abi: dict(h) for abi, h in self._hits.items()}
        for abi, writer, h in saved:
            if writer == self.writer_id:
                continue  # this writer's counts are the in-memory ones
            for key, n in h.items():
                local.setdefault(abi, {})
                local[abi][key] = local[abi].get(key, 0) + n
        for abi, h in local.items():
            if abi in per_abi:
                per_abi[abi]["hits"] = sum(h.values())
        return {
            "store": self.spec if isinstance(self.spec, str) else json.dumps(self.spec),
            "segments": len(segs),
            "stored_bytes": sum(s.stored_bytes for s in segs),
            "budget_bytes": self.budget_bytes,
            "abis": per_abi,
            "counters": dict(self.counters),
            "bad_files": dict(collections.Counter(r for r, _ in [*self._bad.values(), *self._bad_hits.values()])),
        }

    def close(self) -> None:
        """Wait for pending writes, persist hit counts and stop the writer thread. Afterwards
        `closed` is True and writes, reads, lookups and flushes raise `DiskTierClosedError`; a
        second `close()` does nothing."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._pool.shutdown(wait=True)
        self._publisher.shutdown(wait=True)

    def _say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(msg)


__all__ = [
    "ABI",
    "AUTH",
    "CHECKSUM",
    "DISK_REASONS",
    "ENV_KEY",
    "MALFORMED",
    "MISSING",
    "TRUNCATED",
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
