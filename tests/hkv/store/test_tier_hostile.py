"""A disk tier store with hostile or broken files in it (issue 11): every bad file is one bad segment
counted with its reason, never an exception out of `DiskTier()`, `refresh`, `find_chain`, `read`,
`verify` or `stats`, and never the end of the intact segments beside it; every parse is bounded
before it allocates; `hkv store verify` reports every problem (exit 1) and keeps going; eviction
leaves nothing behind; a keyed store authenticates its manifests and keeps token ids private; a
closed tier says so by name."""

from __future__ import annotations

import json
import os
import pathlib
import time

import numpy as np
import pytest

import hkv
from hkv.store import manifest as mf
from hkv.store.tier import AUTH, MALFORMED, DiskTier, DiskTierClosedError

from .test_cli import ABI, ABI2, _chain, _count, _run, _segment_of, store  # noqa: F401 — the fixture
from .test_tier import segments

KEY = bytes(range(32))


def _keys(blocks):
    return [b.key for b in blocks], [b.tokens for b in blocks]


def _intact(tier, abi=ABI, chains=(("a", 3, 1), ("b", 2, 2))):
    """Every block of the fixture's chains under `abi` is found and reads back verified."""
    for name, n, seed in chains:
        blocks = _chain(name, n, seed)
        found = tier.find_chain(abi, *_keys(blocks))
        assert found.stop is None and len(found.refs) == n, (name, found.stop)
        res = tier.read(found.refs)
        assert res.reason is None and len(res.payloads) == n, res
        for got, want in zip(res.payloads, blocks, strict=True):
            for obj, (arr, _) in want.objects.items():
                assert np.array_equal(got.objects[obj][0].view(np.uint8), arr.view(np.uint8))


def _manifest(path, abi, chain) -> str:
    return os.path.join(path, "manifests", abi, f"{_segment_of(path, abi, chain)}.json")


def _reseal(file, doc, key=None):
    """Write `doc` back with a valid crc32 (and, with `key`, a valid HMAC) as if its writer had."""
    body = {k: v for k, v in doc.items() if k not in ("checksum", "format", "version", "hmac", "auth")}
    with open(file, "wb") as f:
        f.write(mf.seal(body) if key is None else mf.seal(body, key=mf.StoreKey(key)))


def _forge(file, doc):
    """Write `doc` back with a recomputed crc32 but its old (now stale) HMAC: what someone who can
    write the store but has no key can do."""
    doc = {k: v for k, v in doc.items() if k != "checksum"}
    doc["checksum"] = mf.zlib.crc32(mf._canonical(doc))
    with open(file, "wb") as f:
        f.write(json.dumps(doc).encode())


def _verify_json(capsys, path) -> tuple[int, dict]:
    code, out, _ = _run(capsys, "store", "verify", "--json", path)
    return code, json.loads(out)


# ---------------------------------------------------------------------------- defect 4
DEEP = b"[" * 200_000 + b"]" * 200_000


def test_deeply_nested_json_under_manifests_and_hits_is_one_bad_file(store, capsys):  # noqa: F811 — the fixture from test_cli
    """Defect 4: a deeply nested JSON file raised RecursionError in every find_chain and DiskTier()."""
    os.makedirs(os.path.join(store, "hits", ABI), exist_ok=True)
    pathlib.Path(store, "manifests", ABI, "20990101T000000-deep-00000000.json").write_bytes(DEEP)
    pathlib.Path(store, "hits", ABI, "deep.json").write_bytes(DEEP)
    tier = DiskTier(str(store))
    _intact(tier)
    st = tier.stats()
    assert st["segments"] == 3 and st["bad_files"] == {MALFORMED: 2}
    code, rep = _verify_json(capsys, store)
    assert code == 1 and rep["disk_malformed"] == 2 and rep["blocks_ok"] == 7
    assert any(
        p.startswith(f"manifests/{ABI}/20990101T000000-deep-00000000.json: disk_malformed: JSON nested deeper than")
        for p in rep["problems"]
    ), rep["problems"]
    assert any(p.startswith(f"hits/{ABI}/deep.json: disk_malformed") for p in rep["problems"]), rep["problems"]
    code, out, _ = _run(capsys, "store", "stats", store)
    assert code == 0 and "bad files  2 disk_malformed (skipped" in out and _count(out, "segments") == 3


