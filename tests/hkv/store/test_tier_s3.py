"""The disk tier on a real S3 API: `moto` in server mode on 127.0.0.1 (a random free port, stopped at
module teardown), the tensorstore `s3` kvstore pointed at it with an endpoint override, credentials
from the environment only (fake AWS_* variables set for the module and restored after). The same
checks as on `file`: exact bytes and dtypes, chain lookup, budget eviction, two hosts on one bucket,
`hkv store verify --spec`, an engine restoring its prefix from S3 token-exact, and the fault matrix
of test_disk.py (its damage functions applied to a local copy of the objects, written back to the
bucket) ending in the same shorter plan with the same named reason."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import uuid

import numpy as np
import pytest

pytest.importorskip("moto.server", reason="moto[server] is in the test extra: pip install -e '.[test]'")

import boto3
from moto.server import ThreadedMotoServer

import hkv
from hkv.store import manifest as mf
from hkv.store.tier import DISK_REASONS, DiskTier

from ..engine.test_disk import (
    CUT,
    FAULTS,
    NEW,
    _segment,
    assert_fault_is_a_shorter_plan,
    assert_same,
    engine,  # noqa: F401 — the fixture
    fill,
    forget_device,
    model,  # noqa: F401 — the fixture
    reference,
)
from ..engine.test_prefix import BASE, BT, diverge
from .test_cli import _count, _run
from .test_tier import ABI, assert_same_payloads, chain, segments

BUCKET = "hkv-test"
REGION = "us-east-1"
# every variable the AWS credential chain (tensorstore's and boto3's) might read: set to fakes or
# unset, so a developer's real credentials and ~/.aws are never used by these tests
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "hkv-test-key",
    "AWS_SECRET_ACCESS_KEY": "hkv-test-secret",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_REGION": REGION,
    "AWS_SESSION_TOKEN": None,
    "AWS_SECURITY_TOKEN": None,
    "AWS_PROFILE": None,
    "AWS_DEFAULT_PROFILE": None,
    "AWS_ENDPOINT_URL": None,
    "AWS_ENDPOINT_URL_S3": None,
}


@dataclasses.dataclass
class S3:
    """The moto server: its endpoint, a boto3 client, and tensorstore specs for key prefixes."""

    endpoint: str
    client: object

    def spec(self, prefix: str) -> dict:
        return {"driver": "s3", "bucket": BUCKET, "endpoint": self.endpoint, "aws_region": REGION, "path": f"{prefix}/"}

    def keys(self, prefix: str) -> list[str]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/"):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=data)

    def copy(self, src: str, dst: str) -> None:
        """Copy every object under prefix `src` to prefix `dst` (server side)."""
        for key in self.keys(src):
            new = f"{dst}/{key[len(src) + 1 :]}"
            self.client.copy_object(Bucket=BUCKET, Key=new, CopySource={"Bucket": BUCKET, "Key": key})

    @contextlib.contextmanager
    def as_directory(self, prefix: str, root):
        """The objects under `prefix` as files under `root`; on exit every file that changed is put
        back and every one removed is deleted (so test_disk.py's file-level damage applies to S3)."""
        before = {}
        for key in self.keys(prefix):
            rel = key[len(prefix) + 1 :]
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            before[rel] = self.get(key)
            (root / rel).write_bytes(before[rel])
        yield root
        after = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        for rel, data in after.items():
            if before.get(rel) != data:
                self.put(f"{prefix}/{rel}", data)
        for rel in before.keys() - after.keys():
            self.client.delete_object(Bucket=BUCKET, Key=f"{prefix}/{rel}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with bucket `BUCKET`, for this module; stopped at teardown and
    the AWS_* environment restored."""
    nowhere = tmp_path_factory.mktemp("aws") / "none"  # no ~/.aws: config and credentials files that do not exist
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {
            **AWS_ENV,
            "AWS_CONFIG_FILE": str(nowhere),
            "AWS_SHARED_CREDENTIALS_FILE": str(nowhere),
        }.items():
            if value is None:
                mp.delenv(name, raising=False)
            else:
                mp.setenv(name, value)
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request in failure reports
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
            client.create_bucket(Bucket=BUCKET)
            yield S3(endpoint, client)
        finally:
            server.stop()


@pytest.fixture
def prefix(request) -> str:
    """A key prefix of its own for each test (the bucket is shared by the module)."""
    return f"{request.node.name.split('[')[0]}-{uuid.uuid4().hex[:8]}"


def _keys(blocks):
    return [b.key for b in blocks], [b.tokens for b in blocks]


# ------------------------------------------------------------------------------- format level
def test_round_trip_on_s3_returns_the_exact_bytes_and_dtypes(s3, prefix):
    tier = DiskTier(s3.spec(prefix), shard_bytes=1 << 16, chunk_bytes=1 << 14)  # several shards per segment
    blocks = chain("a", 5)
    assert tier.write(ABI, blocks) == [b.key for b in blocks]
    tier.close()
    # the objects are really in the bucket, under the prefix, in the documented layout
    names = s3.keys(prefix)
    assert sum(n.startswith(f"{prefix}/manifests/{ABI}/") for n in names) == 1
    assert sum(f"{prefix}/data/{ABI}/" in n and "/c/" in n for n in names) >= 2
    tier = DiskTier(s3.spec(prefix))  # reopened: nothing in memory
    found = tier.find_chain(ABI, *_keys(blocks))
    assert found.stop is None and len(found.refs) == 5
    res = tier.read(found.refs)
    assert res.reason is None and len(res.payloads) == 5
    assert_same_payloads(res.payloads, blocks)
    assert tier.verify()["blocks_ok"] == 5


def test_chain_on_s3_stops_at_an_absent_block_a_collision_or_a_foreign_abi(s3, prefix):
    tier = DiskTier(s3.spec(prefix))
    blocks = chain("b", 4)
    tier.write(ABI, blocks[:2])
    keys, toks = _keys(blocks)
    got = tier.find_chain(ABI, keys, toks)
    assert (len(got.refs), got.stop) == (2, "absent")
    bad = [list(t) for t in toks]
    bad[1][0] += 1
    got = tier.find_chain(ABI, keys, bad)
    assert (len(got.refs), got.stop) == (1, "collision")
    tier.write("cd" * 16, blocks[2:])
    got = tier.find_chain(ABI, keys, toks)
    assert (len(got.refs), got.stop) == (2, "disk_abi")


def test_budget_eviction_on_s3_deletes_leaf_segments_and_their_objects(s3, prefix):
    tier = DiskTier(s3.spec(prefix))
    trunk, leaf_a, leaf_b = chain("t", 4), chain("t", 2, start=4), chain("u", 3)
    for blocks in (trunk, leaf_a, leaf_b):
        tier.write(ABI, blocks)
    sizes = {s.name: s.stored_bytes for s in segments(tier)}
    leaf_a_seg = next(s.name for s in segments(tier) if s.doc["blocks"][0]["index"] == 4)
    assert tier.read(tier.find_chain(ABI, *_keys(leaf_b)).refs).reason is None  # leaf_b hit recently
    tier.budget_bytes = sum(sizes.values()) - 1
    assert tier.enforce_budget() == 1
    left = tier.find_chain(ABI, *_keys(trunk + leaf_a))
    assert len(left.refs) == 4 and left.stop == "absent"  # the trunk survives its leaf
    # nothing of the evicted segment is left in the bucket: its manifest and every data object
    assert not [k for k in s3.keys(prefix) if leaf_a_seg in k]
    report = DiskTier(s3.spec(prefix)).verify()
    assert (report["segments"], report["blocks_ok"], report["orphaned_segments"]) == (2, 7, 0)


def test_two_hosts_on_one_bucket_see_each_others_segments(s3, prefix):
    """Two tiers (two hosts) on the same bucket prefix: each finds and reads what the other wrote."""
    one = DiskTier(s3.spec(prefix), writer_id="host-1", refresh_seconds=0)
    two = DiskTier(s3.spec(prefix), writer_id="host-2", refresh_seconds=0)
    a, b = chain("h1", 3), chain("h2", 2)
    one.write(ABI, a)
    two.write(ABI, b)
    for tier, blocks in ((two, a), (one, b)):
        res = tier.read(tier.find_chain(ABI, *_keys(blocks)).refs)
        assert res.reason is None and len(res.payloads) == len(blocks)
        for got, want in zip(res.payloads, blocks, strict=True):
            want_rows = want.objects["g0.rows"][0]
            assert np.array_equal(got.objects["g0.rows"][0].view(np.uint8), want_rows.view(np.uint8))
    one.close()
    two.close()
    st = DiskTier(s3.spec(prefix)).stats()
    assert st["segments"] == 2 and st["abis"][ABI]["blocks"] == 5 and st["abis"][ABI]["hits"] == 5


def test_cli_verifies_an_s3_store_given_as_a_spec(s3, prefix, tmp_path, capsys):
    tier = DiskTier(s3.spec(prefix))
    tier.write(ABI, chain("v", 3))
    tier.write(ABI, chain("w", 2))
    tier.close()
    spec = json.dumps(s3.spec(prefix))
    code, out, _ = _run(capsys, "store", "verify", "--spec", spec)
    assert code == 0 and _count(out, "blocks ok") == 5 and _count(out, "published segments") == 2
    with s3.as_directory(prefix, tmp_path) as root:  # a flipped byte in chain v's only data shard
        (seg,) = [
            json.loads(p.read_bytes())["segment"]
            for p in (root / "manifests" / ABI).iterdir()
            if len(json.loads(p.read_bytes())["blocks"]) == 3
        ]
        shard = root / "data" / ABI / seg / "c" / "0"
        raw = bytearray(shard.read_bytes())
        raw[10] ^= 0x40
        shard.write_bytes(bytes(raw))
    code, out, _ = _run(capsys, "store", "verify", "--json", "--spec", spec)
    report = json.loads(out)
    # as on file (test_cli.py): each of the shard's 3 blocks is one disk_checksum, chain w is intact
    assert code == 1 and report["disk_checksum"] == 3 and report["blocks_ok"] == 2
    code, out, _ = _run(capsys, "store", "stats", "--json", "--spec", spec)
    assert code == 0 and json.loads(out)["segments"] == 2


# ------------------------------------------------------------------------------- engine level
def forget(eng) -> None:
    """`forget_device`, and forget the measured seconds per token from disk: moto is a Python HTTP
    server on a shared CPU, slower per token than this tiny model's prefill, so after one timed S3
    restore the engine would (rightly) recompute instead (its plan then says why the device could not
    restore: `freed`). These tests check what a restore from S3 yields, so each starts as an engine
    that has not timed one (disk assumed 10x cheaper per token than prefill)."""
    forget_device(eng)
    eng.prefix_manager.costs.disk_token = None


@pytest.fixture(scope="module")
def stored_s3(engine, s3):  # noqa: F811 — the fixture imported from test_disk
    """BASE's blocks stored on S3 by the engine (two segments: [0, CUT) and the rest)."""
    fill(engine, DiskTier(s3.spec("stored")))
    return "stored"


def test_engine_restores_its_prefix_from_s3_token_exact(model, engine, s3, stored_s3, tmp_path, capsys):  # noqa: F811
    """The engine stored its prefix on S3 and forgot it on device; a fresh tier (a restarted server)
    restores it from S3 with tokens exactly equal to the stateless reference; `hkv store verify`
    passes on the same spec."""
    engine.disk = DiskTier(s3.spec(stored_s3))
    ks = (1, CUT // BT + 2, len(BASE) // BT)
    prompts = [diverge(k * BT, tail=3, seed=k) for k in ks]
    gens = []
    for k, prompt in zip(ks, prompts, strict=True):
        forget(engine)
        (g,) = engine.generate([prompt], NEW, return_logits=True)
        assert g.plan.restored_tokens == g.plan.hash_hit_tokens == k * BT, (k, g.plan)
        assert g.plan.disk_tokens == (0, k * BT)
        gens.append(g)
    assert_same(gens, reference(model, prompts))
    assert engine.stats()["cache"]["prefix_disk_restored_tokens"] >= sum(ks) * BT
    hkv.check_invariants(engine.layout, engine.cache)
    code, out, _ = _run(capsys, "store", "verify", "--json", "--spec", json.dumps(s3.spec(stored_s3)))
    assert code == 0 and json.loads(out)["blocks_ok"] == len(BASE) // BT


# S3 has no symlinks: every other fault of the file matrix applies to objects as it does to files
S3_FAULTS = [f for f in FAULTS if "symlink" not in f]


@pytest.mark.parametrize("fault", S3_FAULTS)
def test_fault_on_s3_gives_shorter_plan_with_reason_and_exact_output(
    model,  # noqa: F811
    engine,  # noqa: F811
    s3,
    stored_s3,
    prefix,
    tmp_path,
    fault,
):
    """test_disk.py's fault matrix on S3: the same damage (through get_object / put_object /
    delete_object) gives the same shorter plan, the same named reason and exact output."""
    s3.copy(stored_s3, prefix)
    engine.disk = DiskTier(s3.spec(prefix))  # indexes both segments before the fault
    forget(engine)
    damage, reason = FAULTS[fault]
    with s3.as_directory(prefix, tmp_path / "copy") as root:
        abi, seg = _segment(root, CUT // BT)
        damage(root, abi, seg)
    assert_fault_is_a_shorter_plan(model, engine, reason, s3.spec(prefix), hidden="pointer" in fault)


class _Racing:
    """The tier's kvstore, except that right after the size probe of `key` (a 1-byte read at the cap)
    the object is replaced by `grown` (another writer, between the probe and the read); records the
    size of every value read."""

    def __init__(self, kv, s3, key: str, grown: bytes):
        self._kv, self._s3, self._key, self._grown, self.sizes = kv, s3, key, grown, []

    def __getattr__(self, name):
        return getattr(self._kv, name)

    def read(self, key, *args, byte_range=None, **kw):
        fut = self._kv.read(key, *args, byte_range=byte_range, **kw)
        racing = (
            key == self._key.split("/", 1)[1] and byte_range is not None and byte_range.start == mf.MAX_MANIFEST_BYTES
        )
        if racing:
            fut.exception()  # waits until the probe has its answer (OUT_OF_RANGE: smaller than the cap)
            self._s3.put(self._key, self._grown)
        return _Sized(fut, self.sizes)


class _Sized:
    def __init__(self, fut, sizes):
        self._fut, self._sizes = fut, sizes

    def result(self):
        r = self._fut.result()
        if r.state == "value":
            self._sizes.append(len(r.value))
        return r


def test_a_manifest_that_grows_after_its_size_probe_is_never_read_whole_on_s3(s3, prefix):
    """S3 answers the size probe (a 1-byte read at the 16 MiB cap) with HTTP 416 and the object's size
    in the body, not in tensorstore's "value of size N" wording: the read after it must still be
    bounded, so a manifest replaced by a huge object between the two requests is never loaded whole
    (regression: the tier fell back to an unbounded read of the whole object on S3)."""
    writer = DiskTier(s3.spec(prefix))
    writer.write(ABI, chain("g", 2))
    tier = DiskTier(s3.spec(prefix), refresh_seconds=3600)
    writer.write(ABI, chain("h", 2))  # a second segment
    (key,) = [
        k
        for k in s3.keys(f"{prefix}/manifests")
        if json.loads(s3.get(k))["blocks"][0]["key"] == chain("h", 2)[0].key.hex()
    ]
    racing = _Racing(tier.kv, s3, key, b" " * (mf.MAX_MANIFEST_BYTES + (1 << 20)))
    tier.kv = racing
    bad = tier.stats()["bad_files"]  # the listing reads every manifest, bounded
    assert racing.sizes and max(racing.sizes) <= mf.MAX_MANIFEST_BYTES
    assert sum(bad.values()) == 1 and set(bad) <= set(DISK_REASONS)  # one bad segment, with its reason
    tier.kv = racing._kv
    g = chain("g", 2)
    res = tier.read(tier.find_chain(ABI, *_keys(g)).refs)
    assert res.reason is None and len(res.payloads) == 2  # every other segment is still restored


class _Sizeless(_Racing):
    """An S3-compatible store whose HTTP 416 body does not state the object's size (the probe's
    OUT_OF_RANGE says only that the range is not satisfiable)."""

    def read(self, key, *args, byte_range=None, **kw):
        if byte_range is not None and byte_range.start == mf.MAX_MANIFEST_BYTES:
            return _Fails(ValueError("OUT_OF_RANGE: InvalidRange: The requested range is not satisfiable"))
        return super().read(key, *args, byte_range=byte_range, **kw)


class _Fails:
    def __init__(self, e):
        self._e = e

    def result(self):
        raise self._e


def test_a_store_that_does_not_state_sizes_still_indexes_its_manifests_reading_at_most_the_cap(s3, prefix):
    writer = DiskTier(s3.spec(prefix))
    writer.write(ABI, chain("s", 2))
    writer.write(ABI, chain("z", 3))
    tier = DiskTier(s3.spec(prefix), refresh_seconds=3600)
    sizeless = _Sizeless(tier.kv, s3, "-/never", b"")
    tier.kv = sizeless
    st = tier.stats()  # the listing reads every manifest, bounded
    assert st["segments"] == 2 and not st["bad_files"]
    assert sizeless.sizes and max(sizeless.sizes) <= mf.MAX_MANIFEST_BYTES
    tier.kv = sizeless._kv  # the manifests were indexed through it; the data is read as usual
    for name, n in (("s", 2), ("z", 3)):
        res = tier.read(tier.find_chain(ABI, *_keys(chain(name, n))).refs)
        assert res.reason is None and len(res.payloads) == n
