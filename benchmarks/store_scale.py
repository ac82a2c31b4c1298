"""Disk store at scale (issue 47, item 5): chain-lookup latency and process memory of `hkv.DiskTier`
over stores of 1K, 10K and 100K manifests, on a local `file` store and on S3 (a moto server on
127.0.0.1), showing both flat in the store's size.

Filling: a few chains are written through the tier's own write path (and read back verified); the
bulk is written directly (`bulk_fill`): per segment, a sealed manifest of one 4-block chain (small
objects, no data shards: a lookup reads pointers and manifests only) and its 4 block pointers, the
writes issued together in batches, then the usage ledger. Measuring: a fresh `DiskTier` (another
process's view: nothing cached, `refresh_seconds=0` so every lookup reads its pointers) looks up
random stored chains; p50 / p99 of one `find_chain`, and the Python heap the tier holds after the
lookups (tracemalloc, a separate pass) and the RSS growth.

    python benchmarks/store_scale.py                       # file 1K/10K/100K, s3 1K (~3 min)
    python benchmarks/store_scale.py --sizes --s3-sizes 1000 10000 100000   # S3 only (moto fills ~300 puts/s)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import random
import resource
import socket
import statistics
import sys
import tempfile
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hkv.store import coord, records
from hkv.store import manifest as mf
from hkv.store.context import manifest_key
from hkv.store.tier import BlockPayload, DiskTier

ABI = "5c" * 16
BLOCKS = 4  # blocks per segment (one chain each)
BT = 16  # tokens per block
BATCH = 4000  # writes issued at once by the bulk fill


def key(chain: int, i: int) -> bytes:
    return hashlib.blake2b(f"c{chain}-{i}".encode(), digest_size=16).digest()


def tokens(chain: int, i: int) -> list[int]:
    return [(chain * 7 + i * 13 + t) % 50000 for t in range(BT)]


def manifest_of(chain: int) -> dict:
    """A valid manifest of segment `chain`: one chain of BLOCKS blocks, one small object each."""
    blocks = []
    for i in range(BLOCKS):
        blocks.append(
            {
                "key": key(chain, i).hex(),
                "parent": key(chain, i - 1).hex() if i else "",
                "index": i,
                "length": (i + 1) * BT,
                "tokens": tokens(chain, i),
                "indexer_version": 1,
                "snapshot": i == BLOCKS - 1,
                "objects": [
                    {
                        "name": "g0.rows",
                        "dtype": "bfloat16",
                        "shape": [1, 2, 32],
                        "row_start": i * 2,
                        "offset": i * 128,
                        "nbytes": 128,
                        "crc32": 0,
                    }
                ],
            }
        )
    return {
        "abi": ABI,
        "segment": f"{chain:08x}-bulk",
        "writer": "bulk",
        "created": 1.7e9 + chain,
        "data_bytes": BLOCKS * 128,
        "stored_bytes": 4096 + 36,
        "chunk_bytes": 4096,
        "shard_bytes": 4096,
        "blocks": blocks,
    }


def bulk_fill(kv, n: int, start: int = 0) -> None:
    """Write segments start .. n-1 directly: each manifest and its blocks' pointers (see the module
    docstring), `BATCH` writes in flight at a time."""
    futs = []
    for c in range(start, n):
        doc = manifest_of(c)
        raw = mf.seal(doc)
        futs.append(kv.write(manifest_key(ABI, doc["segment"]), raw))
        for b in doc["blocks"]:
            h = records.Holder(ABI, doc["segment"], b["snapshot"], len(raw))
            futs.append(
                kv.write(records.pointer_key(b["key"]), records.seal_pointer(records.Pointer(b["key"], (h,)), None))
            )
        if len(futs) >= BATCH:
            for f in futs:
                f.result()
            futs = []
    for f in futs:
        f.result()


def set_ledger(tier: DiskTier, n: int) -> None:
    """The usage ledger of a store of `n` bulk segments (what its writers would have added)."""
    cur = coord.read_usage(tier._ctx)
    coord.reconcile_usage(tier._ctx, cur, {ABI: (n, n * (4096 + 36))})


def own_writes(tier: DiskTier) -> None:
    """A few chains through the tier's own write path, found and read back verified."""
    rng = np.random.default_rng(0)
    for c in range(4):
        blocks, parent = [], None
        for i in range(3):
            k = hashlib.blake2b(f"own{c}-{i}".encode(), digest_size=16).digest()
            rows = rng.standard_normal((2, 64)).astype(np.float32)
            blocks.append(BlockPayload(k, parent, i, (i + 1) * BT, list(range(BT)), 1, i == 2, {"g0.rows": (rows, 0)}))
            parent = k
        tier.write(ABI, blocks)
        found = tier.find_chain(ABI, [b.key for b in blocks], [b.tokens for b in blocks])
        res = tier.read(found.refs)
        assert res.reason is None and len(res.payloads) == 3, (found.stop, res.reason, res.detail)


