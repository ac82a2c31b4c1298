"""`Reason`: why a prefix hit restored less than it matched — the one vocabulary of rejections.

The device index (`hkv.core.prefix.restore`), the disk tier (`hkv.store`), `RestorePlan.reason`,
the engine's metrics and the CLI all use these members. A member is a `str` (its value is the label
used in metrics and JSON, e.g. ``"disk_checksum"``) and has a stable integer `code` (1-based; 0 means
"no reason") for device arrays.
"""

from __future__ import annotations

import enum

STAGES = ("hash", "lifecycle", "abi", "intersection", "byte")
"""The validation stages of a lookup, in order (`RestorePlan.first_failed_stage`)."""


class Reason(enum.StrEnum):
    """Why a plan stopped where it did. Members compare equal to their labels."""

    NO_HASH_MATCH = "no_hash_match"  # the chained block hash matched no block of the prompt
    COLLISION = "collision"  # a record's token ids differ from the prompt's (hash collision)
    FREED = "freed"  # a record was evicted (a tombstone) or one of its pages was freed
    PAGE_REUSED = "page_reused"  # a recorded page now belongs to another sequence
    ABI_MISMATCH = "abi_mismatch"  # the record was written under another ABI fingerprint
    SWA_MISSING = "swa_missing"  # no kept SWA window at the boundary
    TAIL_MISSING = "tail_missing"  # no TAIL snapshot at the boundary
    INDEXER_VERSION = "indexer_version"  # indexer keys of an older version
    CHECKSUM = "checksum"  # the snapshot's bytes no longer match their checksum
    DISK_CHECKSUM = "disk_checksum"  # a disk-tier manifest or chunk fails its checksum
    DISK_MISSING = "disk_missing"  # a block the index or a tombstone says is on disk is not (manifest or data gone)
    DISK_ABI = "disk_abi"  # the stored block was written by another ABI fingerprint
    DISK_TRUNCATED = "disk_truncated"  # a disk-tier chunk is shorter than written
    DISK_AUTH = "disk_auth"  # a keyed disk-tier manifest's HMAC (or an object's sha256) is missing or wrong
    DISK_MALFORMED = "disk_malformed"  # a disk-tier manifest is unreadable, oversized or outside its schema

    @property
    def code(self) -> int:
        """Stable integer code (1-based, declaration order) stored in device arrays; 0 = no reason."""
        return _CODES[self]

    @property
    def stage(self) -> str:
        """The validation stage (one of `STAGES`) this reason belongs to."""
        return STAGES[_STAGE[self]]

    @classmethod
    def from_code(cls, code: int) -> Reason | None:
        """The member with integer `code`, or None for 0. ValueError for an unknown code."""
        code = int(code)
        if code == 0:
            return None
        if not 1 <= code <= len(_MEMBERS):
            raise ValueError(f"reason code {code} must be in [0, {len(_MEMBERS)}]")
        return _MEMBERS[code - 1]


_MEMBERS = tuple(Reason)
_CODES = {r: i + 1 for i, r in enumerate(_MEMBERS)}
_STAGE = {
    Reason.NO_HASH_MATCH: 0,
    Reason.COLLISION: 1,
    Reason.FREED: 1,
    Reason.PAGE_REUSED: 1,
    Reason.ABI_MISMATCH: 2,
    Reason.DISK_ABI: 2,
    Reason.SWA_MISSING: 3,
    Reason.TAIL_MISSING: 3,
    Reason.INDEXER_VERSION: 3,
    Reason.CHECKSUM: 4,
    Reason.DISK_CHECKSUM: 4,
    Reason.DISK_MISSING: 4,
    Reason.DISK_TRUNCATED: 4,
    Reason.DISK_AUTH: 4,
    Reason.DISK_MALFORMED: 4,
}
DISK_REASONS = tuple(r for r in Reason if r.startswith("disk_"))
"""The reasons the disk tier reports (a subset of `Reason`)."""

__all__ = ["DISK_REASONS", "STAGES", "Reason"]
