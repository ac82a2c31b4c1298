"""The disk tier's small fixed-size records beside the manifests: block pointers (`blocks/...`, what a
lookup reads), the usage ledger and the eviction lease (`budget/...`). Each is one JSON object padded
with spaces to a fixed size, so one ranged GET of exactly that size reads it (a larger object is never
loaded: only its first bytes, which then fail their checksum), and each is updated by compare-and-swap
(`update_record`: a read's storage generation passed as the write's `if_equal`), so concurrent writers
on any kvstore that supports conditional writes (file, memory, gcs, s3) never lose an update.

    blocks/<id[:2]>/<id>.json   {"format": "hkv-disk-pointer", "version": 1, "block": "<id>",
                                 "holders": {"<abi>": [["<segment>", snapshot, manifest bytes], ...]},
                                 "checksum": crc32 [, "auth": "hmac-sha256", "hmac": ...]}

`<id>` is the block id a manifest lists (the block key's hex, or its keyed hash in a keyed store, so a
name tells someone without the key nothing). In a keyed store a pointer carries an HMAC bound to its
name: one written, edited or moved without the key is refused as `disk_auth`.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import random
import time
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

from . import manifest as mf
from .blocks import AUTH, MALFORMED

POINTER_FORMAT = "hkv-disk-pointer"
POINTER_VERSION = 1
POINTER_BYTES = 2048  # every pointer object is exactly this long (padded with spaces)
MAX_HOLDERS = 16  # segments one pointer names (the oldest are dropped beyond it)
CAS_TRIES = 200  # compare-and-swap attempts before an update gives up


class Holder(NamedTuple):
    """A segment that holds a block: its ABI, its name, whether its copy carries the snapshot, and its
    manifest's size in bytes (so a lookup reads it with one ranged GET; 0 when unknown)."""

    abi: str
    segment: str
    snapshot: bool
    manifest_bytes: int = 0

    @property
    def sid(self) -> tuple[str, str]:
        """(abi, segment)."""
        return self.abi, self.segment


@dataclasses.dataclass(frozen=True)
class Pointer:
    """A checked block pointer: the block id and the segments holding it (oldest first)."""

    block: str
    holders: tuple[Holder, ...]


class Fixed(NamedTuple):
    """One fixed-size record as `read_fixed` read it: its bytes (None when missing or unreadable), its
    storage generation (for a conditional write; b"" when unknown), and why it is unreadable."""

    raw: bytes | None
    generation: bytes
    why: str | None


def pointer_key(block: str) -> str:
    """The key of block `block`'s pointer.

    Args:
        block: the block id (32 hex digits).
    Returns:
        `blocks/<block[:2]>/<block>.json`.
    """
    return f"blocks/{block[:2]}/{block}.json"


def read_fixed(kv, key: str, size: int):
    """Issue the read of a fixed-size record (exactly `size` bytes: never more).

    Args:
        kv: the tensorstore KvStore.
        key: the record's key.
        size: its size.
    Returns:
        The read's future; pass it to `fixed_result`.
    """
    return kv.read(key, byte_range=slice(0, size))


def fixed_result(fut) -> Fixed:
    """The `Fixed` of a `read_fixed` future: a missing key is (None, its generation, None); a shorter
    object or a read error is (None, b"", why)."""
    try:
        r = fut.result()
    except Exception as e:  # shorter than the size (OUT_OF_RANGE), a symlink loop, a permission error
        return Fixed(None, b"", f"unreadable: {str(e)[:300]}")
    if r.state != "value":
        return Fixed(None, bytes(r.stamp.generation), None)
    return Fixed(bytes(r.value), bytes(r.stamp.generation), None)


def pad(raw: bytes, size: int) -> bytes:
    """`raw` padded with spaces to `size` bytes (JSON allows trailing whitespace).

    Raises:
        ValueError: `raw` longer than `size`.
    """
    if len(raw) > size:
        raise ValueError(f"record of {len(raw)} bytes must be at most {size}")
    return raw + b" " * (size - len(raw))


def seal_record(doc: dict, kind: str, name: str, key: mf.StoreKey | None) -> bytes:
    """A record's bytes (unpadded): `doc` plus its crc32 and, with `key`, its HMAC bound to (kind, name).

    Args:
        doc: the record's fields (format and version included).
        kind: what it is ("pointer").
        name: the key it is stored under.
        key: the store key, or None.
    Returns:
        The JSON bytes.
    """
    full = dict(doc)
    if key is not None:
        full["auth"] = mf.AUTH_SCHEME
    canonical = json.dumps(full, sort_keys=True, separators=(",", ":")).encode()
    tail = b',"checksum":%d' % zlib.crc32(canonical)
    if key is not None:
        tail += b',"hmac":"%s"' % key.record_mac(kind, name, canonical).encode()
    return canonical[:-1] + tail + b"}"


