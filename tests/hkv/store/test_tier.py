"""`hkv.DiskTier` on its own (no model): the manifest schema, chain lookup, the byte budget and its
leaf-first eviction, failed writes publishing nothing, and argument errors."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import types

import ml_dtypes
import numpy as np
import pytest

from hkv.store import manifest as mf
from hkv.store import read as read_path
from hkv.store.layout import Layout
from hkv.store.tier import BlockPayload, DiskBacklogError, DiskTier

ABI = "ab" * 16
BT = 4


def chain(name: str, n: int, *, snapshot_every: int = 1, kib: int = 8, start: int = 0) -> list[BlockPayload]:
    """n deterministic blocks of chain `name` (keys chained like hkv.block_keys), ~kib KiB each."""
    out, parent = [], None
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    for i in range(start + n):
        key = hashlib.blake2b((parent or b"") + f"{name}-{i}".encode(), digest_size=16).digest()
        if i >= start:
            rows = rng.standard_normal((2, kib * 128, 4)).astype(ml_dtypes.bfloat16)
            snap = (i + 1) % snapshot_every == 0
            objs = {"g0.rows": (rows, i * 2)}
            if snap:
                objs["t0.tail_kv"] = (rng.standard_normal((4, 8)).astype(np.float32), 0)
            out.append(BlockPayload(key, parent, i, (i + 1) * BT, [i] * BT, 1, snap, objs))
        parent = key
    return out


def segments(tier) -> list[types.SimpleNamespace]:
    """Every published segment of the tier's store (from a listing): name, stored_bytes, created, keys
    (block ids, in manifest order) and doc."""
    return [
        types.SimpleNamespace(
            name=name,
            stored_bytes=doc["stored_bytes"],
            created=doc["created"],
            keys=tuple(b["key"] for b in doc["blocks"]),
            doc=doc,
        )
        for _, name, doc in tier.iter_segments()
    ]


def assert_same_payloads(got_payloads, want_payloads) -> None:
    """Read-back payloads equal what was written: key, parent, tokens, snapshot flag, and every
    object's dtype, first row and bytes."""
    assert len(got_payloads) == len(want_payloads)
    for got, want in zip(got_payloads, want_payloads, strict=True):
        assert got.key == want.key and got.parent == want.parent
        assert got.tokens == want.tokens and got.snapshot == want.snapshot
        for name, (arr, row) in want.objects.items():
            assert got.objects[name][0].dtype == arr.dtype and got.objects[name][1] == row
            assert np.array_equal(got.objects[name][0].view(np.uint8), arr.view(np.uint8))


def test_round_trip_returns_the_exact_bytes_and_dtypes(tmp_path):
    tier = DiskTier(str(tmp_path))
    blocks = chain("a", 5)
    assert tier.write(ABI, blocks) == [b.key for b in blocks]
    found = tier.find_chain(ABI, [b.key for b in blocks], [b.tokens for b in blocks])
    assert found.stop is None and len(found.refs) == 5
    res = tier.read(found.refs)
    assert res.reason is None and len(res.payloads) == 5
    assert_same_payloads(res.payloads, blocks)


@pytest.mark.parametrize("piece", [1, 20 << 10, 4 << 20])
def test_a_chain_over_two_segments_reads_back_exactly_whatever_the_piece_size(tmp_path, monkeypatch, piece):
    """Reads are grouped into pieces of adjacent objects (`read.PIECE_BYTES`): one object per piece,
    a few blocks per piece, or a whole segment per piece give the same blocks and bytes, across two
    segments, and a block whose bytes fail is refused while the blocks before it (read in the same
    piece) are restored."""
    monkeypatch.setattr(read_path, "PIECE_BYTES", piece)
    tier = DiskTier(str(tmp_path), chunk_bytes=4096)
    blocks = chain("p", 8, snapshot_every=3, kib=6)
    tier.write(ABI, blocks[:3])
    tier.write(ABI, blocks[3:])
    refs = tier.find_chain(ABI, [b.key for b in blocks], [b.tokens for b in blocks]).refs
    assert len({r.segment for r in refs}) == 2
    res = tier.read(refs)
    assert res.reason is None
    assert_same_payloads(res.payloads, blocks)
    seg = refs[5].segment
    obj = refs[5].entry["objects"][0]
    shard = tmp_path / "data" / ABI / seg / "c" / "0"
    raw = bytearray(shard.read_bytes())
    chunk = obj["offset"] // 4096 + 1  # a chunk inside block 5's first object (each chunk + its crc32c)
    raw[chunk * (4096 + 4) + 7] ^= 0x01
    shard.write_bytes(bytes(raw))
    res = tier.read(refs)
    assert res.reason == "disk_checksum" and len(res.payloads) == 5, (res.reason, res.detail)
    assert_same_payloads(res.payloads, blocks[:5])