def lookups(spec, n: int, count: int, seed: int) -> list[float]:
    """Seconds of `count` find_chain calls of random stored chains on a fresh tier."""
    tier = DiskTier(spec, refresh_seconds=0, key=b"")
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        c = rng.randrange(n)
        keys, toks = [key(c, i) for i in range(BLOCKS)], [tokens(c, i) for i in range(BLOCKS)]
        t = time.perf_counter()
        found = tier.find_chain(ABI, keys, toks)
        out.append(time.perf_counter() - t)
        assert found.stop is None and len(found.refs) == BLOCKS, (c, found.stop)
    tier.close()
    return out


def memory(spec, n: int, count: int) -> tuple[int, int, object]:
    """(Python heap bytes a fresh tier holds after `count` lookups, RSS growth in bytes, its index size)."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    tier = DiskTier(spec, refresh_seconds=0, key=b"")
    rng = random.Random(1)
    for _ in range(count):
        c = rng.randrange(n)
        tier.find_chain(ABI, [key(c, i) for i in range(BLOCKS)], [tokens(c, i) for i in range(BLOCKS)])
    held = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(base, "filename"))
    tracemalloc.stop()
    size = tier.index_size()
    tier.close()
    return held, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0, size


@contextlib.contextmanager
def moto_s3():
    """A moto S3 server on 127.0.0.1 with a bucket; yields a kvstore spec factory (fake credentials)."""
    import boto3
    from moto.server import ThreadedMotoServer

    for k, v in {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    }.items():
        os.environ[k] = v
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="hkv-bench")
    try:
        yield lambda prefix: {
            "driver": "s3",
            "bucket": "hkv-bench",
            "endpoint": endpoint,
            "aws_region": "us-east-1",
            "path": f"{prefix}/",
        }
    finally:
        server.stop()


def run(name: str, spec, sizes: list[int], count: int) -> list[str]:
    """Fill `spec` to each size in turn (growing one store) and measure; returns table rows."""
    tier = DiskTier(spec, key=b"")
    own_writes(tier)
    tier.close()
    rows, have = [], 0
    for n in sorted(sizes):
        t = time.perf_counter()
        bulk_fill(DiskTier(spec, key=b"").kv, n, have)
        have = n
        fill = time.perf_counter() - t
        tier = DiskTier(spec, key=b"")
        set_ledger(tier, n)
        tier.close()
        lat = sorted(lookups(spec, n, count, seed=n))
        held, rss, size = memory(spec, n, count)
        p50, p99 = statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        rows.append(
            f"| {name} | {n:,} | {p50 * 1e3:.2f} ms | {p99 * 1e3:.2f} ms | {held / 1e6:.2f} MB | "
            f"{rss / 1e6:.1f} MB | {size.pointers:,} / {size.segments:,} | {fill:.0f} s |"
        )
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[1000, 10000, 100000], help="file store manifests")
    ap.add_argument("--s3-sizes", type=int, nargs="*", default=[1000], help="S3 (moto) manifests")
    ap.add_argument("--lookups", type=int, default=300, help="chain lookups measured per size")
    args = ap.parse_args(argv)
    print(
        "| store | manifests | lookup p50 | lookup p99 | heap held | RSS growth | cached pointers / manifests | fill |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    if args.sizes:
        with tempfile.TemporaryDirectory() as d:
            rows += run("file", os.path.join(d, "store"), args.sizes, args.lookups)
    if args.s3_sizes:
        with moto_s3() as spec:
            rows += run("s3 (moto)", spec("scale"), args.s3_sizes, args.lookups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
