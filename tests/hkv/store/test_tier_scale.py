"""A disk tier store that scales to many hosts (issue 47, item 5): lookups read computed keys (block
pointers) and never list the store; the lookup index is a bounded cache; two processes enforcing one
budget at once never over-evict nor delete a segment the other just restored from; the victims are
ranked in one pass with the old rule's result; a pointer forged without the store key is `disk_auth`."""

from __future__ import annotations

import json
import os
import pathlib
import random
import threading
import zlib

import pytest

from hkv.store import records
from hkv.store.budget import SegmentInfo, rank_victims
from hkv.store.tier import AUTH, MALFORMED, DiskTier

from .test_tier import ABI, chain, segments

KEY = bytes(range(32))


def _keys(blocks):
    return [b.key for b in blocks], [b.tokens for b in blocks]


class _CountingKv:
    """The tier's kvstore, counting its list calls and the keys it reads."""

    def __init__(self, kv):
        self._kv, self.lists, self.reads = kv, 0, []

    def __getattr__(self, name):
        return getattr(self._kv, name)

    def __truediv__(self, other):
        return self._kv / other

    def list(self, *a, **kw):
        self.lists += 1
        return self._kv.list(*a, **kw)

    def read(self, key, *a, **kw):
        self.reads.append(str(key))
        return self._kv.read(key, *a, **kw)


def test_a_lookup_reads_computed_keys_and_never_lists_the_store(tmp_path):
    writer = DiskTier(str(tmp_path))
    chains = [chain(f"l{i}", 3) for i in range(6)]
    for c in chains:
        writer.write(ABI, c)
    tier = DiskTier(str(tmp_path), refresh_seconds=0)  # another process: nothing cached
    counting = _CountingKv(tier.kv)
    tier.kv = counting
    for c in chains:
        found = tier.find_chain(ABI, *_keys(c))
        assert found.stop is None and len(found.refs) == 3
        assert tier.contains(ABI, c[-1].key) == (True, True)
    assert tier.find_chain(ABI, *_keys(chain("never", 2))).stop == "absent"
    tier.kv = counting._kv  # (tensorstore's array reads need the real kvstore object)
    res = tier.read(tier.find_chain(ABI, *_keys(chains[0])).refs)
    assert res.reason is None and len(res.payloads) == 3
    assert counting.lists == 0  # no LIST on the lookup path
    assert {k.split("/")[0] for k in counting.reads} == {"blocks", "manifests"}


def test_the_lookup_index_is_bounded_and_lookups_beyond_it_still_succeed(tmp_path):
    writer = DiskTier(str(tmp_path), max_index_entries=4)
    chains = [chain(f"b{i}", 2) for i in range(40)]  # 80 pointers, 40 manifests: far over the bound
    for c in chains:
        writer.write(ABI, c)
    size = writer.index_size()
    assert size.pointers <= 4 and size.segments <= 16 and (size.max_pointers, size.max_segments) == (4, 16)
    reader = DiskTier(str(tmp_path), max_index_entries=4, refresh_seconds=3600)
    for c in chains + chains[:5]:  # every chain (and again: by GET, not from a cache that holds all)
        found = reader.find_chain(ABI, *_keys(c))
        assert found.stop is None and len(found.refs) == 2
        size = reader.index_size()
        assert size.pointers <= 4 and size.segments <= 16
    res = reader.read(reader.find_chain(ABI, *_keys(chains[0])).refs)
    assert res.reason is None and len(res.payloads) == 2
    with pytest.raises(ValueError, match="max_index_entries"):
        DiskTier(str(tmp_path), max_index_entries=0)


