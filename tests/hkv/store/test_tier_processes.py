"""Process-level faults of the disk tier (`hkv.store.tier.DiskTier`): real OS processes sharing one store.

1. A writer killed with SIGKILL mid-write (at random moments, and deterministically between its data
   commit and its manifest publish): the store opens, every published block reads back verified with
   exactly the bytes written, `verify` finds no bad block (orphaned data only), and nothing unpublished
   is visible.
2. Two writers on one store at once, with overlapping block keys (the same chains) and disjoint ones:
   both finish without an exception; every block of both reads back verified; `verify` and `stats`
   agree with what the writers say they wrote and read.
3. A reader looping find_chain + read while another process writes (and, in one variant, evicts over
   its budget): the reader never raises and never returns a payload that differs from the one written.

Children are this module run as `python -m tests.hkv.store.test_tier_processes ROLE ...`; every payload is a
pure function of (chain, block index, block bytes), so any process can recompute what must be read.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback

import ml_dtypes
import numpy as np
import pytest

from hkv.store.tier import BlockPayload, DiskTier

ABI = "5a" * 16
ABI2 = "c3" * 16
BT = 8  # block tokens
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ENV = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")


# ------------------------------------------------------------------------ deterministic payloads
def key(chain: str, i: int) -> bytes:
    return hashlib.blake2b(f"{chain}-{i}".encode(), digest_size=16).digest()


def tokens(chain: str, i: int) -> list[int]:
    return [int(b) for b in key(chain, i)[:BT]]


def payload(chain: str, i: int, nbytes: int) -> BlockPayload:
    """Block i of `chain`, about `nbytes` of objects (random bits: bfloat16 NaNs included)."""
    rng = np.random.default_rng(int.from_bytes(key(chain, i)[:8], "little"))
    rows = max(1, nbytes // 1536)
    objects = {
        "g0.rows": (np.frombuffer(rng.bytes(rows * 1024), np.float32).reshape(rows, 256), i * rows),
        "g1.rows": (np.frombuffer(rng.bytes(rows * 512), ml_dtypes.bfloat16).reshape(rows, 256), i * rows),
    }
    snapshot = i % 3 == 2
    if snapshot:
        objects["g2.window"] = (np.frombuffer(rng.bytes(4 * 64 * 2), ml_dtypes.bfloat16).reshape(4, 64), i * BT)
        objects["t0.tail_kv"] = (np.frombuffer(rng.bytes(3 * 32 * 4), np.float32).reshape(3, 32), 0)
    return BlockPayload(
        key=key(chain, i),
        parent=key(chain, i - 1) if i else None,
        index=i,
        length=(i + 1) * BT,
        tokens=tokens(chain, i),
        indexer_version=1,
        snapshot=snapshot,
        objects=objects,
    )


def mismatch(got: BlockPayload, chain: str, i: int, nbytes: int) -> str | None:
    """Why `got` is not block i of `chain` byte for byte (None when it is)."""
    want = payload(chain, i, nbytes)
    for f in ("key", "parent", "index", "length", "tokens", "indexer_version", "snapshot"):
        if getattr(got, f) != getattr(want, f):
            return f"{chain}[{i}].{f}: {getattr(got, f)!r} != {getattr(want, f)!r}"
    if set(got.objects) != set(want.objects):
        return f"{chain}[{i}] objects {sorted(got.objects)} != {sorted(want.objects)}"
    for name, (w, w0) in want.objects.items():
        g, g0 = got.objects[name]
        if g.dtype != w.dtype or g.shape != w.shape or g0 != w0 or g.tobytes() != w.tobytes():
            return f"{chain}[{i}].{name}: {g.dtype}{g.shape}@{g0} differs from {w.dtype}{w.shape}@{w0} or its bytes"
    return None


def lookup(tier: DiskTier, abi: str, chain: str, n: int):
    return tier.find_chain(abi, [key(chain, i) for i in range(n)], [tokens(chain, i) for i in range(n)])


# --------------------------------------------------------------------------------- child roles
class _PauseBeforeSecondPublish:
    """A kvstore proxy: the second manifest write announces itself and hangs (to be killed there)."""

    def __init__(self, kv):
        self._kv, self._published = kv, 0

    def __getattr__(self, name):
        return getattr(self._kv, name)

    def __truediv__(self, other):
        return self._kv / other

    def write(self, k, *a, **kw):
        if k.startswith("manifests/"):
            self._published += 1
            if self._published == 2:
                print("publishing", flush=True)
                time.sleep(60)
        return self._kv.write(k, *a, **kw)


def _child_kill_writer(path: str, chain: str, block_bytes: str, per_seg: str, mode: str) -> None:
    block_bytes, per_seg = int(block_bytes), int(per_seg)
    tier = DiskTier(path, shard_bytes=KILL_SHARD)  # several shard files per segment: a kill can fall between them
    if mode == "pause":
        tier.kv = _PauseBeforeSecondPublish(tier.kv)
    for s in range(10_000):
        print(f"begin {s}", flush=True)
        tier.write(ABI, [payload(chain, s * per_seg + j, block_bytes) for j in range(per_seg)])
        print(f"done {s}", flush=True)


def _wait_for(path: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(path)
        time.sleep(0.002)


def _child_writer(path: str, name: str, config: str) -> None:
    """Write cfg["chains"] ([abi, chain, n_blocks, blocks_per_segment]) asynchronously, checking the
    chains already written (find_chain + read) while each write is in flight."""
    cfg = json.loads(config)
    summary = {"errors": [], "mismatches": [], "checks": 0}
    tier = None
    try:
        tier = DiskTier(path, writer_id=name, refresh_seconds=0)
        print("ready", flush=True)
        _wait_for(cfg["go"])
        written: list[tuple[str, str, int]] = []
        rng = random.Random(name)

        def check(abi, chain, n):
            found = lookup(tier, abi, chain, n)
            if found.stop is not None or len(found.refs) != n:
                summary["mismatches"].append(f"{chain}: {len(found.refs)} of {n} blocks found ({found.stop})")
                return
            res = tier.read(found.refs)
            if res.reason is not None:
                summary["mismatches"].append(f"{chain}: read stopped at {len(res.payloads)}: {res.reason} {res.detail}")
            for i, p in enumerate(res.payloads):
                if (why := mismatch(p, chain, i, cfg["block_bytes"])) is not None:
                    summary["mismatches"].append(why)
            summary["checks"] += 1

        for abi, chain, n, per_seg in cfg["chains"]:
            futs = [
                tier.write_async(abi, [payload(chain, i, cfg["block_bytes"]) for i in range(s, min(s + per_seg, n))])
                for s in range(0, n, per_seg)
            ]
            while not all(f.done() for f in futs):
                if written:
                    check(*rng.choice(written))
                else:
                    time.sleep(0.001)
            for f in futs:
                f.result()
            written.append((abi, chain, n))
        tier.flush()
        for w in written:
            check(*w)
        tier.close()
        summary["counters"] = tier.counters
    except BaseException:  # reported to the parent, which fails the test
        summary["errors"].append(traceback.format_exc())
    print(json.dumps(summary), flush=True)


def _child_stream_writer(path: str, n_chains: str, n_blocks: str, block_bytes: str, budget: str, go: str) -> None:
    tier = DiskTier(path, budget_bytes=None if budget == "none" else int(budget), writer_id="stream")
    print("ready", flush=True)
    _wait_for(go)
    for c in range(int(n_chains)):
        tier.write(ABI, [payload(f"R{c}", i, int(block_bytes)) for i in range(int(n_blocks))])
        time.sleep(0.01)
    tier.close()
    print(json.dumps(tier.counters), flush=True)


def _child_reader(path: str, n_chains: str, n_blocks: str, block_bytes: str, go: str, done: str) -> None:
    """Loop find_chain + read over every chain until `done` exists, then one last pass."""
    n_chains, n_blocks, block_bytes = int(n_chains), int(n_blocks), int(block_bytes)
    summary = {
        "errors": [],
        "mismatches": [],
        "passes": 0,
        "blocks_read": 0,
        "reasons": {},
        "stops": {},
        "seen_partial": False,
        "final": {},
    }
    try:
        tier = DiskTier(path, refresh_seconds=0)
        print("ready", flush=True)
        _wait_for(go)
        last = False
        while True:
            last = os.path.exists(done)
            present = 0
            for c in range(n_chains):
                chain = f"R{c}"
                found = lookup(tier, ABI, chain, n_blocks)
                summary["stops"][str(found.stop)] = summary["stops"].get(str(found.stop), 0) + 1
                res = tier.read(found.refs)
                if res.reason is not None:
                    summary["reasons"][res.reason] = summary["reasons"].get(res.reason, 0) + 1
                for i, p in enumerate(res.payloads):
                    if (why := mismatch(p, chain, i, block_bytes)) is not None:
                        summary["mismatches"].append(why)
                summary["blocks_read"] += len(res.payloads)
                present += bool(res.payloads)
                if last:
                    summary["final"][chain] = [len(found.refs), len(res.payloads), res.reason]
            summary["passes"] += 1
            summary["seen_partial"] |= 0 < present < n_chains
            if last:
                break
        tier.close()
    except BaseException:
        summary["errors"].append(traceback.format_exc())
    print(json.dumps(summary), flush=True)


ROLES = {
    "kill-writer": _child_kill_writer,
    "writer": _child_writer,
    "stream-writer": _child_stream_writer,
    "reader": _child_reader,
}


# --------------------------------------------------------------------------------- parent side
def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.hkv.store.test_tier_processes", *map(str, args)],
        env=ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _watchdog(proc: subprocess.Popen, seconds: float) -> threading.Timer:
    t = threading.Timer(seconds, proc.kill)
    t.daemon = True
    t.start()
    return t


def _expect_line(proc: subprocess.Popen, want: str) -> None:
    line = proc.stdout.readline()
    assert line.strip() == want, f"child said {line!r}; stderr:\n{proc.stderr.read() if not line else ''}"


def _finish(proc: subprocess.Popen, timeout: float = 60) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child exit {proc.returncode}\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def _manifests(path) -> list[dict]:
    return [json.loads(open(f, "rb").read()) for f in sorted(glob.glob(os.path.join(path, "manifests", "*", "*.json")))]


def _assert_clean(report: dict, blocks: int, orphans: int | None = None) -> None:
    bad = {r: report[r] for r in ("disk_checksum", "disk_missing", "disk_truncated", "disk_abi") if report[r]}
    assert not bad, report["problems"]
    assert report["blocks_ok"] == blocks, report
    if orphans is not None:
        assert report["orphaned_segments"] == orphans, report["problems"]


# ------------------------------------------------------------------------------------ 1. SIGKILL
KILL_BLOCK = 2 << 20  # 4 blocks of 2 MiB: 8 MiB segments, in 4 shards of 2 MiB
KILL_PER_SEG = 4
KILL_SHARD = 2 << 20


def _kill_round(path: str, chain: str, mode: str, delay: float) -> tuple[int, str]:
    """Run a kill-writer until it reported one published segment, then SIGKILL it: in "run" mode
    `delay` seconds after it began the next write, in "pause" mode while it hangs before publishing
    its second manifest. Returns (segments it reported published, the last line it printed)."""
    proc = _spawn("kill-writer", path, chain, KILL_BLOCK, KILL_PER_SEG, mode)
    dog = _watchdog(proc, 60)
    done, last = 0, ""
    for line in proc.stdout:
        last = line.strip()
        done += last.startswith("done ")
        if done and ((mode == "run" and last.startswith("begin ")) or (mode == "pause" and last == "publishing")):
            time.sleep(delay)
            os.kill(proc.pid, signal.SIGKILL)
            break
    rest = proc.stdout.read()
    proc.wait()
    dog.cancel()
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr.read()[-4000:])
    done += sum(x.startswith("done ") for x in rest.splitlines())
    return done, last


def test_writer_killed_mid_write_leaves_only_published_verified_blocks(tmp_path, capsys):
    path = str(tmp_path / "store")
    rounds = [("pause", 0.0), ("run", 0.0), ("run", random.uniform(0.002, 0.015)), ("run", random.uniform(0.015, 0.04))]
    published: dict[str, int] = {}  # chain -> segments published that lookups reach
    outcomes, orphans, unindexed = [], 0, 0
    for r, (mode, delay) in enumerate(rounds):
        chain = f"kill{r}"
        reported, last = _kill_round(path, chain, mode, delay)
        assert reported >= 1

        tier = DiskTier(path)  # a killed writer never keeps the store from opening
        mine = [
            b
            for m in _manifests(path)
            for b in m["blocks"]
            if b["key"] in {key(chain, i).hex() for i in range(KILL_PER_SEG * (reported + 2))}
        ]
        n = len(mine) // KILL_PER_SEG
        assert sorted(b["index"] for b in mine) == list(range(n * KILL_PER_SEG)), "published blocks are whole segments"
        assert n in (reported, reported + 1), (n, reported)  # the killed write may have published just before
        if mode == "pause":
            assert n == reported == 1
        report = tier.verify()
        # killed between its manifest and its pointers, the last write's blocks are unindexed: whole,
        # intact, and reached by no lookup (never a block of a segment the writer reported done)
        new_unindexed = report["unindexed_blocks"] - unindexed
        assert new_unindexed in (0, KILL_PER_SEG) and (new_unindexed == 0 or n == reported + 1), (new_unindexed, n)
        unindexed = report["unindexed_blocks"]
        published[chain] = n - new_unindexed // KILL_PER_SEG

        # every published block of every round reads back verified, with the very bytes written
        for c, segs in published.items():
            want = segs * KILL_PER_SEG
            found = lookup(tier, ABI, c, want + 2 * KILL_PER_SEG)
            assert len(found.refs) == want and found.stop == "absent"  # nothing unpublished is visible
            assert tier.contains(ABI, key(c, want)) == (False, False)
            res = tier.read(found.refs)
            assert res.reason is None, (res.reason, res.detail)
            assert [mismatch(p, c, i, KILL_BLOCK) for i, p in enumerate(res.payloads)] == [None] * want

        _assert_clean(report, blocks=sum(published.values()) * KILL_PER_SEG)
        assert report["orphaned_segments"] >= orphans
        if mode == "pause":  # its data was committed, its manifest never written
            assert report["orphaned_segments"] == orphans + 1
        new_orphans = report["orphaned_segments"] - orphans
        outcomes.append((mode, round(delay, 4), last, reported, n, new_unindexed, new_orphans))
        orphans = report["orphaned_segments"]
        tier.close()

    # the CLI agrees: orphaned data is not a failure, and it accounts for every interrupted write,
    # including one killed before any key was committed (only the file driver's *.__lock files)
    from hkv.store.cli import main

    assert main(["store", "verify", "--json", path]) == 0
    rep = json.loads(capsys.readouterr().out)
    # a write killed right after the driver made its folder leaves it empty: nothing was written there,
    # and the CLI counts no such folder (only one holding data or the driver's temporary files)
    unpublished = [
        d
        for d in glob.glob(os.path.join(path, "data", ABI, "*"))
        if not os.path.exists(os.path.join(path, "manifests", ABI, os.path.basename(d) + ".json"))
        and any(files for _, _, files in os.walk(d))
    ]
    assert rep["orphaned_segments"] == len(unpublished) >= orphans >= 1

    # the store keeps working: a new writer adds a segment, everything still verifies
    tier = DiskTier(path)
    tier.write(ABI, [payload("after", i, 4096) for i in range(3)])
    report = tier.verify()
    _assert_clean(report, blocks=sum(published.values()) * KILL_PER_SEG + 3, orphans=orphans)
    tier.close()
    print("kill outcomes (mode, delay, last line, segments reported, published, unindexed, new orphans):", outcomes)


# ----------------------------------------------------------------------------- 2. two writers
BLOCK = 48 << 10


def _writer_config(name: str, go: str) -> dict:
    shared = [[ABI, f"S{c}", 6, 3] for c in range(4)]
    own = [
        [ABI, f"own-{name}-0", 6, 3],
        [ABI, f"own-{name}-1", 4, 4],
        [ABI2, f"own-{name}-2", 5, 2],
        [ABI2, "S9", 3, 3],
    ]  # S9: overlapping keys under the second ABI too
    if name == "w1":
        shared.reverse()
    chains = [c for pair in zip(shared, own, strict=True) for c in pair]
    return {"chains": chains, "block_bytes": BLOCK, "go": go}


def test_two_writers_with_overlapping_and_disjoint_keys(tmp_path):
    path, go = str(tmp_path / "store"), str(tmp_path / "go")
    cfgs = {w: _writer_config(w, go) for w in ("w0", "w1")}
    procs = {w: _spawn("writer", path, w, json.dumps(cfg)) for w, cfg in cfgs.items()}
    dogs = [_watchdog(p, 90) for p in procs.values()]
    for p in procs.values():
        _expect_line(p, "ready")
    open(go, "w").close()
    out = {w: _finish(p) for w, p in procs.items()}
    for d in dogs:
        d.cancel()
    for w, s in out.items():
        assert s["errors"] == [], f"{w}: {s['errors'][0]}"
        assert s["mismatches"] == [], f"{w}: {s['mismatches'][:5]}"
        assert s["counters"]["write_failures"] == 0 and s["checks"] >= len(cfgs[w]["chains"])

    chains = {(abi, c, n) for cfg in cfgs.values() for abi, c, n, _ in cfg["chains"]}
    tier = DiskTier(path)
    for abi, c, n in chains:
        found = lookup(tier, abi, c, n)
        assert found.stop is None and len(found.refs) == n
        res = tier.read(found.refs)
        assert res.reason is None, (c, res.reason, res.detail)
        assert [mismatch(p, c, i, BLOCK) for i, p in enumerate(res.payloads)] == [None] * n

    segments = sum(s["counters"]["segments_written"] for s in out.values())
    blocks_written = sum(s["counters"]["blocks_written"] for s in out.values())
    assert blocks_written == sum(n for cfg in cfgs.values() for _, _, n, _ in cfg["chains"])
    manifests = _manifests(path)
    assert len(manifests) == segments and {m["writer"] for m in manifests} == {"w0", "w1"}
    _assert_clean(tier.verify(), blocks=blocks_written, orphans=0)  # both copies of the shared blocks verify

    st = tier.stats()
    assert st["segments"] == segments
    for abi in (ABI, ABI2):
        mine = {(c, i) for a, c, n in chains if a == abi for i in range(n)}
        assert st["abis"][abi]["blocks"] == len(mine)  # a key written by both writers counts once
        assert st["abis"][abi]["snapshots"] == sum(i % 3 == 2 for _, i in mine)
        assert st["abis"][abi]["segments"] == sum(m["abi"] == abi for m in manifests)
    # stored bytes: the manifests' sizes are the shard files' real sizes, and stats adds them up
    sizes = [os.path.getsize(os.path.join(path, "data", m["abi"], m["segment"], "c", "0")) for m in manifests]
    assert [m["stored_bytes"] for m in manifests] == sizes and st["stored_bytes"] == sum(sizes)
    # hits: every verified read either writer counted (saved per writer) plus this process's, summed by stats
    assert tier.counters["blocks_read"] == len({(c, i) for _, c, n in chains for i in range(n)})
    assert (
        sum(d["hits"] for d in st["abis"].values())
        == sum(s["counters"]["blocks_read"] for s in out.values()) + tier.counters["blocks_read"]
    )
    tier.close()


# ---------------------------------------------------------------------- 3. a reader and a writer
@pytest.mark.parametrize("budget", [None, 12 * (3 * 64 << 10)], ids=["unbounded", "evicting"])
def test_reader_never_sees_a_wrong_payload_while_another_process_writes(tmp_path, budget):
    n_chains, n_blocks, block_bytes = 50, 3, 64 << 10
    path, go, done = str(tmp_path / "store"), str(tmp_path / "go"), str(tmp_path / "done")
    DiskTier(path).close()
    writer = _spawn("stream-writer", path, n_chains, n_blocks, block_bytes, budget or "none", go)
    reader = _spawn("reader", path, n_chains, n_blocks, block_bytes, go, done)
    dogs = [_watchdog(p, 90) for p in (writer, reader)]
    for p in (writer, reader):
        _expect_line(p, "ready")
    open(go, "w").close()
    counters = _finish(writer)
    open(done, "w").close()
    rd = _finish(reader)
    for d in dogs:
        d.cancel()
    assert rd["errors"] == [], rd["errors"][0]
    assert rd["mismatches"] == [], rd["mismatches"][:5]
    assert rd["passes"] >= 2 and rd["blocks_read"] > 0
    assert set(rd["stops"]) <= {"None", "absent"}

    tier = DiskTier(path)
    alive = {f"R{c}" for c in range(n_chains) if lookup(tier, ABI, f"R{c}", n_blocks).stop is None}
    # the reader's last pass (after the writer exited) saw exactly the published chains, all verified
    assert {c for c, (refs, ok, why) in rd["final"].items() if ok == n_blocks and why is None} == alive
    assert all(v == [0, 0, None] for c, v in rd["final"].items() if c not in alive)
    if budget is None:
        assert rd["reasons"] == {}  # a published block is complete: never a rejection without deletion
        assert len(alive) == n_chains and counters["segments_evicted"] == 0
    else:
        assert set(rd["reasons"]) <= {"disk_missing"}  # evicted under the reader: missing, never corrupt
        assert counters["segments_evicted"] > 0 and len(alive) == n_chains - counters["segments_evicted"]
    _assert_clean(tier.verify(), blocks=len(alive) * n_blocks, orphans=0)
    tier.close()
    print(
        f"reader: {rd['passes']} passes, {rd['blocks_read']} blocks verified, reasons {rd['reasons']}, "
        f"saw a partial store: {rd['seen_partial']}; writer evicted {counters['segments_evicted']}"
    )


# ------------------------------------------------------- 4. verify while another host evicts
def test_verify_while_another_host_evicts_reports_no_bad_block(tmp_path, capsys):
    """`verify` (and `hkv store verify`) on a live shared store: a segment another host evicts
    (`enforce_budget` / `delete_segment`: manifest first, then data) between verify's listing and its
    read of that segment is gone, not bad: no `disk_missing`, no orphan, exit code 0; nor is a segment
    another host publishes after verify's listing an orphan. The eviction is
    placed deterministically: another tier on the same store deletes the segment just before this
    tier's verify reads it (and, for the second segment, after verify read its manifest's first
    block: the data disappears mid-segment)."""
    path = str(tmp_path / "store")
    writer = DiskTier(path, writer_id="w")
    for c in ("keep", "gone0", "gone1"):
        writer.write(ABI, [payload(c, i, 4096) for i in range(3)])
    segment = {m["blocks"][0]["key"]: m["segment"] for m in _manifests(path)}
    doomed = {segment[key(c, 0).hex()]: c for c in ("gone0", "gone1")}
    checker, evictor = DiskTier(path), DiskTier(path)  # two hosts: one verifies, one evicts
    real_read = checker.read

    def evict_first(refs, *a, **kw):
        seg = refs[0].segment if refs else None
        if seg == segment[key("keep", 0).hex()] and not writer.counters["segments_written"] > 3:
            writer.write(ABI, [payload("late", 0, 4096)])  # published after verify's listing: no orphan
        if doomed.get(seg) == "gone0":  # deleted before any of its blocks is read
            evictor.delete_segment(ABI, seg)
        elif doomed.get(seg) == "gone1" and len(refs) == 3:  # one block verified, then deleted
            out = real_read(refs[:1], *a, **kw)
            evictor.delete_segment(ABI, seg)
            rest = real_read(refs[1:], *a, **kw)
            return type(out)(out.payloads + rest.payloads, rest.reason, rest.detail)
        return real_read(refs, *a, **kw)

    checker.read = evict_first
    report = checker.verify()
    assert evictor.counters["segments_evicted"] == 2
    assert all(report[r] == 0 for r in ("disk_missing", "disk_checksum", "disk_truncated")), report["problems"]
    assert (report["segments"], report["blocks_ok"], report["orphaned_segments"]) == (1, 3, 0), report
    checker.read = real_read

    from hkv.store.cli import main

    assert main(["store", "verify", "--json", path]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert (rep["segments"], rep["blocks_ok"], rep["orphaned_segments"]) == (2, 4, 0)  # "late" listed now


if __name__ == "__main__":
    ROLES[sys.argv[1]](*sys.argv[2:])