def test_chain_stops_at_an_absent_block_a_collision_or_a_foreign_abi(tmp_path):
    tier = DiskTier(str(tmp_path))
    blocks = chain("b", 4)
    tier.write(ABI, blocks[:2])
    keys, toks = [b.key for b in blocks], [b.tokens for b in blocks]
    assert (len(tier.find_chain(ABI, keys, toks).refs), tier.find_chain(ABI, keys, toks).stop) == (2, "absent")
    bad = [list(t) for t in toks]
    bad[1][0] += 1  # same key, other tokens: a hash collision is never a hit
    assert (len(tier.find_chain(ABI, keys, bad).refs), tier.find_chain(ABI, keys, bad).stop) == (1, "collision")
    tier.write("cd" * 16, blocks[2:])
    got = tier.find_chain(ABI, keys, toks)
    assert (len(got.refs), got.stop) == (2, "disk_abi")
    assert tier.find_chain(ABI, keys, toks, start=1).refs[0].entry["index"] == 1


def test_expectation_mismatch_is_rejected_before_use(tmp_path):
    tier = DiskTier(str(tmp_path))
    blocks = chain("c", 2)
    tier.write(ABI, blocks)
    refs = tier.find_chain(ABI, [b.key for b in blocks], [b.tokens for b in blocks]).refs

    def expect(ref):  # the running engine wants float32 rows: a different storage dtype
        return {o.name: (np.dtype(o.dtype) if o.dtype != "bfloat16" else np.float32, o.shape) for o in ref.objects}

    res = tier.read(refs, expect=expect)
    assert res.payloads == [] and res.reason == "disk_checksum" and "needs float32" in res.detail


def test_budget_evicts_leaf_segments_least_recently_hit_first(tmp_path):
    tier = DiskTier(str(tmp_path))
    trunk, leaf_a, leaf_b = chain("t", 4), chain("t", 2, start=4), chain("u", 3)
    for blocks in (trunk, leaf_a, leaf_b):
        tier.write(ABI, blocks)
    sizes = {s.name: s.stored_bytes for s in segments(tier)}
    assert len(sizes) == 3
    # leaf_b was restored recently; the trunk is extended by leaf_a: leaf_a goes first
    ref = tier.find_chain(ABI, [b.key for b in leaf_b], [b.tokens for b in leaf_b]).refs
    assert tier.read(ref).reason is None
    tier.budget_bytes = sum(sizes.values()) - 1
    assert tier.enforce_budget() == 1
    keys = [b.key for b in trunk + leaf_a]
    left = tier.find_chain(ABI, keys, [b.tokens for b in trunk + leaf_a])
    assert len(left.refs) == 4 and left.stop == "absent"  # the trunk survives its leaf
    assert tier.stored_bytes() <= tier.budget_bytes
    # a second opener (another process) sees the same store
    assert DiskTier(str(tmp_path)).stats()["segments"] == 2
    assert tier.counters["segments_evicted"] == 1


def test_write_over_budget_keeps_the_store_within_it(tmp_path):
    tier = DiskTier(str(tmp_path), budget_bytes=3 * 40_000)
    for i in range(6):
        tier.write(ABI, chain(f"w{i}", 2, kib=8))
    assert tier.stored_bytes() <= 3 * 40_000
    assert tier.stats()["segments"] >= 1 and tier.counters["segments_evicted"] >= 3
    report = tier.verify()
    assert report["blocks_ok"] == 2 * report["segments"] and report["orphaned_segments"] == 0


