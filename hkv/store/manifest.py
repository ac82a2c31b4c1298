"""The disk tier's manifest: the JSON document that makes a stored segment exist.

A *segment* is one write batch of the disk tier: the bytes of one or more cache blocks in one zarr3
array, and one manifest published after the array's bytes are committed. Anything without a manifest
entry does not exist. A manifest is immutable once published; it is schema-checked and carries a
checksum of its own canonical text, so a torn or edited manifest is detected, never trusted.

    {"format": "hkv-disk-tier", "version": 3, "abi": "<32 hex>", "segment": "<id>", "writer": "<id>",
     "created": <unix seconds>, "data_bytes": n, "stored_bytes": bytes of the shard files,
     "chunk_bytes": c, "shard_bytes": s,
     "blocks": [{"key": "<32 hex>", "parent": "<32 hex>" | "", "index": i, "length": L,
                 "tokens": [block_tokens ids], "indexer_version": v, "snapshot": bool,
                 "objects": [{"name": str, "dtype": str, "shape": [..], "row_start": r0,
                              "offset": byte offset (64-aligned), "nbytes": n, "sum64": int}]}],
     "checksum": crc32 of the canonical JSON of every other field but "hmac"}

The data array is cut into shards of `shard_bytes` (a multiple of `chunk_bytes`; the last shard may
be shorter), one file each. Each object's bytes carry a `sum64` digest (`hkv.store.digest`: memory
speed, on top of zarr's crc32c per chunk). Versions 1 and 2 are still read: their objects carry a
zlib `crc32` instead (4x slower to check), and version 1 has no `shard_bytes` (the whole array is one
shard).

With a store key (`StoreKey`; `hkv.DiskTier(key=...)` or `HKV_STORE_KEY`) a manifest is *authenticated
and private*: it also carries `"auth": "hmac-sha256"` and `"hmac"`, an HMAC-SHA256 over the canonical
text together with the segment name and ABI directory it is stored under; every block `key` and
`parent` is a keyed hash of the engine's block key (32 hex), `tokens` is a keyed digest of the
block's token ids (64 hex) instead of the list, and every object carries the `sha256` of its bytes
(the sum64 and crc32 digests detect accidents, not forgeries). Without a key the format is exactly the one above.

Every parse is bounded before it allocates: the file's size (`MAX_MANIFEST_BYTES`), the JSON
nesting depth (`MAX_DEPTH`, checked without recursion), the number of blocks, objects, tokens and
dimensions, every integer within int64 and a sane range (`data_bytes` at most `MAX_DATA_BYTES` and
the reader's budget, at most `MAX_SHARDS` shards of at most `MAX_CHUNKS_PER_SHARD` chunks, shapes
whose byte size matches `nbytes`, object byte ranges inside `data_bytes`, 64-byte aligned and
disjoint), and no field the schema does not name (a new field needs a new version). Anything else
is a `ManifestError` whose `reason` says how it is counted: `disk_checksum`
(not JSON, not UTF-8, or the crc32 fails: bytes a writer did not write), `disk_malformed` (a valid
checksum but outside the schema or its bounds, too large or too deep, or naming another segment),
`disk_auth` (the HMAC is missing, wrong, or present where no key is configured), `disk_abi` (the
manifest names another ABI than its directory).

Block `index` i ends at boundary `length` = (i + 1) * block_tokens. Objects: `g{G}.rows` the
COMPRESSED / INDEXER rows [row_start, row_start + shape[1]) of group G that block i sealed;
with `snapshot`, also `g{G}.window` the SWA rows [row_start, ..) held at the boundary and
`t{C}.{tail_kv,tail_gate,overlap_kv,overlap_gate}` compressor C's TAIL there.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import math
import re
import zlib
from typing import Any

import numpy as np

from ..core.reasons import Reason

FORMAT = "hkv-disk-tier"
VERSION = 3
READS = (1, 2, 3)  # the versions `parse` accepts
ALIGN = 64
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "uint8", "int32")
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1, "uint8": 1, "int32": 4}
AUTH_SCHEME = "hmac-sha256"

# the reasons a manifest is refused: members of the one `Reason` enum (they compare equal to their labels)
CHECKSUM, MALFORMED, AUTH, ABI = Reason.DISK_CHECKSUM, Reason.DISK_MALFORMED, Reason.DISK_AUTH, Reason.DISK_ABI

# bounds every parse enforces before it allocates anything sized by the manifest
MAX_MANIFEST_BYTES = 16 << 20  # 16 MiB: a 64 MiB segment of small blocks needs well under 1 MiB
MAX_DEPTH = 8  # a manifest nests 6 deep (object > blocks > block > objects > object > shape)
MAX_BLOCKS = 1 << 16  # blocks per manifest
MAX_OBJECTS = 1 << 10  # objects per block
MAX_TOKENS = 1 << 20  # token ids per block
MAX_DIMS = 8  # dimensions of an object's shape
MAX_NAME = 128  # characters of a segment / writer / object name
MAX_DATA_BYTES = 1 << 40  # bytes of one segment (1 TiB)
MAX_CHUNK_BYTES = 1 << 30
MAX_SHARDS = 1 << 20  # shard files of one segment
MAX_CHUNKS_PER_SHARD = 1 << 20  # inner chunks of one shard (its index holds 16 bytes per chunk)
INT64 = (1 << 63) - 1
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a segment or writer name: one safe path component

_TOP = {
    "format",
    "version",
    "abi",
    "segment",
    "writer",
    "created",
    "data_bytes",
    "stored_bytes",
    "chunk_bytes",
    "shard_bytes",
    "blocks",
    "checksum",
    "auth",
    "hmac",
}
_BLOCK = {"key", "parent", "index", "length", "tokens", "indexer_version", "snapshot", "objects"}
_OBJECT = {"name", "dtype", "shape", "row_start", "offset", "nbytes", "crc32", "sum64", "sha256"}
DIGEST_BITS = {"crc32": 32, "sum64": 64}


class ManifestError(ValueError):
    """A manifest that is not valid JSON, fails its schema or bounds, its own checksum or its HMAC.

    Attributes:
        reason: how the refusal is counted: `disk_checksum`, `disk_malformed`, `disk_auth` or `disk_abi`.
    """

    def __init__(self, message: str, reason: str = MALFORMED):
        super().__init__(message)
        self.reason = reason


class StoreKey:
    """The secret of an authenticated, private store (see the module docstring).

    Three independent subkeys are derived from it (HMAC-SHA256 with a label), one per use: the
    manifest HMAC, the keyed block ids and the token digests.

    Args:
        secret: at least 16 bytes (never echoed in a message).
    Raises:
        ValueError: a secret that is not bytes of at least 16.
    """

    def __init__(self, secret: bytes):
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            n = len(secret) if isinstance(secret, (bytes, bytearray)) else type(secret).__name__
            raise ValueError(f"key must be at least 16 bytes (e.g. os.urandom(32)), got {n}")
        derive = lambda label: hmac.new(bytes(secret), label, hashlib.sha256).digest()
        self._mac, self._ids, self._tok = derive(b"hkv manifest"), derive(b"hkv block id"), derive(b"hkv tokens")

    def manifest_mac(self, abi: str, segment: str, canonical: bytes) -> str:
        """Hex HMAC of a manifest's canonical text, bound to where it is stored (abi, segment)."""
        where = json.dumps([abi, segment]).encode()
        return hmac.new(self._mac, b"hkv-disk-tier/manifest\n" + where + b"\n" + canonical, hashlib.sha256).hexdigest()

    def record_mac(self, kind: str, name: str, canonical: bytes) -> str:
        """Hex HMAC of another small record of the store (a block pointer: `kind` "pointer"), bound to
        its kind and the name it is stored under, with the manifest subkey (domain-separated)."""
        where = json.dumps([kind, name]).encode()
        return hmac.new(self._mac, b"hkv-disk-tier/record\n" + where + b"\n" + canonical, hashlib.sha256).hexdigest()

    def block_id(self, key: bytes) -> str:
        """The 32 hex digits a manifest lists for the engine's block key `key`."""
        return hmac.new(self._ids, bytes(key), hashlib.sha256).hexdigest()[:32]

    def tokens_digest(self, tokens) -> str:
        """The 64 hex digits a manifest lists for a block's token ids."""
        return hmac.new(self._tok, ",".join(str(int(t)) for t in tokens).encode(), hashlib.sha256).hexdigest()

    def __repr__(self) -> str:
        return "StoreKey(<secret>)"


