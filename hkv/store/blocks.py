"""The disk tier's values: what its parts pass each other and what `DiskTier` returns (all importable
from `hkv.store.tier` too): a block's bytes (`BlockPayload`), where a manifest lists it (`BlockRef`),
a chain lookup (`ChainLookup`), a verified read (`ReadResult`), an indexed segment (`Segment`), and the
reasons a read stops (members of `hkv.core.reasons.Reason`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import ml_dtypes
import numpy as np

from ..core.reasons import Reason
from . import manifest as mf

# why a read stops: members of the one `Reason` enum (str labels such as "disk_missing")
MISSING, CHECKSUM, TRUNCATED = Reason.DISK_MISSING, Reason.DISK_CHECKSUM, Reason.DISK_TRUNCATED
ABI, AUTH, MALFORMED = Reason.DISK_ABI, Reason.DISK_AUTH, Reason.DISK_MALFORMED


def dtype_of(name: str) -> np.dtype:
    """numpy dtype for a manifest dtype name (bfloat16 / float8 via ml_dtypes).

    Args:
        name: one of `hkv.store.manifest.DTYPES`.
    Returns:
        The dtype.
    Raises:
        ValueError: another name.
    """
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


class BlockObject(NamedTuple):
    """One stored object of a block (`BlockRef.objects`): its name, storage dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


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
        """Whether the block carries its boundary's snapshot (SWA window and TAIL)."""
        return self.entry["snapshot"]

    @property
    def length(self) -> int:
        """Tokens up to the block's end boundary."""
        return self.entry["length"]

    @property
    def objects(self) -> list[BlockObject]:
        """The block's stored objects (name, storage dtype name, shape), in the manifest's order."""
        return [BlockObject(o["name"], o["dtype"], tuple(o["shape"])) for o in self.entry["objects"]]


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
class Segment:
    """A published segment as the lookup index caches it (`hkv.store.index.SegmentIndex`)."""

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
    entries: dict[str, list[dict]] = dataclasses.field(default_factory=dict)  # block id -> its entries

    @property
    def sid(self) -> tuple[str, str]:
        """(abi, name): the segment's key in the index."""
        return self.abi, self.name