def open_record(raw: bytes, kind: str, name: str, key: mf.StoreKey | None, max_depth: int) -> dict:
    """Check a record's size-bounded JSON, crc32 and (keyed store) HMAC; returns its fields.

    Args:
        raw: the bytes read (at most the record's fixed size).
        kind: what it must be ("pointer").
        name: the key it was read from.
        key: the store key, or None (then it must carry no HMAC).
        max_depth: its JSON nesting bound.
    Returns:
        The fields but checksum, auth and hmac.
    Raises:
        ManifestError: `disk_malformed` (not JSON, too deep, its crc32 fails, not an object) or
        `disk_auth` (its HMAC is missing, wrong, or present without a key).
    """
    try:
        doc = mf.load_json(raw, kind, len(raw), max_depth)
    except mf.ManifestError as e:  # a damaged record is malformed (its reason set is the lookup's)
        raise mf.ManifestError(str(e), MALFORMED) from None
    mf.need(isinstance(doc, dict), f"a {kind} must be a JSON object")
    body = {k: v for k, v in doc.items() if k not in ("checksum", "hmac")}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    mf.need(doc.get("checksum") == zlib.crc32(canonical), f"{kind} {name}: checksum does not match its contents")
    if key is None:
        mf.need(
            "hmac" not in doc and "auth" not in doc, f"{kind} {name} is authenticated but this tier has no key", AUTH
        )
    else:
        mac = doc.get("hmac")
        mf.need(
            doc.get("auth") == mf.AUTH_SCHEME
            and isinstance(mac, str)
            and hmac.compare_digest(mac, key.record_mac(kind, name, canonical)),
            f"{kind} {name}: HMAC missing or does not match (written, edited or moved without the key)",
            AUTH,
        )
    body.pop("auth", None)
    return body


def seal_pointer(pointer: Pointer, key: mf.StoreKey | None) -> bytes:
    """A pointer's padded bytes (`POINTER_BYTES`); the oldest holders are dropped until it fits.

    Args:
        pointer: the block and its holders (oldest first).
        key: the store key, or None.
    Returns:
        Exactly `POINTER_BYTES` bytes.
    """
    holders = list(pointer.holders[-MAX_HOLDERS:])
    while True:
        grouped: dict[str, list] = {}
        for h in holders:
            grouped.setdefault(h.abi, []).append([h.segment, h.snapshot, h.manifest_bytes])
        doc = {"format": POINTER_FORMAT, "version": POINTER_VERSION, "block": pointer.block, "holders": grouped}
        raw = seal_record(doc, "pointer", pointer_key(pointer.block), key)
        if len(raw) <= POINTER_BYTES or not holders:
            return pad(raw, POINTER_BYTES)
        holders = holders[1:]


def parse_pointer(raw: bytes, block: str, key: mf.StoreKey | None) -> Pointer:
    """Check a pointer read from `pointer_key(block)`.

    Args:
        raw: its bytes.
        block: the block id it was read for.
        key: the store key, or None.
    Returns:
        The `Pointer`.
    Raises:
        ManifestError: `disk_malformed` or `disk_auth` (see `open_record`), or naming another block.
    """
    doc = open_record(raw, "pointer", pointer_key(block), key, max_depth=4)
    mf.need(
        set(doc) == {"format", "version", "block", "holders"}, "pointer fields must be format, version, block, holders"
    )
    mf.need(doc["format"] == POINTER_FORMAT and doc["version"] == POINTER_VERSION, "not a version 1 hkv pointer")
    mf.need(doc["block"] == block, f"pointer stored as block {block} names another block")
    hs = doc["holders"]
    mf.need(isinstance(hs, dict), "pointer holders must be an object")
    out = []
    for abi, segs in hs.items():
        mf.check_hex(abi, 32, "pointer abi")
        mf.need(isinstance(segs, list) and len(segs) <= MAX_HOLDERS, f"pointer holders must be lists of {MAX_HOLDERS}")
        for s in segs:
            mf.need(
                isinstance(s, list)
                and len(s) == 3
                and isinstance(s[0], str)
                and 0 < len(s[0]) <= mf.MAX_NAME
                and mf.NAME.match(s[0]) is not None
                and isinstance(s[1], bool),
                "a pointer holder must be [segment name, snapshot, manifest bytes]",
            )
            mf.check_int(s[2], "pointer manifest bytes", 0, mf.MAX_MANIFEST_BYTES)
            out.append(Holder(abi, s[0], s[1], s[2]))
    return Pointer(block, tuple(out))