def _canonical(doc: dict) -> bytes:
    return json.dumps(
        {k: v for k, v in doc.items() if k not in ("checksum", "hmac")}, sort_keys=True, separators=(",", ":")
    ).encode()


def seal(doc: dict, key: StoreKey | None = None) -> bytes:
    """The manifest's bytes: `doc` (with format and version) plus its checksum field and, with
    `key`, its `auth` and `hmac` fields (bound to `doc`'s abi and segment, where it is stored). One
    JSON encoding: the canonical text with the checksum (and hmac) appended (`parse` re-derives the
    canonical text from the parsed fields, so field order in the file does not matter).

    Args:
        doc: the manifest's fields, without format, version, checksum, auth and hmac.
        key: the store's key, or None for an unauthenticated manifest.
    Returns:
        The bytes to publish.
    """
    full = dict(doc, format=FORMAT, version=VERSION)
    if key is not None:
        full["auth"] = AUTH_SCHEME
    canonical = _canonical(full)
    tail = b',"checksum":%d' % zlib.crc32(canonical)
    if key is not None:
        tail += b',"hmac":"%s"' % key.manifest_mac(doc["abi"], doc["segment"], canonical).encode()
    return canonical[:-1] + tail + b"}"


def need(cond: bool, what, reason: str = MALFORMED) -> None:
    """Raise `ManifestError(what)` unless `cond`; `what` may be a callable building the message
    (so the hot per-object checks format nothing when they pass).

    Args:
        cond: what must hold.
        what: the message, or a callable that builds it.
        reason: how the refusal is counted (`disk_malformed` by default).
    """
    if not cond:
        raise ManifestError(what() if callable(what) else what, reason)