def test_an_unreadable_manifest_is_a_bad_segment_not_an_exception(store, capsys):  # noqa: F811 — the fixture from test_cli
    """Defect 4: a manifest that is a symlink loop made DiskTier() raise."""
    d = os.path.join(store, "manifests", ABI)
    os.symlink("loop-b.json", os.path.join(d, "20990101T000000-loop-0000000a.json"))
    os.symlink("20990101T000000-loop-0000000a.json", os.path.join(d, "loop-b.json"))
    tier = DiskTier(str(store))
    _intact(tier)
    code, rep = _verify_json(capsys, store)
    assert code == 1 and rep["blocks_ok"] == 7 and rep["disk_malformed"] == 2
    assert any(
        p.startswith(f"manifests/{ABI}/20990101T000000-loop-0000000a.json: disk_malformed: unreadable")
        for p in rep["problems"]
    ), rep["problems"]


# ---------------------------------------------------------------------------- defect 5
def test_a_manifest_claiming_a_petabyte_is_refused_before_anything_allocates(store, capsys):  # noqa: F811 — the fixture from test_cli
    """Defect 5: data_bytes=2**50 with 4 KiB shards made _probe build a list of 2**38 shards."""
    m = _manifest(store, ABI, "b")
    doc = json.loads(pathlib.Path(m).read_bytes())
    doc.update(data_bytes=2**50, chunk_bytes=4096, shard_bytes=4096)
    doc["blocks"][0]["objects"][0]["offset"] = 2**50 - 64
    _reseal(m, doc)
    t0 = time.monotonic()
    with pytest.raises(
        mf.ManifestError, match=r"data_bytes=1125899906842624 must be an integer in \[0, 1099511627776\]"
    ) as e:
        mf.parse(pathlib.Path(m).read_bytes())
    assert e.value.reason == MALFORMED
    # under the hard cap, but 2**27 shard files: refused before any list of shards is built
    doc["data_bytes"] = 2**39
    doc["blocks"][0]["objects"][0]["offset"] = 2**39 - 64
    with pytest.raises(mf.ManifestError, match=r"in shards of 4096 bytes is 134217728 shards, more than 1048576"):
        mf.check(doc)
    # and under a reader's budget
    with pytest.raises(mf.ManifestError, match=r"data_bytes=549755813888 must be an integer in \[0, 100000\]"):
        mf.check(doc, max_data_bytes=100_000)
    _reseal(m, doc)
    code, rep = _verify_json(capsys, store)
    assert code == 1 and rep["disk_malformed"] == 1 and rep["blocks_ok"] == 5
    assert time.monotonic() - t0 < 30


# ---------------------------------------------------------------------------- defect 6
def test_verify_reports_a_stray_file_an_overflowing_shape_and_a_data_symlink_loop_and_goes_on(store, capsys):  # noqa: F811 — the fixture from test_cli
    """Defect 6: each of these made `hkv store verify` exit 2 with the rest unchecked."""
    pathlib.Path(store, "manifests", "README.json").write_bytes(b'{"hello": 1}')
    m = _manifest(store, ABI, "b")
    doc = json.loads(pathlib.Path(m).read_bytes())
    doc["blocks"][0]["objects"][0]["shape"] = [2**64, 1]
    _reseal(m, doc)
    seg_c = _segment_of(store, ABI2, "c")
    shard = os.path.join(store, "data", ABI2, seg_c, "c", "0")
    os.remove(shard)
    os.symlink("1", shard)
    os.symlink("0", os.path.join(store, "data", ABI2, seg_c, "c", "1"))
    code, rep = _verify_json(capsys, store)
    assert code == 1
    # a: 3 ok; b: its manifest is malformed; c: both blocks live in the unreadable shard 0
    assert rep["blocks_ok"] == 3 and rep["disk_malformed"] == 2 and rep["disk_missing"] == 2, rep
    probs = "\n".join(rep["problems"])
    assert "manifests/README.json: disk_malformed: not a manifest name" in probs
    assert f"manifests/{ABI}/{_segment_of(store, ABI, 'b')}.json: disk_malformed: " in probs and "shape" in probs
    assert "data shard 0 is unreadable" in probs


# ---------------------------------------------------------------------------- defect 7
def test_a_manifest_overwritten_by_another_segments_manifest_is_reported(store, capsys):  # noqa: F811 — the fixture from test_cli
    """Defect 7: the overwritten segment showed only as an orphan and verify exited 0."""
    a, b = _manifest(store, ABI, "a"), _manifest(store, ABI, "b")
    pathlib.Path(b).write_bytes(pathlib.Path(a).read_bytes())
    tier = DiskTier(str(store))
    _intact(tier, chains=(("a", 3, 1),))
    code, rep = _verify_json(capsys, store)
    assert code == 1 and rep["disk_malformed"] == 1 and rep["orphaned_segments"] == 0
    assert any(f"names segment {_segment_of(store, ABI, 'a')}" in p for p in rep["problems"]), rep["problems"]


