"""A structure-aware fuzzer of the disk tier's manifest parser (issue 11).

Start from a manifest the real writer produced, mutate its fields to hostile values (huge, negative,
float, string, null, boolean, deeply nested, long lists, overlapping offsets, extra and missing
keys, other names), RE-SEAL it with a valid crc32 (and, for a keyed store, a valid, stale or missing
HMAC), then check that

- `disk_manifest.parse` either returns a document satisfying every invariant the reader relies on
  (checked here independently of the parser) or raises `ManifestError` with a known reason, and
  nothing else, within the deadline;
- a `DiskTier` over a store holding that file beside an intact segment opens, still finds and
  restores the intact segment's blocks, and `verify` names the file (or its blocks) with a reason.

The default run is small (`max_examples` 60 / 25); `-m slow` runs a larger one.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hkv.store import manifest as mf
from hkv.store.tier import DISK_REASONS, DiskTier

from .test_cli import ABI, _chain

KEY = bytes(range(7, 39))
SEG = "20990101T000000-fuzz-00000000"  # where the hostile manifest is stored
REASONS = {mf.CHECKSUM, mf.MALFORMED, mf.AUTH, mf.ABI}
TOP = [
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
]
BLOCK = ["key", "parent", "index", "length", "tokens", "indexer_version", "snapshot", "objects"]
OBJECT = ["name", "dtype", "shape", "row_start", "offset", "nbytes", "sum64", "crc32", "sha256"]
DEEP = "__DEEP__"  # placeholder replaced by a deeply nested array in the sealed bytes


def _store(root, key):
    """A store with one intact segment (chain "a", 3 blocks) and a copy of its data at SEG, plus the
    intact manifest re-homed to SEG with other block keys: the base every example mutates."""
    tier = DiskTier(str(root), key=key)
    tier.write(ABI, _chain("a", 3, 1))
    tier.close()
    name = os.listdir(root / "manifests" / ABI)[0]
    shutil.copytree(root / "data" / ABI / name[:-5], root / "data" / ABI / SEG)
    doc = json.loads((root / "manifests" / ABI / name).read_bytes())
    doc["segment"] = SEG
    for b in doc["blocks"]:  # other keys: the intact chain never depends on the hostile copy
        b["key"] = b["key"][::-1]
        b["parent"] = b["parent"][::-1]
    return doc


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    out = {}
    for keyed in (False, True):
        root = tmp_path_factory.mktemp(f"fuzz-{keyed}") / "store"
        out[keyed] = (root, _store(root, KEY if keyed else b""))
    return out


# ------------------------------------------------------------------------------ strategies
HUGE = [0, -1, 1, 63, 64, 4095, 4096, 2**31, 2**32, 2**40, 2**50, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30]


def _hostile(depth: int = 0):
    scalars = st.one_of(
        st.sampled_from(HUGE),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
        st.booleans(),
        st.none(),
        st.sampled_from(["", "0" * 32, "f" * 64, "bfloat16", "../x", "a" * 200]),
    )
    if depth >= 2:
        return scalars
    return st.one_of(
        scalars,
        st.lists(_hostile(depth + 1), max_size=4),
        st.dictionaries(st.text(max_size=6), _hostile(depth + 1), max_size=3),
        st.just(DEEP),
        st.integers(1, 2000).map(lambda n: [0] * n),
    )


# values a writer could plausibly have written: most pass the schema, so the invariants are exercised
PLAUSIBLE = st.one_of(
    st.integers(0, 1 << 12).map(lambda x: x * 64),
    st.integers(0, 1 << 16),
    st.sampled_from([0, 1, 2, 4096, 8192, 1 << 19, 1 << 24]),
    st.floats(0, 1e9),
    st.lists(st.integers(0, 64), max_size=4),
    st.booleans(),
)


def _tweak(draw, current):
    """A near miss of a field's current value (an int moved by multiples of 64, a list one longer or
    shorter, a flipped bool), or a plausible / hostile value where there is none."""
    if isinstance(current, bool):
        return not current
    if isinstance(current, int):
        return current + draw(st.sampled_from([-128, -64, -1, 1, 64, 128, 4096]))
    if isinstance(current, list) and draw(st.booleans()):
        return current[:-1] if current and draw(st.booleans()) else current + current[:1]
    return draw(st.one_of(PLAUSIBLE, _hostile()))


def _mutate(draw, doc):
    """Apply 1 or 2 mutations (plausible or hostile values) to a deep copy of doc; returns (doc, deep nesting or 0)."""
    doc = json.loads(json.dumps(doc))
    deep = 0
    for _ in range(draw(st.integers(1, 2))):
        blocks = doc.get("blocks") if isinstance(doc, dict) else None
        kinds = ["top", "top", "delete_top", "extra", "overlap", "dup_block", "many_objects", "whole"]
        if isinstance(blocks, list) and blocks and all(isinstance(b, dict) for b in blocks):
            kinds += ["block"] * 4 + ["object"] * 6
        kind = draw(st.sampled_from(kinds))
        value = draw(st.one_of(PLAUSIBLE, _hostile()))
        near = draw(st.booleans())  # a near miss of the field's current value instead
        if value == DEEP:
            deep = draw(st.integers(9, 200_000))
        if kind == "whole":
            return value, deep
        if not isinstance(doc, dict):
            continue
        if kind == "top":
            f = draw(st.sampled_from(TOP))
            doc[f] = _tweak(draw, doc.get(f)) if near else value
        elif kind == "delete_top":
            doc.pop(draw(st.sampled_from(TOP)), None)
        elif kind == "extra":
            doc[draw(st.sampled_from(["extra", "hmac_", "Blocks"]))] = value
        elif kind == "block":
            b = draw(st.sampled_from(blocks))
            if draw(st.booleans()):
                f = draw(st.sampled_from(BLOCK))
                b[f] = _tweak(draw, b.get(f)) if near else value
            else:
                b.pop(draw(st.sampled_from(BLOCK)), None)
        elif kind == "object":
            b = draw(st.sampled_from(blocks))
            objs = b.get("objects")
            if isinstance(objs, list) and objs and all(isinstance(o, dict) for o in objs):
                o = draw(st.sampled_from(objs))
                if draw(st.booleans()):
                    f = draw(st.sampled_from(OBJECT))
                    o[f] = _tweak(draw, o.get(f)) if near else value
                else:
                    o.pop(draw(st.sampled_from(OBJECT)), None)
        elif kind == "overlap" and isinstance(blocks, list) and len(blocks) > 1:
            with contextlib.suppress(KeyError, IndexError, TypeError):
                blocks[1]["objects"][0]["offset"] = blocks[0]["objects"][0]["offset"]
        elif kind == "dup_block" and isinstance(blocks, list) and blocks:
            blocks.append(json.loads(json.dumps(blocks[0])))
        elif kind == "many_objects" and isinstance(blocks, list) and blocks and isinstance(blocks[0], dict):
            objs = blocks[0].get("objects")
            if isinstance(objs, list) and objs:
                blocks[0]["objects"] = objs * (mf.MAX_OBJECTS // len(objs) + 1)
    return doc, deep


def _seal(doc, deep: int, key: mf.StoreKey | None, auth: str) -> bytes:
    """doc's bytes with a valid crc32 over its canonical text and an HMAC that is `valid` (bound to
    where it is stored), `stale` or `missing`."""
    if not isinstance(doc, dict):
        return json.dumps(doc).encode().replace(f'"{DEEP}"'.encode(), b"[" * deep + b"]" * deep)
    canonical = json.dumps(
        {k: v for k, v in doc.items() if k not in ("checksum", "hmac")}, sort_keys=True, separators=(",", ":")
    ).encode()
    canonical = canonical.replace(f'"{DEEP}"'.encode(), b"[" * deep + b"]" * deep)
    tail = b',"checksum":%d' % zlib.crc32(canonical)
    if key is not None and auth == "valid":
        tail += b',"hmac":"%s"' % key.manifest_mac(ABI, SEG, canonical).encode()
    elif key is not None and auth == "stale":
        tail += b',"hmac":"' + b"0" * 64 + b'"'
    return canonical[:-1] + tail + b"}" if canonical.endswith(b"}") and canonical != b"{}" else canonical


# ------------------------------------------------------------------------------ invariants
def _is_int(v, lo=0, hi=2**63 - 1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def assert_invariants(doc: dict, keyed: bool) -> None:
    """What `DiskTier` relies on after a successful parse, checked independently of the parser."""
    assert isinstance(doc, dict) and doc["format"] == mf.FORMAT and doc["version"] in mf.READS
    assert doc["abi"] == ABI and doc["segment"] == SEG
    assert _is_int(doc["data_bytes"], 0, mf.MAX_DATA_BYTES) and _is_int(doc["stored_bytes"])
    chunk = doc["chunk_bytes"]
    assert _is_int(chunk, 1, 1 << 30)
    padded = -(-max(doc["data_bytes"], 1) // chunk) * chunk
    shard = doc.get("shard_bytes") or padded
    assert _is_int(shard, 1) and shard % chunk == 0 and shard // chunk <= 1 << 20
    assert -(-padded // shard) <= mf.MAX_SHARDS
    assert isinstance(doc["blocks"], list) and 0 < len(doc["blocks"]) <= mf.MAX_BLOCKS
    spans = []
    for b in doc["blocks"]:
        assert set(b) <= set(BLOCK) and isinstance(b["snapshot"], bool)
        assert isinstance(b["key"], str) and len(b["key"]) == 32 and int(b["key"], 16) >= 0
        assert b["parent"] == "" or (len(b["parent"]) == 32 and int(b["parent"], 16) >= 0)
        assert all(_is_int(b[f]) for f in ("index", "length", "indexer_version"))
        if keyed:
            assert isinstance(b["tokens"], str) and len(b["tokens"]) == 64
        else:
            assert isinstance(b["tokens"], list) and all(_is_int(t, -(2**63)) for t in b["tokens"])
        assert isinstance(b["objects"], list) and len(b["objects"]) <= mf.MAX_OBJECTS
        assert len({o["name"] for o in b["objects"]}) == len(b["objects"])
        for o in b["objects"]:
            assert isinstance(o["name"], str) and o["dtype"] in mf.DTYPES
            assert isinstance(o["shape"], list) and len(o["shape"]) <= 8 and all(_is_int(d) for d in o["shape"])
            assert o["nbytes"] == int(np.prod(o["shape"], dtype=object)) * mf.ITEMSIZE[o["dtype"]]
            assert _is_int(o["offset"]) and o["offset"] % mf.ALIGN == 0
            assert o["offset"] + o["nbytes"] <= doc["data_bytes"]
            field, other = ("sum64", "crc32") if doc["version"] >= 3 else ("crc32", "sum64")
            assert _is_int(o[field], 0, 2 ** {"sum64": 64, "crc32": 32}[field] - 1) and other not in o
            assert _is_int(o["row_start"])
            assert ("sha256" in o) == keyed
            if o["nbytes"]:
                spans.append((o["offset"], o["offset"] + o["nbytes"]))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


# ------------------------------------------------------------------------------ the fuzzers
def _parse_case(bases, data):
    keyed = data.draw(st.booleans(), label="keyed")
    auth = "none"
    if keyed:
        auth = data.draw(st.sampled_from(["valid", "valid", "valid", "stale", "missing"]), label="auth")
    doc, deep = _mutate(data.draw, bases[keyed][1])
    key = mf.StoreKey(KEY) if keyed else None
    return keyed, auth, key, _seal(doc, deep, key, auth)


def _check_parse(keyed, auth, key, raw):
    try:
        doc = mf.parse(raw, key=key, abi=ABI, segment=SEG)
    except mf.ManifestError as e:
        assert e.reason in REASONS, e.reason
        return e
    assert auth in ("valid", "none")
    assert_invariants(doc, keyed)
    return None


def _fuzz_parse(bases, data):
    _check_parse(*_parse_case(bases, data))


def _fuzz_store(bases, tmp_path_factory, data):
    keyed, auth, key, raw = _parse_case(bases, data)
    err = _check_parse(keyed, auth, key, raw)
    root = tmp_path_factory.mktemp("case") / "store"
    shutil.copytree(bases[keyed][0], root)
    with open(root / "manifests" / ABI / f"{SEG}.json", "wb") as f:
        f.write(raw)
    tier = DiskTier(str(root), key=KEY if keyed else b"")
    blocks = _chain("a", 3, 1)
    found = tier.find_chain(ABI, [b.key for b in blocks], [b.tokens for b in blocks])
    assert found.stop is None and len(found.refs) == 3
    res = tier.read(found.refs)
    assert res.reason is None and len(res.payloads) == 3
    rep = tier.verify()
    assert rep["segments"] == (1 if err else 2)
    if err is not None:
        name = f"manifests/{ABI}/{SEG}.json: {err.reason}: "
        assert rep[err.reason] >= 1 and any(p.startswith(name) for p in rep["problems"]), (name, rep["problems"])
        assert rep["blocks_ok"] == 3
    else:  # accepted: its blocks either verify or are named with a reason (e.g. a mutated crc32)
        bad = sum(rep[r] for r in DISK_REASONS)
        assert rep["blocks_ok"] >= 3 and (bad == 0) == (not rep["problems"])
    assert rep["orphaned_segments"] == 0
    tier.close()
    shutil.rmtree(root)


FAST = dict(
    deadline=2000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(max_examples=60, **FAST)
@given(data=st.data())
def test_parse_returns_a_sound_manifest_or_raises_manifest_error(bases, data):
    _fuzz_parse(bases, data)


@settings(max_examples=25, **(FAST | {"deadline": 10_000}))
@given(data=st.data())
def test_a_hostile_manifest_beside_an_intact_segment(bases, tmp_path_factory, data):
    _fuzz_store(bases, tmp_path_factory, data)


@pytest.mark.slow
@settings(max_examples=2000, **FAST)
@given(data=st.data())
def test_parse_fuzz_large(bases, data):
    _fuzz_parse(bases, data)


@pytest.mark.slow
@settings(max_examples=300, **(FAST | {"deadline": 10_000}))
@given(data=st.data())
def test_store_fuzz_large(bases, tmp_path_factory, data):
    _fuzz_store(bases, tmp_path_factory, data)


def test_an_oversized_manifest_is_refused_before_it_is_parsed(bases, tmp_path):
    """A manifest over `MAX_MANIFEST_BYTES` is `disk_malformed` without being read whole."""
    with pytest.raises(mf.ManifestError, match="more than the 16,777,216 a manifest may have") as e:
        mf.parse(b" " * (mf.MAX_MANIFEST_BYTES + 1))
    assert e.value.reason == mf.MALFORMED
    root = tmp_path / "store"
    shutil.copytree(bases[False][0], root)
    with open(root / "manifests" / ABI / f"{SEG}.json", "wb") as f:
        f.write(b"{" + b" " * (mf.MAX_MANIFEST_BYTES + 10) + b"}")
    rep = DiskTier(str(root), key=b"").verify()
    assert rep["disk_malformed"] == 1 and rep["blocks_ok"] == 3
    assert f"manifests/{ABI}/{SEG}.json: disk_malformed: more than 16,777,216 bytes" in rep["problems"][0]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.binary(max_size=200)
    | st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b'"', b"\\", b"a"]), max_size=150).map(b"".join)
)
def test_depth_is_the_deepest_running_bracket_count_on_short_and_long_text(raw):
    """`depth` counts small records (pointers) in a loop and long text with numpy: the same value as
    the running count of [ { minus ] } outside strings, well-formed or not."""
    brackets = mf._STRINGS.sub(b"", raw).translate(None, mf._NOT_BRACKETS)
    running, want = 0, (0 if not brackets else -len(brackets))
    for c in brackets:
        running += 1 if c in b"[{" else -1
        want = max(want, running)
    assert mf.depth(raw) == want