_HEX = {n: re.compile(f"[0-9a-f]{{{n}}}") for n in (32, 64)}


def check_hex(v: Any, n: int, name: str, allow_empty: bool = False) -> None:
    """Raise `ManifestError` unless `v` is a str of `n` lowercase hex digits (or "" with `allow_empty`).

    Args:
        v: the value (hostile: it is only ever shown cut short).
        n: 32 or 64.
        name: what the message calls it.
        allow_empty: whether "" passes (a first block's parent).
    """
    if isinstance(v, str) and ((allow_empty and v == "") or _HEX[n].fullmatch(v)):
        return
    raise ManifestError(f"{name}={_short(v)} must be {n} lowercase hex digits")


def _short(v: Any) -> str:
    """repr of a hostile value, cut short (a message never holds a megabyte)."""
    r = repr(v) if not isinstance(v, int) or v.bit_length() < 256 else f"<{v.bit_length()}-bit integer>"
    return r if len(r) <= 80 else r[:77] + "..."


def check_int(v: Any, name: str, lo: int = 0, hi: int = INT64) -> int:
    """`v` when it is an int (not a bool) in [lo, hi]; else raise `ManifestError`.

    Args:
        v: the value (hostile: it is only ever shown cut short).
        name: what the message calls it.
        lo: the least value allowed.
        hi: the greatest value allowed (int64's by default).
    Returns:
        `v`.
    """
    if type(v) is int and lo <= v <= hi:  # bool is not an integer here
        return v
    raise ManifestError(f"{name}={_short(v)} must be an integer in [{lo}, {hi}]")


_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def depth(raw: bytes) -> int:
    """The deepest nesting of JSON arrays and objects in `raw`, without recursion (strings skipped).

    Args:
        raw: the bytes of a JSON document (well-formed or not).
    Returns:
        The maximum nesting depth (0 for a scalar).
    """
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    if len(brackets) <= 64:  # a pointer or a small record: a loop costs less than numpy's setup
        level, deepest = 0, -len(brackets)  # (the numpy path's value for malformed text too)
        for c in brackets:
            level += 1 if c in b"[{" else -1
            deepest = max(deepest, level)
        return deepest
    b = np.frombuffer(brackets, np.uint8)
    step = np.where((b == ord("[")) | (b == ord("{")), 1, -1).astype(np.int64)
    return int(np.cumsum(step).max())


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def load_json(
    raw: bytes, what: str = "manifest", max_bytes: int = MAX_MANIFEST_BYTES, max_depth: int = MAX_DEPTH
) -> Any:
    """Decode bounded JSON: at most `max_bytes` bytes and `max_depth` levels (checked before
    `json.loads`, so no RecursionError or huge allocation can happen), no NaN / Infinity, no integer
    of more than 4300 digits.

    Args:
        raw: the file's bytes.
        what: the file's kind, for messages.
        max_bytes: the size cap.
        max_depth: the nesting cap.
    Returns:
        The decoded document.
    Raises:
        ManifestError: `disk_malformed` (too large, too deep), `disk_checksum` (not UTF-8 or not JSON).
    """
    need(len(raw) <= max_bytes, f"{what} is {len(raw):,} bytes, more than the {max_bytes:,} a {what} may have")
    d = depth(raw)
    need(d <= max_depth, f"JSON nested deeper than {max_depth} levels ({d}): not a {what}")
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise ManifestError(f"not UTF-8: {e}", CHECKSUM) from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer too long to convert
        raise ManifestError(f"not JSON: {e}", CHECKSUM) from None