def test_failed_write_publishes_nothing(tmp_path):
    tier = DiskTier(str(tmp_path))
    bad = chain("f", 1)
    bad[0].objects["g0.rows"] = (np.zeros((2, 2), np.complex64), 0)  # no manifest dtype for complex
    fut = tier.write_async(ABI, bad)
    with pytest.raises(mf.ManifestError, match="dtype"):
        fut.result()
    tier.flush()
    assert tier.counters["write_failures"] == 1
    assert tier.stats()["segments"] == 0
    assert not os.path.exists(tmp_path / "manifests")


def test_a_write_whose_pointers_fail_publishes_nothing_and_verify_counts_unindexed_blocks(tmp_path, monkeypatch):
    """Regression: a segment's manifest is published before its blocks' pointers. A pointer update
    that failed left the manifest published (the write reported failed, `verify` counted its blocks
    ok, no lookup reached them); a writer killed between the two did the same, unreported."""
    import hkv.store.write as write_mod
    from hkv.store.cli import main
    from hkv.store.records import pointer_key

    tier = DiskTier(str(tmp_path))
    blocks = chain("p", 3)
    keys, toks = [b.key for b in blocks], [b.tokens for b in blocks]

    def stopped(*a, **kw):
        raise OSError("pointer update failed")

    monkeypatch.setattr(write_mod, "update_pointers", stopped)
    with pytest.raises(OSError, match="pointer update failed"):
        tier.write(ABI, blocks)
    monkeypatch.undo()
    assert segments(tier) == []  # the failed write is not published
    assert len(tier.find_chain(ABI, keys, toks).refs) == 0
    report = tier.verify()
    assert report["segments"] == 0 and report["orphaned_segments"] == 1 and report["unindexed_blocks"] == 0

    # what a writer killed between its manifest and its pointers leaves: verify counts those blocks
    # as unindexed (intact, reached by no lookup), not ok, and that is not a failure
    assert tier.write(ABI, blocks) == keys
    for b in blocks[1:]:
        os.remove(tmp_path / pointer_key(b.key.hex()))  # an unkeyed store names blocks by hex
    tier.refresh(force=True)
    assert len(tier.find_chain(ABI, keys, toks).refs) == 1
    report = tier.verify()
    assert (report["blocks_ok"], report["unindexed_blocks"]) == (1, 2), report
    assert len(report["unindexed"]) == 2 and all(p.startswith("data/") for p in report["problems"]), report
    assert sum(report[r] for r in ("disk_checksum", "disk_missing", "disk_truncated", "disk_abi")) == 0
    assert main(["store", "verify", "--json", str(tmp_path)]) == 0