def update_record(
    kv,
    key: str,
    size: int,
    change: Callable[[Fixed], bytes | Any | None],
    tries: int = CAS_TRIES,
) -> bytes | Any | None:
    """Read-modify-write one fixed-size record by compare-and-swap until no other writer intervened.

    Args:
        kv: the tensorstore KvStore.
        key: the record's key.
        size: its fixed size.
        change: the current record (`Fixed`) -> the new bytes (exactly `size`), None to delete it, or
            `update_record.SKIP` to leave it as it is.
        tries: attempts before giving up.
    Returns:
        What `change` returned on the attempt that was written (or SKIP).
    Raises:
        TimeoutError: every attempt lost its race. What the kvstore raises.
    """
    for attempt in range(tries):
        cur = fixed_result(read_fixed(kv, key, size))
        new = change(cur)
        if new is SKIP:
            return SKIP
        if cur.generation == b"":  # unreadable: overwrite it unconditionally (it is garbage)
            kv.write(key, new).result()
            return new
        if kv.write(key, new, if_equal=cur.generation).result().generation != b"":
            return new
        time.sleep(random.uniform(0, 0.002 * min(attempt + 1, 20)))
    raise TimeoutError(f"{key}: {tries} conditional writes all lost their race")


SKIP = object()  # `update_record`'s change: leave the record as it is


def update_pointers(
    kv, key: mf.StoreKey | None, changes: dict[str, Callable[[Pointer | None], Pointer | None]]
) -> dict[str, Pointer | None]:
    """Compare-and-swap many pointers at once: every read issued together, then every conditional
    write; the ones that lost a race are retried (up to `CAS_TRIES` rounds).

    Args:
        kv: the tensorstore KvStore.
        key: the store key, or None.
        changes: {block id: the current pointer (None: none, or unreadable) -> the new one (None or no
            holders: delete it)}.
    Returns:
        {block id: the pointer as written (None: deleted)}.
    Raises:
        TimeoutError: a pointer whose every attempt lost its race. What the kvstore raises.
    """
    out: dict[str, Pointer | None] = {}
    todo = dict(changes)
    for attempt in range(CAS_TRIES):
        reads = {b: read_fixed(kv, pointer_key(b), POINTER_BYTES) for b in todo}
        writes = {}
        for b, fut in reads.items():
            cur = fixed_result(fut)
            old = None
            if cur.raw is not None:
                try:
                    old = parse_pointer(cur.raw, b, key)
                except mf.ManifestError:
                    old = None  # a damaged or forged pointer is replaced
            new = todo[b](old)
            raw = seal_pointer(new, key) if new is not None and new.holders else None
            gen = None if cur.generation == b"" else cur.generation
            writes[b] = (new if raw is not None else None, kv.write(pointer_key(b), raw, if_equal=gen))
        lost = {}
        for b, (new, fut) in writes.items():
            if fut.result().generation != b"":
                out[b] = new
            else:
                lost[b] = todo[b]
        if not lost:
            return out
        todo = lost
        time.sleep(random.uniform(0, 0.002 * min(attempt + 1, 20)))
    raise TimeoutError(f"{len(todo)} pointers: {CAS_TRIES} conditional writes all lost their race")


def pointer_adds(doc: dict, manifest_bytes: int) -> dict[str, Callable[[Pointer | None], Pointer]]:
    """The pointer changes that publish segment `doc`: each of its block ids gains it as a holder
    (snapshot when any of its copies there carries one).

    Args:
        doc: the manifest.
        manifest_bytes: its size as published.
    Returns:
        {block id: change} for `hkv.store.records.update_pointers`.
    """
    snap: dict[str, bool] = {}
    for b in doc["blocks"]:
        snap[b["key"]] = snap.get(b["key"], False) or b["snapshot"]

    def add(block: str) -> Callable[[Pointer | None], Pointer]:
        h = Holder(doc["abi"], doc["segment"], snap[block], manifest_bytes)

        def change(p: Pointer | None) -> Pointer:
            old = tuple(x for x in (p.holders if p is not None else ()) if x.sid != h.sid)
            return Pointer(block, (*old, h))

        return change

    return {b: add(b) for b in snap}