def test_two_evictors_at_once_delete_exactly_what_is_needed_and_spare_what_the_other_restores(tmp_path):
    for trial in range(3):
        path = tmp_path / str(trial)
        w = DiskTier(str(path))
        chains = [chain(f"e{trial}-{i}", 1, kib=4) for i in range(6)]
        for c in chains:  # six leaf segments, oldest first
            w.write(ABI, c)
        segs = sorted(segments(w), key=lambda s: s.created)
        size = segs[0].stored_bytes
        assert all(s.stored_bytes == size for s in segs)
        a, b = DiskTier(str(path), writer_id="host-a"), DiskTier(str(path), writer_id="host-b")
        # host a restores from the two oldest segments: in use, they must survive
        for c in chains[:2]:
            assert a.read(a.find_chain(ABI, *_keys(c)).refs).reason is None
        budget = 4 * size  # two segments over it
        a.budget_bytes = b.budget_bytes = budget
        barrier, deleted = threading.Barrier(2), {}

        def enforce(tier, name, barrier=barrier, deleted=deleted):
            barrier.wait()
            deleted[name] = tier.enforce_budget()

        threads = [threading.Thread(target=enforce, args=(t, n)) for t, n in ((a, "a"), (b, "b"))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        left = {s.name for s in segments(w)}
        assert sum(deleted.values()) == 2, deleted  # never more than needed (nor fewer)
        assert len(left) == 4 and w.stored_bytes() == 4 * size <= budget
        assert {segs[0].name, segs[1].name} <= left  # host a's restores survived whoever evicted
        assert left == {s.name for s in segs[:2] + segs[4:]}  # the least recently used others went
        for c in chains[:2]:
            assert b.read(b.find_chain(ABI, *_keys(c)).refs).reason is None


def _old_victims(segs: list[SegmentInfo], last_hit: dict, budget: int) -> list[str]:
    """The rule before issue 47: re-rank every segment after each deletion (quadratic)."""

    def victim(segments):
        extended, covered = {}, {}
        for s in segments:
            for p in s.parents:
                extended.setdefault((s.abi, p), set()).add(s.name)
        for s in segments:
            for k in s.keys:
                covered[(s.abi, k)] = covered.get((s.abi, k), 0) + 1

        def rank(s):
            inner = any(extended.get((s.abi, k), set()) - {s.name} and covered[(s.abi, k)] == 1 for k in s.keys)
            return inner, max(last_hit.get(s.sid, 0.0), s.created)

        return min(segments, key=rank)

    left, out = list(segs), []
    while left and sum(s.stored_bytes for s in left) > budget:
        v = victim(left)
        out.append(v.name)
        left.remove(v)
    return out


def test_one_pass_ranking_picks_the_old_rules_victims():
    rng = random.Random(47)
    # the documented example: a trunk extended by a leaf, and another chain hit recently
    trunk = SegmentInfo(ABI, "trunk", 100, 1.0, ("k0", "k1"), ("k0",))
    leaf = SegmentInfo(ABI, "leaf", 100, 3.0, ("k2",), ("k1",))
    other = SegmentInfo(ABI, "other", 100, 2.0, ("x0",), ())
    hits = {other.sid: 10.0}
    assert [v.name for v in rank_victims([trunk, leaf, other], hits, 100)] == ["leaf"]
    assert [v.name for v in rank_victims([trunk, leaf, other], hits, 250)] == ["leaf", "trunk", "other"]
    for _ in range(200):  # random forests of chains in segments, shared copies, hits
        segs, made = [], []
        for n in range(rng.randint(1, 12)):
            parent = rng.choice(made + [""] * 3)
            keys, parents = [], []
            for _ in range(rng.randint(1, 3)):
                k = rng.choice(made) if made and rng.random() < 0.15 else f"k{len(made)}"
                made.append(k)
                keys.append(k)
                parents.append(parent)
                parent = k
            segs.append(
                SegmentInfo(
                    ABI,
                    f"s{n}",
                    rng.randint(1, 5) * 10,
                    float(rng.randint(0, 5)),
                    tuple(keys),
                    tuple(p for p in parents if p),
                )
            )
        hits = {s.sid: float(rng.randint(0, 8)) for s in segs if rng.random() < 0.3}
        total = sum(s.stored_bytes for s in segs)
        budget = rng.randint(0, total)
        assert [v.name for v in rank_victims(segs, hits, total - budget)] == _old_victims(segs, hits, budget)


def test_a_pointer_forged_without_the_key_is_disk_auth_and_a_damaged_one_disk_malformed(tmp_path, monkeypatch):
    monkeypatch.delenv("HKV_STORE_KEY", raising=False)
    blocks = chain("f", 3)
    tier = DiskTier(str(tmp_path), key=KEY)
    tier.write(ABI, blocks)
    bid = tier._ctx.block_id(blocks[1].key)
    path = pathlib.Path(tmp_path, records.pointer_key(bid))
    assert path.is_file() and blocks[1].key.hex() not in path.name  # the name is the keyed hash
    good = path.read_bytes()
    doc = json.loads(good)
    # the attacker edits the pointer (another holder) without the key: a fresh crc32, a stale HMAC
    forged = {k: v for k, v in doc.items() if k not in ("checksum", "hmac")}
    forged["holders"] = {ABI: [["00000000-elsewhere", True, 100]] + doc["holders"][ABI]}
    forged["checksum"] = zlib.crc32(json.dumps(forged, sort_keys=True, separators=(",", ":")).encode())
    forged["hmac"] = doc["hmac"]
    path.write_bytes(records.pad(json.dumps(forged).encode(), records.POINTER_BYTES))
    other = DiskTier(str(tmp_path), key=KEY, refresh_seconds=0)
    found = other.find_chain(ABI, *_keys(blocks))
    assert (len(found.refs), found.stop) == (1, AUTH)  # a shorter plan with its reason, never an exception
    assert other.counters["rejected_disk_auth"] == 1
    res = other.read(found.refs)
    assert res.reason is None and len(res.payloads) == 1
    # damaged (a flipped byte): disk_malformed; truncated: disk_malformed; deleted: absent (a miss)
    flipped = bytearray(good)
    flipped[40] ^= 0x01
    for damage, stop in ((bytes(flipped), MALFORMED), (good[:100], MALFORMED), (None, "absent")):
        if damage is None:
            os.remove(path)
        else:
            path.write_bytes(damage)
        found = other.find_chain(ABI, *_keys(blocks))
        assert (len(found.refs), found.stop) == (1, stop)
    # restored: found again; a keyless reader computes other names (the raw key's hex): nothing found
    path.write_bytes(good)
    assert other.find_chain(ABI, *_keys(blocks)).stop is None
    assert DiskTier(str(tmp_path), key=b"").find_chain(ABI, *_keys(blocks)).refs == []


def test_an_evicted_segment_leaves_no_pointer_and_a_dangling_pointer_is_a_miss(tmp_path):
    tier = DiskTier(str(tmp_path))
    blocks = chain("d", 2)
    tier.write(ABI, blocks)
    (seg,) = segments(tier)
    keep = pathlib.Path(tmp_path, records.pointer_key(blocks[0].key.hex())).read_bytes()
    tier.delete_segment(ABI, seg.name)
    assert not os.path.exists(tmp_path / "blocks" / blocks[0].key.hex()[:2] / f"{blocks[0].key.hex()}.json")
    assert tier.stored_bytes() == 0
    pathlib.Path(tmp_path, records.pointer_key(blocks[0].key.hex())).write_bytes(keep)  # left by a killed evictor
    other = DiskTier(str(tmp_path), refresh_seconds=0)
    assert other.contains(ABI, blocks[0].key) == (False, False)  # so an engine writes it again
    found = other.find_chain(ABI, *_keys(blocks))
    res = other.read(found.refs)
    assert res.payloads == [] and res.reason == "disk_missing"  # a miss with its reason, never a block