def test_manifest_schema_errors_name_the_field():
    blocks = [
        {
            "key": "0" * 32,
            "parent": "",
            "index": 0,
            "length": 4,
            "tokens": [1, 2, 3, 4],
            "indexer_version": 1,
            "snapshot": False,
            "objects": [
                {
                    "name": "g0.rows",
                    "dtype": "bfloat16",
                    "shape": [1, 1, 4],
                    "row_start": 0,
                    "offset": 0,
                    "nbytes": 8,
                    "sum64": 0,
                }
            ],
        }
    ]
    doc = {
        "abi": ABI,
        "segment": "s",
        "writer": "w",
        "created": 0.0,
        "data_bytes": 8,
        "stored_bytes": 10,
        "chunk_bytes": 4096,
        "shard_bytes": 4096,
        "blocks": blocks,
    }
    assert mf.parse(mf.seal(doc))["blocks"][0]["tokens"] == [1, 2, 3, 4]
    # versions 1 (no shard_bytes: the array is one shard) and 2 are still read: their objects carry a
    # crc32 instead of the sum64, and a manifest naming the other version's digest is refused
    old = json.loads(json.dumps(doc))
    old["blocks"][0]["objects"][0]["crc32"] = old["blocks"][0]["objects"][0].pop("sum64")
    v1 = {k: v for k, v in old.items() if k != "shard_bytes"} | {"format": mf.FORMAT, "version": 1}
    v1["checksum"] = mf.zlib.crc32(mf._canonical(v1))
    assert Layout.of(mf.parse(json.dumps(v1).encode())).shard == 4096
    for version, d, match in ((2, old, None), (3, old, "sum64=None"), (2, doc, "crc32=None")):
        raw = d | {"format": mf.FORMAT, "version": version}
        raw["checksum"] = mf.zlib.crc32(mf._canonical(raw))
        if match is None:
            assert mf.parse(json.dumps(raw).encode())["blocks"][0]["objects"][0]["crc32"] == 0
        else:
            with pytest.raises(mf.ManifestError, match=match):
                mf.parse(json.dumps(raw).encode())
    with pytest.raises(mf.ManifestError, match="checksum"):
        mf.parse(mf.seal(doc).replace(b'"writer":"w"', b'"writer":"x"'))
    with pytest.raises(mf.ManifestError, match="not JSON"):
        mf.parse(b"{")
    for field, value, match in (
        ("abi", "XYZ", "abi"),
        ("data_bytes", 4, "exceed data_bytes"),
        ("version", 4, "version"),
        ("shard_bytes", 1000, "shard_bytes"),
        ("chunk_bytes", 0, "chunk_bytes"),
    ):
        raw = json.loads(mf.seal(doc))
        raw[field] = value
        raw["checksum"] = mf.zlib.crc32(mf._canonical(raw))
        with pytest.raises(mf.ManifestError, match=match):
            mf.parse(json.dumps(raw).encode())


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="budget_bytes"):
        DiskTier(str(tmp_path), budget_bytes=-1)
    with pytest.raises(ValueError, match="chunk_bytes"):
        DiskTier(str(tmp_path), chunk_bytes=1000)
    with pytest.raises(ValueError, match="shard_bytes"):
        DiskTier(str(tmp_path), chunk_bytes=1 << 16, shard_bytes=1 << 15)
    with pytest.raises(ValueError, match="store"):
        DiskTier(12)
    with pytest.raises(ValueError, match="at least one block"):
        DiskTier(str(tmp_path)).write_async(ABI, [])


def test_hit_counts_survive_a_writer_reopened_under_its_id(tmp_path):
    tier = DiskTier(str(tmp_path), writer_id="server-1")
    blocks = chain("h", 2)
    tier.write(ABI, blocks)
    refs = tier.find_chain(ABI, [b.key for b in blocks], [b.tokens for b in blocks]).refs
    assert tier.read(refs).reason is None
    tier.close()
    again = DiskTier(str(tmp_path), writer_id="server-1")
    assert again.read(refs).reason is None
    again.flush()
    assert DiskTier(str(tmp_path)).stats()["abis"][ABI]["hits"] == 4


