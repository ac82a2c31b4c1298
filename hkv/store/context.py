"""What every part of a `DiskTier` shares (`TierContext`): the opened kvstore, the store key, one lock,
the counters and the progress callback; and the store's small files: their names (`manifest_key`,
`manifest_where`) and reads that never load more than a cap (`TierContext.read_bounded`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Callable
from typing import NamedTuple

import tensorstore as ts

from ..core.reasons import DISK_REASONS
from . import manifest as mf

# a value's size in a kvstore's OUT_OF_RANGE answer: tensorstore's own wording (file, memory, a short
# ranged response) or the body of S3's HTTP 416 (InvalidRange, ActualObjectSize)
_SIZE_OF = re.compile(r"value of size (\d+)|total size (\d+)|<ActualObjectSize>(\d+)</ActualObjectSize>")


def _size_in(msg: str) -> int | None:
    """The value's size an OUT_OF_RANGE error message states, if it states one."""
    m = _SIZE_OF.search(msg)
    return None if m is None else int(next(g for g in m.groups() if g is not None))


def manifest_key(abi: str, segment: str) -> str:
    """The key segment `segment`'s manifest is published under.

    Args:
        abi: the ABI fingerprint (32 hex digits).
        segment: the segment name.
    Returns:
        `manifests/<abi>/<segment>.json`.
    """
    return f"manifests/{abi}/{segment}.json"


def manifest_where(name: str) -> tuple[str, str] | None:
    """Where a manifest key says its manifest belongs.

    Args:
        name: a key of the store.
    Returns:
        (abi, segment) of a well-formed manifest key `manifests/<32 hex>/<segment>.json`, else None.
    """
    parts = name.split("/")
    if len(parts) != 3 or parts[0] != "manifests" or not parts[2].endswith(".json"):
        return None
    abi, seg = parts[1], parts[2][:-5]
    if len(abi) != 32 or any(c not in "0123456789abcdef" for c in abi):
        return None
    if not 0 < len(seg) <= mf.MAX_NAME or mf.NAME.match(seg) is None:
        return None
    return abi, seg


def kvstore_spec(store) -> dict | str:
    """The tensorstore kvstore spec of a `DiskTier(store=...)` argument.

    Args:
        store: a directory path, a kvstore URL, or a tensorstore kvstore spec dict with a 'driver'.
    Returns:
        The URL as given, a `file` spec of the directory's absolute path, or the dict as given.
    Raises:
        ValueError: anything else.
    """
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


class SmallFile(NamedTuple):
    """One small file as `TierContext.read_bounded` read it: (bytes, None); (None, None) for a missing
    key; (None, why) for one larger than the cap or unreadable (a symlink loop, a permission error)."""

    raw: bytes | None
    why: str | None


class Rejection(NamedTuple):
    """A manifest or hit file the tier skipped: the `reason` it is counted under (one of
    `DISK_REASONS`) and `why`, the message (for `verify`'s problems)."""

    reason: str
    why: str