def test_budget_eviction_leaves_no_folders_and_verify_no_false_orphans(tmp_path, capsys):
    """Defect 7: eviction left empty data/<abi>/<segment>/c/ folders, each reported as an orphan."""
    path = tmp_path / "s"
    tier = DiskTier(str(path), budget_bytes=3 * 2500)
    for i in range(8):
        tier.write(ABI, _chain(f"e{i}", 1, i))
    assert tier.counters["segments_evicted"] >= 5
    live = {s.name for s in segments(tier)}
    assert set(os.listdir(path / "data" / ABI)) == live
    tier.delete_segment(ABI, sorted(live)[0])
    assert set(os.listdir(path / "data" / ABI)) == live - {sorted(live)[0]}
    tier.close()
    os.makedirs(path / "data" / ABI / "20990101T000000-empty-00000000" / "c")  # an empty leftover is no orphan
    code, rep = _verify_json(capsys, path)
    assert code == 0 and rep["orphaned_segments"] == 0 and rep["orphans"] == []


# ---------------------------------------------------------------------------- defect 9
def test_a_keyed_store_refuses_a_resealed_manifest_that_points_a_block_at_another_blocks_bytes(
    tmp_path, capsys, monkeypatch
):
    """Defect 9: without a key anyone who can write the store can reseal a manifest (valid crc32)
    that points block 0 at block 1's bytes; with a key that manifest is `disk_auth`, never read."""
    monkeypatch.delenv("HKV_STORE_KEY", raising=False)
    path = tmp_path / "s"
    blocks = _chain("k", 3, 5)
    for b in blocks:
        b.snapshot, b.objects = True, {"g0.rows": b.objects["g0.rows"]}
    for key in (None, KEY):
        tier = DiskTier(str(path / str(key is not None)), key=key)
        tier.write(ABI, blocks)
        tier.close()
        m = os.path.join(
            path, str(key is not None), "manifests", ABI, os.listdir(path / str(key is not None) / "manifests" / ABI)[0]
        )
        doc = json.loads(pathlib.Path(m).read_bytes())
        o0, o1 = doc["blocks"][0]["objects"][0], doc["blocks"][1]["objects"][0]
        for f in ("offset", "sum64", "sha256"):
            if f in o0:
                o0[f], o1[f] = o1[f], o0[f]
        _forge(m, doc)  # the attacker has no key: a valid crc32, a stale HMAC
        tier = DiskTier(str(path / str(key is not None)), key=key)
        found = tier.find_chain(ABI, *_keys(blocks))
        if key is None:  # integrity only: the swapped bytes are read as block 0's (the threat model says so)
            got = tier.read(found.refs)
            assert got.reason is None
            assert np.array_equal(got.payloads[0].objects["g0.rows"][0], blocks[1].objects["g0.rows"][0])
            continue
        got = tier.read(found.refs)  # never read: the lookup's refs are refused with the reason
        assert got.payloads == [] and got.reason == AUTH
        rep = tier.verify()
        assert rep[AUTH] == 1 and rep["blocks_ok"] == 0
        assert any("HMAC does not match" in p for p in rep["problems"]), rep["problems"]
        monkeypatch.setenv("HKV_STORE_KEY", KEY.hex())
        code, out = _verify_json(capsys, path / "True")
        assert code == 1 and out["disk_auth"] == 1