@pytest.mark.parametrize(
    "fault,reason",
    [(None, None), ("flip", "disk_checksum"), ("truncate", "disk_truncated"), ("delete", "disk_missing")],
)
def test_a_segment_cut_into_shards_round_trips_and_a_bad_shard_stops_the_plan_at_its_first_block(
    tmp_path, fault, reason
):
    tier = DiskTier(str(tmp_path), chunk_bytes=4096, shard_bytes=8192)
    blocks = chain("s", 6, kib=3, snapshot_every=2)  # 6 KiB rows: objects span chunk and shard boundaries
    tier.write(ABI, blocks)
    (seg,) = segments(tier)
    doc = mf.parse((tmp_path / "manifests" / ABI / f"{seg.name}.json").read_bytes())
    data = tmp_path / "data" / ABI / seg.name / "c"
    shards = sorted(os.listdir(data), key=int)
    padded = -(-doc["data_bytes"] // 4096) * 4096
    assert doc["version"] == mf.VERSION and doc["shard_bytes"] == 8192
    assert shards == [str(i) for i in range(-(-padded // 8192))]
    assert len(shards) >= 4  # the pipeline really ran over several shards
    assert sum(os.path.getsize(data / s) for s in shards) == doc["stored_bytes"] == seg.stored_bytes
    bad = 2  # the shard hit by the fault: the plan stops at the first block with a byte in it
    lo, hi = bad * 8192, (bad + 1) * 8192
    first_bad = next(
        i
        for i, e in enumerate(doc["blocks"])
        if any(o["offset"] < hi and o["offset"] + o["nbytes"] > lo for o in e["objects"])
    )
    path = data / str(bad)
    if fault == "flip":
        raw = bytearray(path.read_bytes())
        raw[10] ^= 0x01
        path.write_bytes(bytes(raw))
    elif fault == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    elif fault == "delete":
        path.unlink()
    refs = tier.find_chain(ABI, [b.key for b in blocks], [b.tokens for b in blocks]).refs
    res = tier.read(refs)
    assert 0 < first_bad < len(blocks) - 1
    want = len(blocks) if fault is None else first_bad
    assert res.reason == reason and len(res.payloads) == want, (res.reason, res.detail)
    if fault is not None:
        assert f"shard {bad}" in res.detail or reason == "disk_checksum"
    for got, blk in zip(res.payloads, blocks, strict=False):
        for name, (arr, _) in blk.objects.items():
            assert np.array_equal(got.objects[name][0].view(np.uint8), arr.view(np.uint8))


def test_segments_queued_back_to_back_each_keep_their_own_bytes(tmp_path):
    # write_async returns at once; the writer reuses one staging buffer for every segment and overlaps
    # a segment's shard writes with the next segment's copy, so this fails if a buffer is reused early
    # (max_segment_bytes=1: no group commit, one segment per request)
    tier = DiskTier(str(tmp_path), chunk_bytes=4096, shard_bytes=8192, max_segment_bytes=1)
    chains = [chain(f"q{i}", 4, kib=3, snapshot_every=2) for i in range(5)]
    futs = [tier.write_async(ABI, c) for c in chains]
    assert [f.result() for f in futs] == [[b.key for b in c] for c in chains]
    names = [s.name for s in sorted(segments(tier), key=lambda s: s.created)]
    found = [tier.find_chain(ABI, [c[0].key], [c[0].tokens]).refs[0].segment for c in chains]
    assert found == names  # published in write order
    for c in chains:
        res = tier.read(tier.find_chain(ABI, [b.key for b in c], [b.tokens for b in c]).refs)
        assert res.reason is None and len(res.payloads) == len(c)
        for got, blk in zip(res.payloads, c, strict=True):
            for name, (arr, _) in blk.objects.items():
                assert np.array_equal(got.objects[name][0].view(np.uint8), arr.view(np.uint8))
    assert tier.verify()["blocks_ok"] == 20


def _gated(tier):
    """Hold the writer thread inside its first segment until the returned event is set."""
    gate, entered, real = threading.Event(), threading.Event(), tier._writer.write_segment

    def slow(*a, **kw):
        entered.set()
        assert gate.wait(60)
        return real(*a, **kw)

    tier._writer.write_segment = slow
    return gate, entered


def test_requests_queued_while_the_writer_is_busy_are_written_as_one_segment(tmp_path):
    tier = DiskTier(str(tmp_path))
    gate, entered = _gated(tier)
    chains = [chain(f"g{i}", 2) for i in range(5)]
    futs = [tier.write_async(ABI, chains[0])]
    assert entered.wait(60)  # the writer holds request 0; requests 1-4 queue behind it
    futs += [tier.write_async(ABI, c) for c in chains[1:]]
    bad = chain("g-bad", 1)
    bad[0].objects["g0.rows"] = (np.zeros((2, 2), np.complex64), 0)  # no manifest dtype for complex
    futs.append(tier.write_async(ABI, bad))
    gate.set()
    assert [f.result() for f in futs[:5]] == [[b.key for b in c] for c in chains]
    with pytest.raises(mf.ManifestError, match="dtype"):
        futs[5].result()  # refused on its own; the requests queued with it are written
    tier.flush()
    assert tier.counters["segments_written"] == 2 and tier.counters["write_failures"] == 1
    assert sorted(len(s.keys) for s in segments(tier)) == [2, 8]
    for c in chains:
        res = tier.read(tier.find_chain(ABI, [b.key for b in c], [b.tokens for b in c]).refs)
        assert res.reason is None and len(res.payloads) == 2
        for got, blk in zip(res.payloads, c, strict=True):
            assert np.array_equal(got.objects["g0.rows"][0].view(np.uint8), blk.objects["g0.rows"][0].view(np.uint8))


def test_a_write_beyond_the_backlog_limit_fails_at_once_and_host_memory_stays_bounded(tmp_path):
    one = sum(a.nbytes for b in chain("x", 1) for a, _ in b.objects.values())
    tier = DiskTier(str(tmp_path), max_queued_bytes=4 * one)
    gate, entered = _gated(tier)
    futs = [tier.write_async(ABI, chain("q0", 1))]
    assert entered.wait(60)  # the request being staged still holds its host bytes; three more fit
    futs += [tier.write_async(ABI, chain(f"q{i}", 1)) for i in range(1, 4)]
    dropped = tier.write_async(ABI, chain("q4", 1))
    assert dropped.done() and isinstance(dropped.exception(), DiskBacklogError)
    assert "max_queued_bytes" in str(dropped.exception()) and tier.counters["writes_dropped"] == 1
    gate.set()
    assert all(len(f.result()) == 1 for f in futs)
    tier.flush()
    assert tier.stats()["abis"][ABI]["blocks"] == 4 and tier.counters["write_failures"] == 0
    assert tier._writer.queued_bytes == 0
    with pytest.raises(ValueError, match="max_queued_bytes"):
        DiskTier(str(tmp_path), max_queued_bytes=0)


def test_one_segment_may_list_a_block_with_and_without_its_snapshot(tmp_path):
    # two requests committed together: block 1 first as an inner block, then again with its snapshot
    tier = DiskTier(str(tmp_path))
    gate, entered = _gated(tier)
    first = tier.write_async(ABI, chain("z0", 1))
    assert entered.wait(60)
    plain = chain("d", 2, snapshot_every=3)  # no snapshots
    snap = chain("d", 1, start=1)  # block 1 again, with its snapshot
    futs = [tier.write_async(ABI, plain), tier.write_async(ABI, snap)]
    gate.set()
    first.result(), [f.result() for f in futs]
    (seg,) = [s for s in segments(tier) if len(s.keys) == 3]
    assert seg.keys[1] == seg.keys[2] == snap[0].key.hex()
    refs = tier.find_chain(ABI, [b.key for b in plain], [b.tokens for b in plain]).refs
    assert refs[1].snapshot  # the copy with the snapshot is preferred
    res = tier.read(refs)
    assert res.reason is None and set(res.payloads[1].objects) == {"g0.rows", "t0.tail_kv"}
    assert tier.verify()["blocks_ok"] == 4


def test_small_writes_linger_to_share_a_segment_but_flush_does_not_wait(tmp_path):
    tier = DiskTier(str(tmp_path), linger_seconds=30)
    futs = [tier.write_async(ABI, chain(f"l{i}", 1)) for i in range(4)]  # one block each: far below a shard
    time.sleep(0.2)
    assert not any(f.done() for f in futs)  # the writer lingers for more requests
    t = time.monotonic()
    tier.flush()  # a waiting caller ends the linger at once
    assert time.monotonic() - t < 10 and all(f.done() for f in futs)
    assert tier.counters["segments_written"] == 1 and tier.counters["blocks_written"] == 4
    t = time.monotonic()
    tier.write(ABI, chain("l-sync", 1))  # a synchronous write does not linger either
    assert time.monotonic() - t < 10 and tier.counters["segments_written"] == 2
    with pytest.raises(ValueError, match="linger_seconds"):
        DiskTier(str(tmp_path), linger_seconds=-1)