def new_counters() -> dict[str, int]:
    """The `DiskTier.counters` of a new tier: every count 0.

    Returns:
        {"segments_written", "blocks_written", "bytes_written", "write_failures", "hit_write_failures",
        "writes_dropped", "blocks_read", "bytes_read", "segments_evicted", "bytes_evicted",
        "rejected_<reason>" for each of `DISK_REASONS`}.
    """
    return {
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


@dataclasses.dataclass(eq=False)
class TierContext:
    """The state every part of a `DiskTier` shares; the tier's public `kv`, `spec`, `context`,
    `writer_id`, `budget_bytes`, `progress` and `counters` are these fields (assigning the tier's
    assigns them here, so every part sees it).

    Attributes:
        kv: the opened tensorstore KvStore.
        spec: the kvstore spec it was opened from (a URL or a spec dict).
        context: the tensorstore context (shared cache pool, concurrency limits).
        key: the store key (`hkv.store.manifest.StoreKey`), or None for an unauthenticated store.
        writer_id: this writer's name in manifests and hit files.
        budget_bytes: stored bytes the tier may hold (None = unbounded); also the largest segment a
            manifest may describe.
        progress: called with a line per segment written or evicted (None: silent).
        lock: the one lock of the tier's in-memory state (the index, the hit counts, the counters and
            the writer's queue).
        counters: see `new_counters`.
    """

    kv: ts.KvStore
    spec: dict | str
    context: ts.Context
    key: mf.StoreKey | None
    writer_id: str
    budget_bytes: int | None = None
    progress: Callable[[str], None] | None = None
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    counters: dict[str, int] = dataclasses.field(default_factory=new_counters)

    @classmethod
    def open(
        cls,
        store,
        *,
        context: ts.Context | None,
        key: mf.StoreKey | None,
        writer_id: str,
        budget_bytes: int | None,
        progress: Callable[[str], None] | None,
    ) -> TierContext:
        """Open the kvstore of `store` (see `kvstore_spec`).

        Args:
            store: the `DiskTier(store=...)` argument.
            context: a tensorstore context, or None for a new one.
            key: the resolved store key, or None.
            writer_id: this writer's name.
            budget_bytes: see the class docstring.
            progress: see the class docstring.
        Returns:
            The context of a new tier.
        Raises:
            ValueError: a `store` that is none of the forms `kvstore_spec` takes, or cannot be opened.
        """
        spec = kvstore_spec(store)
        context = context or ts.Context()
        try:
            kv = ts.KvStore.open(spec, context=context).result()
        except Exception as e:  # tensorstore raises ValueError/RuntimeError by driver
            raise ValueError(f"cannot open disk tier store {spec!r}: {e}") from None
        return cls(kv, spec, context, key, writer_id, budget_bytes, progress)

    def block_id(self, key: bytes) -> str:
        """The hex id a manifest lists for block key `key` (a keyed hash of it in a keyed store).

        Args:
            key: the engine's block key.
        Returns:
            32 hex digits.
        """
        return self.key.block_id(key) if self.key is not None else key.hex()

    def tokens_field(self, tokens) -> list[int] | str:
        """What a manifest lists for a block's token ids (a keyed digest in a keyed store).

        Args:
            tokens: the block's token ids.
        Returns:
            The ids as ints, or the keyed digest (64 hex digits).
        """
        return self.key.tokens_digest(tokens) if self.key is not None else list(map(int, tokens))

    def say(self, msg: str) -> None:
        """Pass `msg` to `progress`, if set.

        Args:
            msg: one line.
        """
        if self.progress is not None:
            self.progress(msg)

    def read_bounded(self, keys: list[str], cap: int) -> dict[str, SmallFile]:
        """Read small files without ever loading more than `cap` bytes of one. A 1-byte probe at offset
        `cap` first (the kvstore answers OUT_OF_RANGE with the value's size), then a read of exactly
        that many bytes (of at most `cap` where the answer did not state the size: its OUT_OF_RANGE
        states it, then exactly that).

        Args:
            keys: the files' keys.
            cap: the most bytes one file may have.
        Returns:
            {key: `SmallFile`}: (bytes, None); (None, None) for a missing key; (None, why) for one that
            is larger than `cap` or cannot be read (a symlink loop, a permission error).
        """
        out: dict[str, SmallFile] = {}
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
                    out[k] = SmallFile(None, f"unreadable: {msg[:300]}")
                continue
            out[k] = (
                SmallFile(None, None)
                if r.state != "value"
                else SmallFile(None, f"more than {cap:,} bytes, the most such a file may have")
            )
        # never an unbounded read: the object may have grown since the probe (another writer)
        reads = {k: self.kv.read(k, byte_range=slice(0, cap if n is None else n)) for k, n in sizes.items()}
        for k, fut in reads.items():
            try:
                r = fut.result()
            except Exception as e:  # e.g. replaced by a shorter file between the reads
                n = _size_in(str(e)) if sizes[k] is None else None  # a store whose probe answer had no size
                if n is None or n > cap:
                    out[k] = SmallFile(None, f"unreadable: {str(e)[:300]}")
                    continue
                try:
                    r = self.kv.read(k, byte_range=slice(0, n)).result()
                except Exception as e2:  # changed again since: unreadable
                    out[k] = SmallFile(None, f"unreadable: {str(e2)[:300]}")
                    continue
            out[k] = SmallFile(bytes(r.value), None) if r.state == "value" else SmallFile(None, None)
        return out