def parse(
    raw: bytes,
    *,
    key: StoreKey | None = None,
    abi: str | None = None,
    segment: str | None = None,
    max_data_bytes: int | None = None,
) -> dict:
    """Parse and check a manifest; raises `ManifestError` naming the first bad field.

    Args:
        raw: the manifest file's bytes.
        key: the store's key: the manifest must carry a matching HMAC (None: it must carry none).
        abi: the ABI directory the manifest is stored under (its `abi` must equal it: else `disk_abi`).
        segment: the segment name it is stored under (its `segment` must equal it: else `disk_malformed`).
        max_data_bytes: the reader's budget, if any (`data_bytes` above it is `disk_malformed`).
    Returns:
        The checked manifest.
    Raises:
        ManifestError: with the `reason` it is counted under.
    """
    doc = load_json(raw)
    need(isinstance(doc, dict), f"manifest must be a JSON object, not {type(doc).__name__}")
    need(doc.get("format") == FORMAT, f"format={_short(doc.get('format'))} must be {FORMAT!r}")
    need(
        doc.get("version") in READS and not isinstance(doc.get("version"), bool),
        f"version={_short(doc.get('version'))}: this hkv reads versions {READS}",
    )
    need(
        isinstance(doc.get("checksum"), int) and doc["checksum"] == zlib.crc32(_canonical(doc)),
        "checksum does not match the manifest's contents (corrupted or edited)",
        CHECKSUM,
    )
    where_abi = abi if abi is not None else doc.get("abi")
    where_seg = segment if segment is not None else doc.get("segment")
    if key is None:
        need(
            "hmac" not in doc and "auth" not in doc,
            "manifest is authenticated (HMAC) but this tier has no key (pass key= or set HKV_STORE_KEY)",
            AUTH,
        )
    else:
        need(
            doc.get("auth") == AUTH_SCHEME and isinstance(doc.get("hmac"), str),
            f"manifest is not authenticated (no {AUTH_SCHEME} HMAC) but this tier has a key",
            AUTH,
        )
        need(
            isinstance(where_abi, str)
            and isinstance(where_seg, str)
            and hmac.compare_digest(doc["hmac"], key.manifest_mac(where_abi, where_seg, _canonical(doc))),
            "HMAC does not match: written with another key, or edited or moved by someone without the key",
            AUTH,
        )
    check(doc, keyed=key is not None, max_data_bytes=max_data_bytes)
    need(abi is None or doc["abi"] == abi, f"manifest under ABI {abi} claims ABI {doc['abi']}", ABI)
    need(
        segment is None or doc["segment"] == segment,
        f"manifest stored as segment {segment} names segment {doc['segment']} (overwritten or moved)",
    )
    return doc


