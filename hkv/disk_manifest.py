"""The disk tier's manifest: the JSON document that makes a stored segment exist.

A *segment* is one write batch of the disk tier: the bytes of one or more cache blocks in one zarr3
array, and one manifest published after the array's bytes are committed. Anything without a manifest
entry does not exist. A manifest is immutable once published; it is schema-checked and carries a
checksum of its own canonical text, so a torn or edited manifest is detected, never trusted.

    {"format": "hkv-disk-tier", "version": 2, "abi": "<32 hex>", "segment": "<id>", "writer": "<id>",
     "created": <unix seconds>, "data_bytes": n, "stored_bytes": bytes of the shard files,
     "chunk_bytes": c, "shard_bytes": s,
     "blocks": [{"key": "<32 hex>", "parent": "<32 hex>" | "", "index": i, "length": L,
                 "tokens": [block_tokens ids], "indexer_version": v, "snapshot": bool,
                 "objects": [{"name": str, "dtype": str, "shape": [..], "row_start": r0,
                              "offset": byte offset (64-aligned), "nbytes": n, "crc32": int}]}],
     "checksum": crc32 of the canonical JSON of every other field}

The data array is cut into shards of `shard_bytes` (a multiple of `chunk_bytes`; the last shard may
be shorter), one file each. Version 1 (no `shard_bytes`: the whole array is one shard) is still read.

Block `index` i ends at boundary `length` = (i + 1) * block_tokens. Objects: `g{G}.rows` the
COMPRESSED / INDEXER rows [row_start, row_start + shape[1]) of group G that block i sealed;
with `snapshot`, also `g{G}.window` the SWA rows [row_start, ..) held at the boundary and
`t{C}.{tail_kv,tail_gate,overlap_kv,overlap_gate}` compressor C's TAIL there.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

FORMAT = "hkv-disk-tier"
VERSION = 2
READS = (1, 2)  # the versions `parse` accepts
ALIGN = 64
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "uint8", "int32")


class ManifestError(ValueError):
    """A manifest that is not valid JSON, fails its schema, or fails its own checksum."""


def _canonical(doc: dict) -> bytes:
    return json.dumps({k: v for k, v in doc.items() if k != "checksum"}, sort_keys=True,
                      separators=(",", ":")).encode()


def seal(doc: dict) -> bytes:
    """The manifest's bytes: `doc` (with format and version) plus its checksum field. One JSON
    encoding: the canonical text with the checksum appended as the last field (`parse` re-derives
    the canonical text from the parsed fields, so field order in the file does not matter)."""
    canonical = _canonical(dict(doc, format=FORMAT, version=VERSION))
    return canonical[:-1] + b',"checksum":%d}' % zlib.crc32(canonical)


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ManifestError(what)


def _hex(v: Any, n: int, name: str, allow_empty: bool = False) -> None:
    ok = isinstance(v, str) and ((allow_empty and v == "") or (len(v) == n and all(c in "0123456789abcdef" for c in v)))
    _need(ok, f"{name}={v!r} must be {n} lowercase hex digits")


def parse(raw: bytes) -> dict:
    """Parse and check a manifest; raises `ManifestError` naming the first bad field."""
    try:
        doc = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"not JSON: {e}") from None
    _need(isinstance(doc, dict), "manifest must be a JSON object")
    _need(doc.get("format") == FORMAT, f"format={doc.get('format')!r} must be {FORMAT!r}")
    _need(doc.get("version") in READS, f"version={doc.get('version')!r}: this hkv reads versions {READS}")
    _need(isinstance(doc.get("checksum"), int) and doc["checksum"] == zlib.crc32(_canonical(doc)),
          "checksum does not match the manifest's contents (corrupted or edited)")
    return check(doc)


def check(doc: dict) -> dict:
    """The schema check of `parse` on a manifest's fields (no JSON, no checksum): what a writer runs
    before writing a segment's bytes, so a manifest that would be refused is never published."""
    _hex(doc.get("abi"), 32, "abi")
    for f in ("segment", "writer"):
        _need(isinstance(doc.get(f), str) and 0 < len(doc[f]) <= 128, f"{f} must be a non-empty string")
    for f in ("data_bytes", "stored_bytes", "chunk_bytes"):
        _need(isinstance(doc.get(f), int) and doc[f] >= 0, f"{f}={doc.get(f)!r} must be an integer >= 0")
    _need(doc["chunk_bytes"] > 0, "chunk_bytes=0 must be > 0")
    if doc.get("version", VERSION) >= 2 or "shard_bytes" in doc:
        s = doc.get("shard_bytes")
        _need(isinstance(s, int) and s > 0 and s % doc["chunk_bytes"] == 0,
              f"shard_bytes={s!r} must be a positive multiple of chunk_bytes={doc['chunk_bytes']}")
    blocks = doc.get("blocks")
    _need(isinstance(blocks, list) and blocks, "blocks must be a non-empty list")
    for b in blocks:
        _need(isinstance(b, dict), "each block must be an object")
        _hex(b.get("key"), 32, "block key")
        _hex(b.get("parent"), 32, "block parent", allow_empty=True)
        for f in ("index", "length", "indexer_version"):
            _need(isinstance(b.get(f), int) and b[f] >= 0, f"block {f}={b.get(f)!r} must be an integer >= 0")
        _need(isinstance(b.get("tokens"), list) and all(isinstance(t, int) for t in b["tokens"]),
              "block tokens must be a list of integers")
        _need(isinstance(b.get("snapshot"), bool), "block snapshot must be a boolean")
        _need(isinstance(b.get("objects"), list), "block objects must be a list")
        for o in b["objects"]:
            _need(isinstance(o, dict) and isinstance(o.get("name"), str), "object name must be a string")
            _need(o.get("dtype") in DTYPES, f"object dtype={o.get('dtype')!r} must be one of {DTYPES}")
            _need(isinstance(o.get("shape"), list) and all(isinstance(d, int) and d >= 0 for d in o["shape"]),
                  f"object shape={o.get('shape')!r} must be a list of integers >= 0")
            for f in ("row_start", "offset", "nbytes", "crc32"):
                _need(isinstance(o.get(f), int) and o[f] >= 0, f"object {f}={o.get(f)!r} must be an integer >= 0")
            _need(o["offset"] + o["nbytes"] <= doc["data_bytes"],
                  f"object {o['name']} bytes [{o['offset']}, {o['offset'] + o['nbytes']}) exceed data_bytes")
    return doc


__all__ = ["ALIGN", "FORMAT", "ManifestError", "READS", "VERSION", "check", "parse", "seal"]