def test_a_keyed_store_keeps_token_ids_and_block_keys_private(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HKV_STORE_KEY", raising=False)
    blocks = _chain("p", 2, 11)
    for b in blocks:
        b.tokens = [123456, 654321, 111111, 222222]
    tier = DiskTier(str(tmp_path), key=KEY)
    tier.write(ABI, blocks)
    tier.close()
    raw = b"".join(pathlib.Path(dp, f).read_bytes() for dp, _, fs in os.walk(tmp_path) for f in fs)
    names = " ".join(os.path.join(dp, f) for dp, _, fs in os.walk(tmp_path) for f in fs)
    for secret in (b"123456", b"654321", blocks[0].key.hex().encode(), blocks[1].key.hex().encode()):
        assert secret not in raw and secret.decode() not in names
    # the same key finds and reads the blocks back with their raw keys and token ids
    again = DiskTier(str(tmp_path), key=KEY)
    found = again.find_chain(ABI, *_keys(blocks))
    assert found.stop is None and len(found.refs) == 2
    res = again.read(found.refs)
    assert res.reason is None and [p.key for p in res.payloads] == [b.key for b in blocks]
    assert [p.tokens for p in res.payloads] == [b.tokens for b in blocks]
    assert res.payloads[1].parent == blocks[0].key
    assert again.contains(ABI, blocks[0].key) == (True, False) and again.contains(ABI, blocks[1].key) == (True, True)
    # other tokens under the same key: a collision, never a hit
    assert again.find_chain(ABI, [b.key for b in blocks], [[1, 2, 3, 4]] * 2).stop == "collision"
    # the key from the environment (hex) is the same key
    monkeypatch.setenv("HKV_STORE_KEY", KEY.hex())
    assert len(DiskTier(str(tmp_path)).find_chain(ABI, *_keys(blocks)).refs) == 2
    code, rep = _verify_json(capsys, tmp_path)  # hkv store verify takes the key from the environment
    assert code == 0 and rep["blocks_ok"] == 2 and rep["disk_auth"] == 0
    monkeypatch.delenv("HKV_STORE_KEY")
    code, rep = _verify_json(capsys, tmp_path)
    assert code == 1 and rep["blocks_ok"] == 0 and rep["disk_auth"] == 1
    assert rep["problems"][0].endswith(
        "disk_auth: manifest is authenticated (HMAC) but this tier has no key (pass key= or set HKV_STORE_KEY)"
    )
    # without a key (b"" ignores the environment) or with another key: nothing restored, with a reason
    for other in (b"", b"x" * 32):
        t = DiskTier(str(tmp_path), key=other)
        assert t.find_chain(ABI, *_keys(blocks)).refs == []
        rep = t.verify()
        assert rep[AUTH] == 1 and rep["blocks_ok"] == 0, rep
    # an unkeyed store read with a key: refused the same way
    plain = tmp_path / "plain"
    DiskTier(str(plain), key=b"").write(ABI, blocks)
    assert DiskTier(str(plain), key=KEY).verify()[AUTH] == 1


def test_store_key_arguments_are_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("HKV_STORE_KEY", "not hex")
    with pytest.raises(ValueError, match="HKV_STORE_KEY must be at least 32 hex digits"):
        DiskTier(str(tmp_path))
    with pytest.raises(ValueError, match=r"key must be at least 16 bytes \(e.g. os.urandom\(32\)\), got 5"):
        DiskTier(str(tmp_path), key=b"short")
    monkeypatch.setenv("HKV_STORE_KEY", "00" * 16)
    assert DiskTier(str(tmp_path)).keyed and not DiskTier(str(tmp_path), key=b"").keyed


# ------------------------------------------------------------------------------ close
def test_use_after_close_raises_a_named_error(tmp_path):
    tier = DiskTier(str(tmp_path))
    blocks = _chain("z", 1, 1)
    tier.write(ABI, blocks)
    refs = tier.find_chain(ABI, *_keys(blocks)).refs
    assert not tier.closed
    tier.close()
    assert tier.closed
    tier.close()  # idempotent
    assert hkv.DiskTierClosedError is DiskTierClosedError and issubclass(DiskTierClosedError, RuntimeError)
    for call in (
        lambda: tier.write_async(ABI, blocks),
        lambda: tier.write(ABI, blocks),
        lambda: tier.read(refs),
        lambda: tier.find_chain(ABI, *_keys(blocks)),
        tier.flush,
    ):
        with pytest.raises(DiskTierClosedError, match=r"this DiskTier was closed.*open a new DiskTier"):
            call()


class _FullDiskForHits:
    """A kvstore proxy whose writes under hits/ fail as tensorstore fails on a full file system."""

    def __init__(self, kv):
        self._kv = kv

    def write(self, key, value, *a, **kw):
        if str(key).startswith("hits/"):
            raise ValueError(f'OUT_OF_RANGE: Failed writing: "{key}.__lock": File too large [os_error_code=27]')
        return self._kv.write(key, value, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._kv, name)


def test_a_full_disk_never_fails_flush_or_close_through_hit_counts(store):  # noqa: F811 — the fixture from test_cli
    """Found by the chaos suite: with a full disk, `flush` (and so `Engine.write_through`,
    `flush_disk`, `save`, `close`) raised the kvstore's ValueError from saving restore-hit counts,
    which are statistics. Now the failure is counted and the tier goes on serving."""
    tier = DiskTier(str(store))
    blocks = _chain("a", 3, 1)
    found = tier.find_chain(ABI, *_keys(blocks))
    assert tier.read(found.refs).reason is None  # a hit to save
    real = tier.kv
    tier.kv = _FullDiskForHits(real)
    tier.flush()
    assert tier.counters["hit_write_failures"] == 1
    tier.kv = real  # (tensorstore's array reads need the real kvstore object)
    _intact(tier)
    tier.kv = _FullDiskForHits(real)
    tier.close()
    assert tier.counters["hit_write_failures"] == 2 and tier.closed
