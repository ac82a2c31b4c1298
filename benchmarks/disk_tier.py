"""The disk tier (`hkv.DiskTier`): store/restore throughput against plain file I/O of the same bytes,
and time to restore a prefix from disk against recomputing it.

    python benchmarks/disk_tier.py            # default: 256 MiB x 5 repeats, then 2K/4K/8K tokens (~2 min)
    python benchmarks/disk_tier.py --quick    # smoke run (small sizes, < 60 s)
    python benchmarks/disk_tier.py --sweep    # + chunk_bytes / tensorstore concurrency sweep (file store, ~1 min more)

Part 1 (I/O). Payloads with DeepSeek-V4-Flash shapes (`DeepseekV4Config()`, bf16, 64-token blocks):
a block is 400-423 KiB (CSA rows 20x16x512, indexer rows 20x16x128, and every other block one HCA
row per HCA layer, 23x1x512); the last block of a chain also carries the SWA window (43 layers x
127 rows x 512) and the TAIL snapshots (11.9 MiB). One *segment* = one cached conversation of
`--segment-tokens` tokens (8192: 128 blocks + the snapshot at its end, 65 MB), written as one
`DiskTier.write_async` like the engine's write-behind batch. Compared, on the same bytes in the
same run:
  raw     one file per segment, every object array written in order (no copy), fsync, close;
          read back with one read() per file.
  file    `DiskTier(dir)`: every segment queued with `write_async` as the engine's write-behind
          does, timed until the last manifest is published (zarr3 shards of 16 MiB with crc32c
          chunks, written and fsynced by tensorstore's file kvstore while the next shard is
          copied, + JSON manifest); restore = `find_chain` + `read` with the engine's dtype/shape
          expectations (crc32c + per-object crc32 checked).
  ocdbt   the same through `{"driver": "ocdbt", "base": "file://dir/"}`.
Each repeat writes every store into a fresh directory (raw, file, ocdbt interleaved, each first in
turn, so machine load hits them alike; memory prefaulted before each, see `prefault`), reads them
back from a warm page cache, then drops this VM's page cache for the stores' files
(`posix_fadvise(DONTNEED)`, no root needed) and reads them again ("cold": the guest's page cache
is empty; the virtual disk's host may still cache). Figures: MB/s median and best over
the repeats; "x raw" = median over the repeats of raw time / hkv time in the same repeat; CPU = MB
per CPU-second of the process (all threads), which other processes' load disturbs less than wall
time. "Where the time goes" re-runs DiskTier's write and read steps one by one on one segment.

Part 2 (engine). The tiny DeepSeek-V4 (random weights, seed 0, float32; rope range raised to 16K so
8K prompts are valid): an engine with a DiskTier and a prefix index sized for an 8K history
generates once on an 8K-token prompt (its TTFT is a cold recompute), `write_through()` +
`flush_disk()`, then every device record is evicted. For K in --tokens, the prompt is the first K
tokens + 1 new token: it restores [0, K) from disk (the plan's `disk_tokens` must be (0, K)) and
computes one token. Each K runs once to compile (`swap_in` compiles per row bucket), then
`--repeats` times warm (page cache) and `--repeats` times cold (page cache dropped), each after
evicting every device record again; then once more without evicting (a device hit, for
comparison). Recompute: an engine without a prefix cache, same chunk, compiled first, on the same
prompts; its first token must equal the restored engine's. TTFT is the engine's own
(`stats()["ttft_seconds"]`: admission to first logits); "disk read" is the time inside
`DiskTier.read` (read + verification) during the restore.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import _machine  # benchmarks/_machine.py (the script's folder is on sys.path)
import numpy as np

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def drop_page_cache(path: str) -> int:
    """posix_fadvise(DONTNEED) on every file under path (clean pages leave this VM's page cache)."""
    n = 0
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def prefault(gib: float, quiet: bool = False) -> None:
    """Touch `gib` GiB of anonymous memory once and free it. On a VM whose host takes back the
    memory the guest frees (free page reporting, as on this one), the first touch of such a page
    costs a host fault: a writer that needs fresh page-cache or buffer pages then runs several
    times slower (measured here: 64 MiB writes + fsync fell from ~1.7 GB/s to ~0.35 GB/s after
    ~1 GiB, plain Python file I/O included), and whichever writer meets those pages first loses,
    raw or hkv. Touching the memory first makes every measured writer meet backed pages: once
    before part 1 (`--prefault-gib`, reported), and 1 GiB again right before each timed write (the
    kernel hands out the pages freed last first)."""
    if gib <= 0:
        return
    t = time.perf_counter()
    a = np.ones((int(gib * 2**30),), np.uint8)
    a[::4096] = 2
    del a
    if not quiet:
        say(
            f"prefaulted {gib:g} GiB of memory in {time.perf_counter() - t:.2f} s "
            f"({gib * 2**30 / (time.perf_counter() - t) / 1e9:.1f} GB/s first touch)"
        )


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def med(xs):
    return statistics.median(xs)


def timed(fn, *a) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, every thread) of fn(*a)."""
    w, c = time.perf_counter(), time.process_time()
    fn(*a)
    return time.perf_counter() - w, time.process_time() - c


# ================================================================================ part 1: I/O
def flash_layout(block_tokens: int, tokens: int):
    from hkv import CacheConfig, CacheLayout
    from models.deepseek_v4 import DeepseekV4Config
    from models.deepseek_v4.cache_spec import cache_spec

    spec = cache_spec(DeepseekV4Config(), dtype="bfloat16", block_tokens=block_tokens, model_id="deepseek-v4-flash")
    return CacheLayout(spec, CacheConfig(slots=1, max_context=tokens, page_size=64, prefix_records=0))


def make_segments(layout, n_segments: int, blocks: int, rng) -> list:
    """n_segments chains of `blocks` blocks (random bytes), the last block of each with its snapshot."""
    from hkv.engine import offload as swap
    from hkv.store.tier import BlockPayload

    bt = layout.spec.block_tokens
    segs = []
    for _ in range(n_segments):
        chain, parent = [], None
        for i in range(blocks):
            snap = i == blocks - 1
            objs = {}
            for name, (dt, shape) in swap.expected_objects(layout, (i + 1) * bt, snap).items():
                dt = np.dtype(dt)
                n = int(np.prod(shape)) * dt.itemsize
                objs[name] = (np.frombuffer(rng.bytes(n), np.uint8).view(dt).reshape(shape), 0)
            key = rng.bytes(16)
            chain.append(
                BlockPayload(key, parent, i, (i + 1) * bt, rng.integers(0, 1 << 17, bt).tolist(), 0, snap, objs)
            )
            parent = key
        segs.append(chain)
    return segs


def raw_write(path: str, segs) -> None:
    os.makedirs(path)
    for i, chain in enumerate(segs):
        with open(os.path.join(path, f"segment{i}.bin"), "wb") as f:
            for b in chain:
                for a, _ in b.objects.values():
                    f.write(memoryview(a.view(np.uint8).reshape(-1)))
            f.flush()
            os.fsync(f.fileno())


def raw_read(path: str, segs) -> int:
    n = 0
    for i in range(len(segs)):
        with open(os.path.join(path, f"segment{i}.bin"), "rb") as f:
            n += len(f.read())
    return n


def store_spec(kind: str, path: str):
    return path if kind == "file" else {"driver": "ocdbt", "base": f"file://{path}/"}


def open_tier(kind: str, path: str, chunk_bytes: int, context: dict | None, shard_bytes: int = 1 << 24):
    import tensorstore as ts

    from hkv.store.tier import DiskTier

    return DiskTier(
        store_spec(kind, path),
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        context=ts.Context(context) if context else None,
    )


def tier_restore(tier, layout, segs, check: bool = False) -> None:
    from hkv.engine import offload as swap

    abi = layout.spec.fingerprint()
    expect = lambda ref: swap.expected_objects(layout, ref.length, ref.snapshot)
    for chain in segs:
        found = tier.find_chain(abi, [b.key for b in chain], [b.tokens for b in chain])
        res = tier.read(found.refs, expect=expect)
        if res.reason is not None or len(res.payloads) != len(chain):
            raise SystemExit(f"restore failed: {len(res.payloads)}/{len(chain)} blocks, {res.reason}: {res.detail}")
        if check:
            for want, got in zip(chain, res.payloads, strict=True):
                for name, (a, _) in want.objects.items():
                    if not np.array_equal(a.view(np.uint8), got.objects[name][0].view(np.uint8)):
                        raise SystemExit(f"restored bytes differ: block {want.index} object {name}")


def io_benchmark(args, root: str) -> dict:
    layout = flash_layout(args.block_tokens, args.segment_tokens)
    blocks = args.segment_tokens // args.block_tokens
    rng = np.random.default_rng(0)
    one = make_segments(layout, 1, blocks, rng)
    seg_bytes = sum(a.nbytes for b in one[0] for a, _ in b.objects.values())
    n_seg = max(1, round(args.mib * 2**20 / seg_bytes))
    segs = one + make_segments(layout, n_seg - 1, blocks, rng)
    total = n_seg * seg_bytes
    plain = sum(a.nbytes for b in one[0] for n, (a, _) in b.objects.items() if n.endswith(".rows")) / blocks
    snap = seg_bytes - plain * blocks
    say(
        f"part 1: {n_seg} segments x {blocks} blocks of {args.block_tokens} tokens (DeepSeek-V4-Flash, bf16: "
        f"{plain / 1024:.0f} KiB per block on average, + {snap / 2**20:.1f} MiB SWA window + TAIL on "
        f"the last) = {total / 2**20:.1f} MiB; chunk_bytes {args.chunk_bytes}; {args.io_repeats} repeats"
    )
    kinds = ["raw", "file"] + (["ocdbt"] if not args.no_ocdbt else [])
    res = {k: {"write": [], "warm": [], "cold": []} for k in kinds}  # (wall s, CPU s) per repeat
    stored = {}
    abi = layout.spec.fingerprint()
    for rep in range(args.io_repeats):
        d = tempfile.mkdtemp(prefix=f"rep{rep}-", dir=root)
        tiers = {}
        try:
            for k in kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]:  # each kind goes first in turn
                p = os.path.join(d, k)
                prefault(min(1, args.prefault_gib), quiet=True)
                if k == "raw":
                    w, c = timed(raw_write, p, segs)
                else:
                    tiers[k] = open_tier(k, p, args.chunk_bytes, None, args.shard_bytes)
                    # queued as the engine's write-behind does; timed until the last manifest is published
                    w, c = timed(lambda t: [f.result() for f in [t.write_async(abi, ch) for ch in segs]], tiers[k])
                res[k]["write"].append((w, c))
                stored[k] = dir_bytes(p)
                say(
                    f"  repeat {rep + 1}/{args.io_repeats}: {k:<5} write        {total / w / 1e6:6.0f} MB/s "
                    f"({w:.2f} s, CPU {c:.2f} s)"
                )
            for phase in ("warm", "cold"):
                if phase == "cold":
                    drop_page_cache(d)
                for k in kinds:
                    if k == "raw":
                        w, c = timed(raw_read, os.path.join(d, k), segs)
                    else:
                        w, c = timed(tier_restore, tiers[k], layout, segs)
                    res[k][phase].append((w, c))
                    say(
                        f"  repeat {rep + 1}/{args.io_repeats}: {k:<5} read ({phase}) {total / w / 1e6:6.0f} MB/s "
                        f"({w:.2f} s, CPU {c:.2f} s)"
                    )
            if rep == 0:  # untimed: the restored bytes are the written bytes
                for k in tiers:
                    tier_restore(tiers[k], layout, segs, check=True)
                say("  restored bytes checked equal to the written bytes (" + ", ".join(tiers) + ")")
        finally:
            for t in tiers.values():
                t.close()
            shutil.rmtree(d, ignore_errors=True)
    return {
        "res": res,
        "total": total,
        "stored": stored,
        "segments": n_seg,
        "blocks": blocks,
        "block_bytes": plain,
        "segment_bytes": seg_bytes,
    }


def print_io(args, io: dict) -> dict:
    res, total = io["res"], io["total"]
    print(
        f"\n== part 1: store / restore throughput, {total / 2**20:.1f} MiB in {io['segments']} segments of "
        f"{io['segment_bytes'] / 1e6:.1f} MB; MB/s median (best) of {args.io_repeats} repeats; x raw = median over "
        f"the repeats of hkv MB/s / raw MB/s in the same repeat; CPU = MB per CPU-second of the process (all threads)"
    )
    print(
        f"{'':<6}{'write + fsync':>36}{'read, warm page cache':>36}{'read, page cache dropped':>36}"
        f"{'stored/payload':>16}"
    )
    ratios = {}
    for k, r in res.items():
        cells = []
        for phase in ("write", "warm", "cold"):
            walls = [w for w, _ in r[phase]]
            m, b = total / med(walls), total / min(walls)
            cpu = total / med([c for _, c in r[phase]])
            ratio = med([rw / w for (rw, _), (w, _) in zip(res["raw"][phase], r[phase], strict=True)])
            ratios[(k, phase)] = ratio
            cells.append(
                f"{m / 1e6:5.0f} ({b / 1e6:5.0f}) "
                + (f"{ratio:4.2f}x " if k != "raw" else " " * 6)
                + f"CPU {cpu / 1e6:5.0f}"
            )
        print(f"{k:<6}" + "".join(f"{c:>36}" for c in cells) + f"{io['stored'][k] / total:>15.3f}x")
    for k in res:
        if k == "raw":
            continue
        w, warm, cold = ratios[(k, "write")], ratios[(k, "warm")], ratios[(k, "cold")]
        rd = (
            "met"
            if min(warm, cold) >= 0.4
            else "met cold only"
            if cold >= 0.4
            else "met warm only"
            if warm >= 0.4
            else "NOT met"
        )
        print(
            f"{k}: writes {w:.2f}x raw [target >= 0.7x: {'met' if w >= 0.7 else 'NOT met'}]; reads {warm:.2f}x "
            f"(warm) / {cold:.2f}x (page cache dropped) raw [target >= 0.4x: {rd}]"
        )
    return {f"{k}_{p}": v for (k, p), v in ratios.items()}


def sweep(args, root: str) -> None:
    """chunk_bytes x tensorstore concurrency on the file store, against raw I/O measured right before
    each (ratios per repeat, then their median); the configurations take turns within each repeat."""
    layout = flash_layout(args.block_tokens, args.segment_tokens)
    blocks = args.segment_tokens // args.block_tokens
    rng = np.random.default_rng(1)
    seg_bytes = sum(a.nbytes for b in make_segments(layout, 1, blocks, rng)[0] for a, _ in b.objects.values())
    n_seg = max(1, round(args.sweep_mib * 2**20 / seg_bytes))
    segs = make_segments(layout, n_seg, blocks, rng)
    total = n_seg * seg_bytes
    abi = layout.spec.fingerprint()
    configs = [(c, None) for c in (1 << 16, 1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22)]
    for n in (1, 4, 32):
        configs.append((1 << 19, {"file_io_concurrency": {"limit": n}, "data_copy_concurrency": {"limit": n}}))
    configs.append((1 << 19, {"cache_pool": {"total_bytes_limit": 256 << 20}}))
    say(
        f"sweep: {total / 2**20:.0f} MiB ({n_seg} segments), {len(configs)} configurations x {args.sweep_repeats} "
        f"repeats (file store; raw measured right before each)"
    )
    acc = [{} for _ in configs]

    def write_all(tier):
        for chain in segs:
            tier.write(abi, chain)

    for rep in range(args.sweep_repeats):
        for i, (chunk, ctx) in enumerate(configs):
            d = tempfile.mkdtemp(prefix="sweep-", dir=root)
            a = acc[i]
            try:
                raw_p = os.path.join(d, "raw")
                rw, _ = timed(raw_write, raw_p, segs)
                tier = open_tier("file", os.path.join(d, "file"), chunk, ctx)
                hw, hc = timed(write_all, tier)
                a.setdefault("w", []).append((total / hw, rw / hw, total / hc))
                tier.close()  # read through a new tier (new context): no chunk cached while writing
                tier = open_tier("file", os.path.join(d, "file"), chunk, ctx)
                for phase in ("warm", "cold"):
                    if phase == "cold":
                        drop_page_cache(d)
                        tier.close()  # and a new tier: nothing the warm read cached (cache_pool) is reused
                        tier = open_tier("file", os.path.join(d, "file"), chunk, ctx)
                    rr, _ = timed(raw_read, raw_p, segs)
                    if phase == "cold":
                        drop_page_cache(d)
                    hr, hc = timed(tier_restore, tier, layout, segs)
                    a.setdefault(phase, []).append((total / hr, rr / hr, total / hc))
                tier.close()
            finally:
                shutil.rmtree(d, ignore_errors=True)
        say(f"  sweep repeat {rep + 1}/{args.sweep_repeats} done")
    print(
        f"\n== sweep (file store): median over {args.sweep_repeats} repeats of MB/s, hkv/raw ratio (paired per "
        f"repeat) and MB per CPU-second of the process"
    )
    for (chunk, ctx), a in zip(configs, acc, strict=True):
        cells = []
        for phase, label in (("w", "write"), ("warm", "read warm"), ("cold", "read cold")):
            v = a[phase]
            cells.append(
                f"{label} {med([x[0] for x in v]) / 1e6:5.0f} MB/s {med([x[1] for x in v]):4.2f}x "
                f"({med([x[2] for x in v]) / 1e6:4.0f}/CPU-s)"
            )
        print(f"  chunk {chunk >> 10:>5} KiB {json.dumps(ctx) if ctx else 'default context':<84} " + "; ".join(cells))


def breakdown(args, root: str) -> tuple[int, dict]:
    """Where DiskTier's write and read time goes: its steps re-run one by one (with hkv.store.layout's helpers,
    same arguments) on one segment, against raw I/O of the same bytes; wall and CPU."""
    import zlib

    import tensorstore as ts

    from hkv.store import layout as hl
    from hkv.store import tier as hd

    layout = flash_layout(args.block_tokens, args.segment_tokens)
    segs = make_segments(layout, 1, args.segment_tokens // args.block_tokens, np.random.default_rng(2))
    objs = [a for b in segs[0] for a, _ in b.objects.values()]
    total = sum(a.nbytes for a in objs)
    abi = layout.spec.fingerprint()
    acc: dict[str, list[tuple[float, float]]] = {}
    say(
        f"breakdown: DiskTier's write and read steps one by one on one {total / 1e6:.0f} MB segment, "
        f"{args.sweep_repeats} repeats"
    )

    class Step:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            self.w, self.c = time.perf_counter(), time.process_time()

        def __exit__(self, *exc):
            acc.setdefault(self.name, []).append((time.perf_counter() - self.w, time.process_time() - self.c))

    for _ in range(args.sweep_repeats):
        d = tempfile.mkdtemp(prefix="breakdown-", dir=root)
        try:
            with Step("write: raw (write + fsync)"):
                raw_write(os.path.join(d, "raw"), segs)
            lay = hl.Layout.plan(sum(-(-a.nbytes // 64) * 64 for a in objs), args.chunk_bytes, args.shard_bytes)
            parts, off = [], 0
            for a in objs:
                parts.append((off, a.reshape(-1).view(np.uint8)))
                off += -(-a.nbytes // 64) * 64
            buf = np.empty((lay.padded,), np.uint8)
            buf[:] = 0  # faulted in (DiskTier reuses its staging buffer)
            with Step("write: hkv 1/3 objects copied into the staging buffer"):
                for o, src in parts:
                    buf[o : o + src.size] = src
            with Step("write: hkv 2/3 crc32 per object"):
                crcs = [zlib.crc32(buf[o : o + src.size]) for o, src in parts]
            kv = ts.KvStore.open({"driver": "file", "path": os.path.join(d, "ts") + "/"}).result()
            with Step("write: hkv 3/3 tensorstore: every shard written + committed, one after another"):
                arr = ts.open(
                    hl.array_spec(kv / "serial/", lay.padded, lay.chunk, lay.shard), open=True, assume_metadata=True
                ).result()
                for lo, hi in lay.shards:
                    arr[lo:hi].write(buf[lo:hi]).result()
            with Step("  (3/3 with every shard write issued at once)"):
                arr = ts.open(
                    hl.array_spec(kv / "concurrent/", lay.padded, lay.chunk, lay.shard),
                    open=True,
                    assume_metadata=True,
                ).result()
                for f in [arr[lo:hi].write(buf[lo:hi]) for lo, hi in lay.shards]:
                    f.result()
            with Step("  (3/3 as one shard in one transaction: DiskTier before the pipeline)"):
                one = hl.Layout.plan(lay.padded, args.chunk_bytes, lay.padded)
                txn = ts.Transaction()
                arr = ts.open(
                    hl.array_spec(kv / "txn/", one.padded, one.chunk, one.shard),
                    open=True,
                    assume_metadata=True,
                    transaction=txn,
                ).result()
                arr[...] = buf
                txn.commit_async().result()
            flat = buf.tobytes()
            with Step("  (the padded bytes as one kvstore value: the file kvstore's floor)"):
                kv.write("flat/segment", flat).result()
            del flat
            tier = hd.DiskTier(os.path.join(d, "tier"), chunk_bytes=args.chunk_bytes, shard_bytes=args.shard_bytes)
            tier.write(abi, segs[0])  # untimed: the writer thread started, its staging buffer faulted in
            with Step("write: DiskTier.write (3/3 issued shard by shard as 1/3 copies; 2/3 during 3/3)"):
                tier.write(abi, segs[0])
            tier.close()
            drop_page_cache(d)
            with Step("read (page cache dropped): raw"):
                raw_read(os.path.join(d, "raw"), segs)
            arr = ts.open(
                hl.array_spec(kv / "serial/", lay.padded, lay.chunk, lay.shard), open=True, assume_metadata=True
            ).result()
            drop_page_cache(d)
            with Step("read (page cache dropped): hkv, one zarr3 read per object"):
                got = [f.result() for f in [arr[o : o + src.size].read() for o, src in parts]]  # as DiskTier.read
            with Step("  + zlib.crc32 per object (DiskTier.read checks both)"):
                ok = [zlib.crc32(g) for g in got] == crcs
            drop_page_cache(d)
            with Step("  (the padded bytes as one kvstore value)"):
                kv.read("flat/segment").result()
            drop_page_cache(d)
            with Step("read (page cache dropped): hkv, whole array in one zarr3 read"):
                whole = arr.read().result()
            ok &= [zlib.crc32(whole[o : o + src.size]) for o, src in parts] == crcs
            if not ok:
                raise SystemExit("breakdown: crc mismatch")
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return total, acc


def print_breakdown(args, total: int, acc: dict) -> None:
    print(
        f"\nwhere the time goes: DiskTier's steps re-run one by one on one {total / 1e6:.0f} MB segment (chunk_bytes "
        f"{args.chunk_bytes}); median of {args.sweep_repeats}: wall, throughput, CPU seconds (all threads)"
    )
    for k, v in acc.items():
        w, c = med([x[0] for x in v]), med([x[1] for x in v])
        print(f"  {k:<72} {w:6.3f} s {total / w / 1e6:6.0f} MB/s   CPU {c:6.3f} s")


# ============================================================================= part 2: engine
def engine_benchmark(args, root: str) -> dict:
    import jax.numpy as jnp

    import hkv
    from hkv.core.layout import CacheLayout
    from hkv.store.tier import DiskTier
    from models.deepseek_v4 import init, tiny_config

    class TimedTier(DiskTier):
        """DiskTier that times its reads (read + verification) for the report."""

        read_seconds = 0.0

        def read(self, *a, **kw):
            t = time.perf_counter()
            try:
                return super().read(*a, **kw)
            finally:
                TimedTier.read_seconds += time.perf_counter() - t

    bt, chunk = args.engine_block_tokens, args.prefill_chunk
    ks = sorted(args.tokens)
    kmax = ks[-1]
    if any(k % chunk for k in ks):
        raise SystemExit(f"--tokens {ks} must be multiples of --prefill-chunk {chunk} (snapshots sit at chunk ends)")
    cfg = tiny_config(max_position_embeddings=max(4096, 2 * kmax))
    model = init(cfg, seed=0)
    mc = kmax + chunk
    spec = model.cache_spec(block_tokens=bt, model_id="tiny-seed0")
    base_cfg = hkv.CacheConfig(slots=1, max_context=mc, page_size=16, prefix_records=0)
    base = CacheLayout(spec, base_cfg)
    snaps = mc // chunk + 8
    pools = []
    for g, grp in enumerate(base.groups):
        if grp.kind == hkv.ObjectKind.SWA:  # one snapshot's window spans at most 2 pages
            pools.append(base.pool_pages(g) + 2 * snaps)
        else:  # the cached history + a slot restoring it
            pools.append(2 * base.pool_pages(g) + 8)
    records = mc // bt + 16
    config = hkv.CacheConfig(
        slots=1, max_context=mc, page_size=16, pool_pages=tuple(pools), prefix_records=records, tail_snapshots=snaps
    )
    store = os.path.join(root, "engine-store")
    tier = TimedTier(store)
    engine = hkv.Engine(model, config, block_tokens=bt, prefill_chunk=chunk, model_id="tiny-seed0", disk=tier)
    cold = hkv.Engine(
        model,
        hkv.CacheConfig(slots=1, max_context=mc, page_size=16, prefix_records=0),
        block_tokens=bt,
        prefill_chunk=chunk,
        model_id="tiny-seed0",
    )
    say(
        f"part 2: tiny DeepSeek-V4 (layers {list(cfg.layer_types)}, window {cfg.sliding_window}, CSA m="
        f"{cfg.compress_rate_csa}, HCA m={cfg.compress_rate_hca}, hidden {cfg.hidden_size}), float32, seed 0; "
        f"block_tokens {bt}, prefill_chunk {chunk}; {config}"
    )
    every = jnp.ones((records,), bool)

    def forget():
        engine.cache = engine.steps.evict(engine.layout, engine.cache, every, every, every)

    rng = np.random.default_rng(7)
    base_prompt = rng.integers(0, cfg.vocab_size, kmax).tolist()
    news = {
        k: int((base_prompt[k] + 1) % cfg.vocab_size) if k < kmax else int(rng.integers(cfg.vocab_size)) for k in ks
    }
    prompts = {k: base_prompt[:k] + [news[k]] for k in ks}

    t = time.perf_counter()
    wp = rng.integers(0, cfg.vocab_size, 2 * chunk + 3).tolist()
    engine.generate([wp], 1, return_logits=True)
    forget()
    cold.generate([wp], 1, return_logits=True)
    say(f"warm-up (compile prefill, record, restore, evict on both engines): {time.perf_counter() - t:.1f} s")

    t = time.perf_counter()
    engine.generate([base_prompt], 1, return_logits=True)
    ttft0 = engine.stats()["ttft_seconds"][-1]
    say(
        f"prefix engine, cold {kmax}-token prompt (records + snapshots every {chunk} tokens): TTFT {ttft0:.2f} s "
        f"(wall {time.perf_counter() - t:.2f} s)"
    )
    t = time.perf_counter()
    queued = engine.write_through()
    engine.flush_disk()
    wt = time.perf_counter() - t
    st = tier.stats()
    say(
        f"write_through + flush_disk: {queued} blocks, {st['stored_bytes'] / 2**20:.1f} MiB in {st['segments']} "
        f"segment(s), {wt:.2f} s (includes compiling the host gathers)"
    )

    out = {"ttft0": ttft0, "write_through_s": wt, "stored_bytes": st["stored_bytes"], "rows": []}
    failures = []
    for k in ks:
        prompt = prompts[k]
        row = {"k": k}
        # the first restore compiles swap_in for this K's row buckets; the recompute engine is compiled
        c0 = time.process_time()
        (gc,) = cold.generate([prompt], 1, return_logits=True)
        rec, rec_cpu = [cold.stats()["ttft_seconds"][-1]], [time.process_time() - c0]
        say(f"  K={k}: recompute (no prefix cache) 1/{args.repeats}: TTFT {rec[-1]:.3f} s (CPU {rec_cpu[-1]:.2f} s)")

        def restore(label: str, drop: bool, evict: bool = True, *, k=k, prompt=prompt, gc=gc):
            if evict:
                forget()
            if drop:
                drop_page_cache(store)
            TimedTier.read_seconds = 0.0
            t, c0 = time.perf_counter(), time.process_time()
            (g,) = engine.generate([prompt], 1, return_logits=True)
            wall, cpu = time.perf_counter() - t, time.process_time() - c0
            ttft = engine.stats()["ttft_seconds"][-1]
            p = g.plan
            want = (0, k) if evict else None
            ok = p.disk_tokens == want and p.restored_tokens == k
            if not ok:
                failures.append(f"K={k} {label}: plan {p}")
            if g.tokens != gc.tokens:
                failures.append(f"K={k} {label}: token {g.tokens} != recompute {gc.tokens}")
            diff = float(np.abs(g.logits - gc.logits).max())
            say(
                f"  K={k}: {label:<28} TTFT {ttft:.3f} s (wall {wall:.3f} s, CPU {cpu:.2f} s; disk read + verify "
                f"{TimedTier.read_seconds:.3f} s); restored {p.restored_tokens} tokens, disk_tokens {p.disk_tokens}; "
                f"token {'==' if g.tokens == gc.tokens else '!='} recompute, max |logit diff| {diff:.1e}"
            )
            return ttft, TimedTier.read_seconds, diff, cpu

        first = restore("restore, first (compiles)", drop=False)
        warm, coldr = [], []
        for i in range(args.repeats):  # interleaved, so machine load hits every kind alike
            if i:
                c0 = time.process_time()
                (g2,) = cold.generate([prompt], 1, return_logits=True)
                rec.append(cold.stats()["ttft_seconds"][-1])
                rec_cpu.append(time.process_time() - c0)
                if g2.tokens != gc.tokens:
                    failures.append(f"K={k}: recompute not deterministic")
                say(
                    f"  K={k}: recompute (no prefix cache) {i + 1}/{args.repeats}: TTFT {rec[-1]:.3f} s "
                    f"(CPU {rec_cpu[-1]:.2f} s)"
                )
            warm.append(restore(f"restore, warm {i + 1}/{args.repeats}", drop=False))
            coldr.append(restore(f"restore, cold {i + 1}/{args.repeats}", drop=True))
        row["recompute"], row["recompute_cpu"] = rec, rec_cpu
        dev = restore("device hit (no eviction)", drop=False, evict=False)
        row.update(
            first=first[0],
            warm=[w[0] for w in warm],
            warm_read=[w[1] for w in warm],
            cold=[c[0] for c in coldr],
            cold_read=[c[1] for c in coldr],
            device=dev[0],
            restore_cpu=[x[3] for x in warm + coldr],
            diff=max([first[2], dev[2]] + [w[2] for w in warm] + [c[2] for c in coldr]),
        )
        out["rows"].append(row)
    tier.close()
    out["failures"] = failures
    return out


def print_engine(args, eng: dict) -> None:
    print(
        f"\n== part 2: restore a prefix from disk vs recompute it (TTFT, median of {args.repeats}; "
        f"prompt = K tokens + 1 new)"
    )
    print(
        f"prefix engine's cold {max(r['k'] for r in eng['rows'])}-token TTFT (with recording): {eng['ttft0']:.2f} s;"
        f" write_through + flush: {eng['write_through_s']:.2f} s, {eng['stored_bytes'] / 2**20:.1f} MiB stored"
    )
    print(
        f"{'K':>6}{'recompute':>12}{'disk, warm':>12}{'(read)':>9}{'disk, cold':>12}{'(read)':>9}"
        f"{'1st (compile)':>15}{'device hit':>12}{'recompute/disk warm':>21}{'/ disk cold':>13}"
        f"{'CPU s: recompute / restore':>30}"
    )
    for r in eng["rows"]:
        rc, w, c = med(r["recompute"]), med(r["warm"]), med(r["cold"])
        rcc, rsc = med(r["recompute_cpu"]), med(r["restore_cpu"])
        print(
            f"{r['k']:>6}{rc:>10.3f} s{w:>10.3f} s{med(r['warm_read']):>7.3f} s{c:>10.3f} s"
            f"{med(r['cold_read']):>7.3f} s{r['first']:>13.3f} s{r['device']:>10.3f} s{rc / w:>20.1f}x"
            f"{rc / c:>12.1f}x{rcc:>13.2f} / {rsc:.2f} = {rcc / rsc:4.1f}x"
        )
    big = [r for r in eng["rows"] if r["k"] >= 2048]
    ok = all(med(r["recompute"]) > max(med(r["warm"]), med(r["cold"])) for r in big)
    print(
        "restore faster than recompute from 2K tokens up [target: "
        + (("met" if ok else "NOT met") if big else "not measured: no K >= 2048 in this run")
        + "]"
    )
    print(
        f"correctness: {'exact' if not eng['failures'] else 'FAILED'} (restored plans cover [0, K) from disk; "
        f"first token equal to the recompute's; max |logit diff| {max(r['diff'] for r in eng['rows']):.1e})"
    )
    for f in eng["failures"]:
        print(f"  {f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small sizes (< 60 s)")
    ap.add_argument("--mib", type=float, default=256, help="part 1: payload MiB (rounded to whole segments)")
    ap.add_argument("--io-repeats", type=int, default=5)
    ap.add_argument("--segment-tokens", type=int, default=8192, help="part 1: tokens per segment (one conversation)")
    ap.add_argument("--block-tokens", type=int, default=64, help="part 1: tokens per block (DeepSeek-V4-Flash shapes)")
    ap.add_argument("--chunk-bytes", type=int, default=1 << 19, help="DiskTier chunk_bytes for part 1")
    ap.add_argument("--shard-bytes", type=int, default=1 << 24, help="DiskTier shard_bytes for part 1")
    ap.add_argument("--no-ocdbt", action="store_true")
    ap.add_argument(
        "--prefault-gib", type=float, default=4, help="touch this much memory before part 1 (see prefault(); 0: off)"
    )
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192], help="part 2: prefix lengths K")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--engine-block-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="part 2: timed runs per K and kind")
    ap.add_argument("--skip-io", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also sweep chunk_bytes and tensorstore concurrency")
    ap.add_argument("--sweep-mib", type=float, default=128)
    ap.add_argument("--sweep-repeats", type=int, default=3)
    ap.add_argument("--tmp", default="/tmp", help="parent of the temporary directory")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.io_repeats, args.segment_tokens = 24, 1, 1024
        args.tokens, args.prefill_chunk, args.repeats = [256, 512], 128, 1
        args.sweep_mib, args.sweep_repeats = 24, 1

    import jax

    cores, rev = _machine.cores(), _machine.hkv_revision()
    fs = "?"
    try:
        best = ""
        tmp = os.path.realpath(args.tmp)
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if tmp.startswith(mnt) and len(mnt) >= len(best):
                    best, fs = mnt, f"{dev} ({typ}) on {mnt}"
        name = os.path.basename(fs.split()[0])
        rot = f"/sys/block/{name}/queue/rotational"
        if os.path.exists(rot):
            with open(rot) as f:
                fs += ", rotational=" + f.read().strip()
    except (OSError, IndexError):
        pass
    say(f"load average {os.getloadavg()[0]:.1f} (other processes share this machine)")
    say(
        f"date {datetime.date.today().isoformat()}; {cores}-core {platform.machine()} {jax.default_backend().upper()}, "
        f"jax {jax.__version__}; hkv at {rev}; temp dir under {args.tmp}: {fs}"
    )
    root = tempfile.mkdtemp(prefix="hkv-disk-bench-", dir=args.tmp)
    summary = {}
    try:
        if not args.skip_io:
            prefault(args.prefault_gib)
            io = io_benchmark(args, root)
            bd = breakdown(args, root)
        if args.sweep:
            sweep(args, root)
        if not args.skip_engine:
            eng = engine_benchmark(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not args.skip_io:
        summary.update(print_io(args, io))
        print_breakdown(args, *bd)
    if not args.skip_engine:
        print_engine(args, eng)
    print(
        f"\ntotal {time.perf_counter() - T0:.0f} s (temporary files removed); load average at the end "
        f"{os.getloadavg()[0]:.1f}"
    )
    if not args.skip_engine and eng["failures"]:
        raise SystemExit("disk restores were not exact or not complete")


if __name__ == "__main__":
    main()