def _check_top(doc: dict, max_data_bytes: int | None) -> int:
    """`check` of the manifest's top-level fields but `blocks`; returns its `data_bytes`."""
    need(isinstance(doc, dict), "manifest must be a JSON object")
    extra = set(doc) - _TOP
    need(not extra, f"unknown manifest fields {sorted(_short(k) for k in extra)[:5]}")
    check_hex(doc.get("abi"), 32, "abi")
    for f in ("segment", "writer"):
        v = doc.get(f)
        need(
            isinstance(v, str) and 0 < len(v) <= MAX_NAME and NAME.match(v) is not None,
            f"{f}={_short(v)} must be 1 to {MAX_NAME} characters of [A-Za-z0-9_.-], not starting with '.' or '-'",
        )
    c = doc.get("created", 0.0)
    need(
        isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and 0 <= c <= 2**40,
        f"created={_short(c)} must be unix seconds in [0, {2**40}]",
    )
    cap = MAX_DATA_BYTES if max_data_bytes is None else min(MAX_DATA_BYTES, max_data_bytes)
    data_bytes = check_int(doc.get("data_bytes"), "data_bytes", 0, cap)
    check_int(doc.get("stored_bytes"), "stored_bytes", 0, 1 << 62)
    chunk = check_int(doc.get("chunk_bytes"), "chunk_bytes", 1, MAX_CHUNK_BYTES)
    padded = -(-max(data_bytes, 1) // chunk) * chunk
    if doc.get("version", VERSION) >= 2 or "shard_bytes" in doc:
        s = doc.get("shard_bytes")
        need(
            isinstance(s, int) and not isinstance(s, bool) and 0 < s <= MAX_CHUNKS_PER_SHARD * chunk and s % chunk == 0,
            f"shard_bytes={_short(s)} must be a positive multiple of chunk_bytes={chunk} of at most "
            f"{MAX_CHUNKS_PER_SHARD} chunks",
        )
    else:
        s = padded
        need(
            s // chunk <= MAX_CHUNKS_PER_SHARD,
            f"data_bytes={data_bytes} is {s // chunk} chunks of {chunk} "
            f"bytes in one shard, more than {MAX_CHUNKS_PER_SHARD}",
        )
    shards = -(-padded // s)
    need(
        shards <= MAX_SHARDS,
        f"data_bytes={data_bytes} in shards of {s} bytes is {shards} shards, more than {MAX_SHARDS}",
    )
    return data_bytes


def _check_block(b: Any, keyed: bool, data_bytes: int, field: str) -> list[tuple[int, int, str, int]]:
    """`check` of one block entry; returns the (start, end, name, block index) byte span of each
    non-empty object."""
    need(isinstance(b, dict), "each block must be an object")
    extra = set(b) - _BLOCK
    need(not extra, lambda: f"unknown block fields {sorted(_short(k) for k in extra)[:5]}")
    check_hex(b.get("key"), 32, "block key")
    check_hex(b.get("parent"), 32, "block parent", allow_empty=True)
    for f in ("index", "length"):
        check_int(b.get(f), f"block {f}", 0, 1 << 40)
    check_int(b.get("indexer_version"), "block indexer_version", 0, (1 << 31) - 1)
    t = b.get("tokens")
    if keyed:
        check_hex(t, 64, "block tokens (a keyed digest)")
    else:
        need(
            isinstance(t, list) and len(t) <= MAX_TOKENS,
            lambda: f"block tokens must be a list of at most {MAX_TOKENS} integers",
        )
        need(
            all(type(x) is int and -INT64 - 1 <= x <= INT64 for x in t),  # not bool
            "block tokens must be int64 integers",
        )
    need(isinstance(b.get("snapshot"), bool), "block snapshot must be a boolean")
    objs = b.get("objects")
    need(
        isinstance(objs, list) and len(objs) <= MAX_OBJECTS,
        lambda: f"block objects must be a list of at most {MAX_OBJECTS}",
    )
    names: set[str] = set()
    spans = []
    for o in objs:
        span = _check_object(o, b, keyed, data_bytes, names, field)
        if span is not None:
            spans.append(span)
    return spans


def digest_field(doc: dict) -> str:
    """The per-object digest a manifest of `doc`'s version carries (`hkv.store.digest.CHECKS`): "sum64"
    from version 3 on (a manifest being built, without a version: this hkv's), "crc32" before."""
    return "sum64" if doc.get("version", VERSION) >= 3 else "crc32"


def _check_object(
    o: Any, b: dict, keyed: bool, data_bytes: int, names: set[str], field: str
) -> tuple[int, int, str, int] | None:
    """`check` of one object entry of block `b` (`names`: the names listed before it in the block, to
    which its own is added; `field`: the digest its version carries, `digest_field`); returns its
    (start, end, name, block index) byte span, None if empty."""
    need(
        isinstance(o, dict) and isinstance(o.get("name"), str) and 0 < len(o["name"]) <= MAX_NAME,
        f"object name must be a string of 1 to {MAX_NAME} characters",
    )
    need(o["name"] not in names, lambda: f"object {_short(o['name'])} is listed twice in block {b['index']}")
    names.add(o["name"])
    extra = set(o) - _OBJECT
    need(not extra, lambda: f"unknown object fields {sorted(_short(k) for k in extra)[:5]}")
    need(o.get("dtype") in DTYPES, lambda: f"object dtype={_short(o.get('dtype'))} must be one of {DTYPES}")
    shape = o.get("shape")
    need(
        isinstance(shape, list) and len(shape) <= MAX_DIMS,
        lambda: f"object shape={_short(shape)} must be a list of at most {MAX_DIMS} integers",
    )
    n = ITEMSIZE[o["dtype"]]
    for d in shape:
        n *= check_int(d, f"object {o['name']} shape dimension", 0, MAX_DATA_BYTES)
        need(
            n <= MAX_DATA_BYTES,
            lambda: f"object {o['name']} shape={_short(shape)} holds more than {MAX_DATA_BYTES} bytes",
        )
    check_int(o.get("row_start"), f"object {o['name']} row_start", 0, 1 << 40)
    off = check_int(o.get("offset"), f"object {o['name']} offset", 0, MAX_DATA_BYTES)
    nb = check_int(o.get("nbytes"), f"object {o['name']} nbytes", 0, MAX_DATA_BYTES)
    check_int(o.get(field), f"object {o['name']} {field}", 0, (1 << DIGEST_BITS[field]) - 1)
    other = next(f for f in DIGEST_BITS if f != field)
    need(other not in o, lambda: f"object {o['name']} has a {other}, not part of this manifest version")
    need(nb == n, lambda: f"object {o['name']} nbytes={nb} must be {n}, the size of {o['dtype']}{shape}")
    need(off % ALIGN == 0, lambda: f"object {o['name']} offset={off} must be a multiple of {ALIGN}")
    need(
        off + nb <= data_bytes,
        lambda: f"object {o['name']} bytes [{off}, {off + nb}) exceed data_bytes={data_bytes}",
    )
    if keyed:
        check_hex(o.get("sha256"), 64, f"object {o['name']} sha256")
    else:
        need("sha256" not in o, lambda: f"object {o['name']} has a sha256 but the manifest is not keyed")
    return (off, off + nb, o["name"], b["index"]) if nb else None


def check(doc: dict, *, keyed: bool = False, max_data_bytes: int | None = None) -> dict:
    """The schema and bounds check of `parse` on a manifest's fields (no JSON, no checksum, no
    HMAC): what a writer runs before writing a segment's bytes, so a manifest that would be refused
    is never published. Every size is checked before anything sized by it is built.

    Args:
        doc: the manifest's fields.
        keyed: the manifest of a keyed store (keyed token digests and object sha256 instead of token ids).
        max_data_bytes: the reader's or writer's budget, if any.
    Returns:
        `doc`, unchanged.
    Raises:
        ManifestError: `disk_malformed`, naming the first bad field and its allowed range.
    """
    data_bytes = _check_top(doc, max_data_bytes)
    blocks = doc.get("blocks")
    need(
        isinstance(blocks, list) and 0 < len(blocks) <= MAX_BLOCKS, f"blocks must be a list of 1 to {MAX_BLOCKS} blocks"
    )
    spans = []
    for b in blocks:
        spans += _check_block(b, keyed, data_bytes, digest_field(doc))
    spans.sort()
    for (_, end, name, i), (lo, _, name2, j) in itertools.pairwise(spans):
        need(lo >= end, lambda: f"object {name} of block {i} and object {name2} of block {j} overlap at byte {lo}")  # noqa: B023 — need calls it at once
    return doc


__all__ = [
    "ABI",
    "ALIGN",
    "AUTH",
    "CHECKSUM",
    "FORMAT",
    "MALFORMED",
    "MAX_DATA_BYTES",
    "MAX_DEPTH",
    "MAX_MANIFEST_BYTES",
    "MAX_SHARDS",
    "READS",
    "VERSION",
    "ManifestError",
    "StoreKey",
    "check",
    "depth",
    "digest_field",
    "load_json",
    "parse",
    "seal",
]
