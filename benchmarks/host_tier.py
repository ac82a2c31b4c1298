"""The host-memory tier (`hkv.HostTier`, `hkv.TieredStore`): restoring a 100K-token DeepSeek-V4-Flash
prefix from host memory against this machine's memcpy bandwidth, and from the disk tier against the
disk's sequential read speed, all measured in the same run.

    python benchmarks/host_tier.py            # 100K tokens, 5 repeats (~30-60 s, ~3.8 GB peak RSS)
    python benchmarks/host_tier.py --quick    # 16K tokens, 2 repeats (smoke run)

The prefix: `--tokens` tokens (rounded up to whole 64-token blocks) of DeepSeek-V4-Flash cache objects
in bf16 (`models.deepseek_v4.cache_spec` of `DeepseekV4Config()`, shapes from
`hkv.engine.offload.expected_objects`: per block the CSA / HCA / indexer rows, the last block also its
SWA window and TAIL snapshot), random bytes, written through the tier API (no weights needed).

Measured, in this order, each best (median) of `--repeats`:
  memcpy        `np.copyto` of a 512 MiB buffer into another (both prefaulted): one thread.
  seq read      a file of the prefix's size written and fsynced, dropped from this VM's page cache
                (`posix_fadvise(DONTNEED)`, no root needed; the virtual disk's host may still cache),
                read with `readinto` in 16 MiB pieces.
  host restore  `HostTier.find_chain` + `read` with the engine's dtype/shape expectations: every
                object's digest (sum64, and crc32 as an alternative) checked; the payloads are read-only
                views (no copy).
  disk restore  `DiskTier.find_chain` + `read` (the engine's expectations; crc32c + per-object sum64),
                page cache of the store dropped before each repeat ("cold").
  disk read     `DiskTier.read` alone (the refs looked up once before), cold: the bytes' read and
                checks without the lookup of the chain's 2 KiB block pointers and manifest.
  tiered        `TieredStore(HostTier(), DiskTier(...))` over the same store, cold: the first restore
                reads from disk (prefetched and promoted into host memory), the second from host memory.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time

import _machine  # benchmarks/_machine.py (the script's folder is on sys.path)
import numpy as np
from disk_tier import drop_page_cache, flash_layout, make_segments, prefault

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def best_med(fn, repeats: int, before=None) -> tuple[float, float]:
    """(best, median) wall seconds of fn() over `repeats` runs (`before()` untimed before each)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def memcpy_gbs(repeats: int, mib: int = 512) -> tuple[float, float]:
    """(best, median) GB/s of one-thread np.copyto of `mib` MiB."""
    src = np.ones(mib << 20, np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    b, m = best_med(lambda: np.copyto(dst, src), repeats)
    return src.nbytes / b / 1e9, src.nbytes / m / 1e9


def seq_read_gbs(path: str, nbytes: int, repeats: int) -> tuple[float, float, float]:
    """(best, median) GB/s of reading a fresh `nbytes` file after dropping it from the page cache, and
    the warm (page cache) GB/s for comparison."""
    chunk = 16 << 20
    block = np.random.default_rng(0).integers(0, 256, chunk, np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(0, nbytes, chunk):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    size = os.path.getsize(path)
    buf = bytearray(chunk)

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    def drop() -> None:
        drop_page_cache(os.path.dirname(path))

    b, m = best_med(read, repeats, drop)
    w, _ = best_med(read, 1)
    os.remove(path)
    return size / b / 1e9, size / m / 1e9, size / w / 1e9


def restorer(tier, layout, chain, lookup: bool = True):
    """fn() restoring `chain` from `tier` with the engine's expectations (raises on a short restore).
    With `lookup` False the chain is looked up once, here, and fn() only reads its blocks."""
    from hkv.engine import offload as swap

    abi = layout.spec.fingerprint()
    keys, toks = [b.key for b in chain], [b.tokens for b in chain]
    found = None if lookup else tier.find_chain(abi, keys, toks)

    def expect(ref):
        return swap.expected_objects(layout, ref.length, ref.snapshot)

    def restore() -> None:
        refs = (found if found is not None else tier.find_chain(abi, keys, toks)).refs
        res = tier.read(refs, expect=expect)
        if res.reason is not None or len(res.payloads) != len(chain):
            raise SystemExit(f"restore failed: {len(res.payloads)}/{len(chain)} blocks, {res.reason}: {res.detail}")

    return restore


def check_bytes(tier, layout, chain) -> None:
    """The restored bytes equal the written ones (every object of every block)."""
    abi = layout.spec.fingerprint()
    res = tier.read(tier.find_chain(abi, [b.key for b in chain], [b.tokens for b in chain]).refs)
    for want, got in zip(chain, res.payloads, strict=True):
        for name, (a, _) in want.objects.items():
            if not np.array_equal(a.view(np.uint8), got.objects[name][0].view(np.uint8)):
                raise SystemExit(f"restored bytes differ: block {want.index} object {name}")


def run(args, root: str) -> dict:
    from hkv import HostTier, TieredStore
    from hkv.store.tier import DiskTier

    bt = 64
    blocks = -(-args.tokens // bt)
    layout = flash_layout(bt, blocks * bt)
    (chain,) = make_segments(layout, 1, blocks, np.random.default_rng(1))
    size = sum(a.nbytes for b in chain for a, _ in b.objects.values())
    abi = layout.spec.fingerprint()
    say(f"prefix: {blocks * bt} tokens, {blocks} blocks, {size / 1e6:.0f} MB ({size / (blocks * bt):,.0f} bytes/token)")
    prefault(args.prefault_gib)
    out = {"tokens": blocks * bt, "bytes": size}
    out["memcpy"] = memcpy_gbs(args.repeats)
    say(f"memcpy: {out['memcpy'][0]:.2f} GB/s best, {out['memcpy'][1]:.2f} median")
    out["seq_read"] = seq_read_gbs(os.path.join(root, "seq", "file.bin"), size, args.repeats)
    say(
        f"seq read (cold): {out['seq_read'][0]:.2f} GB/s best, {out['seq_read'][1]:.2f} median; "
        f"warm {out['seq_read'][2]:.2f}"
    )
    for check in ("sum64", "crc32"):
        host = HostTier(check=check)
        t = time.perf_counter()
        host.write(abi, chain)
        out[f"host_write_{check}"] = size / (time.perf_counter() - t) / 1e9
        check_bytes(host, layout, chain)
        b, m = best_med(restorer(host, layout, chain), args.repeats)
        out[f"host_{check}"] = (size / b / 1e9, size / m / 1e9)
        say(f"host restore ({check}): {out[f'host_{check}'][0]:.2f} GB/s best, {out[f'host_{check}'][1]:.2f} median")
        host.close()
    store = os.path.join(root, "store")
    disk = DiskTier(store, linger_seconds=0)
    t = time.perf_counter()
    disk.write(abi, chain)
    out["disk_write"] = size / (time.perf_counter() - t) / 1e9
    check_bytes(disk, layout, chain)
    b, m = best_med(restorer(disk, layout, chain), args.repeats, lambda: drop_page_cache(store))
    out["disk"] = (size / b / 1e9, size / m / 1e9)
    say(f"disk restore (cold): {out['disk'][0]:.2f} GB/s best, {out['disk'][1]:.2f} median")
    b, m = best_med(restorer(disk, layout, chain, lookup=False), args.repeats, lambda: drop_page_cache(store))
    out["disk_read"] = (size / b / 1e9, size / m / 1e9)
    say(f"disk read alone (cold): {out['disk_read'][0]:.2f} GB/s best, {out['disk_read'][1]:.2f} median")
    disk.close()
    drop_page_cache(store)
    tiered = TieredStore(HostTier(), DiskTier(store))
    first = restorer(tiered, layout, chain)
    out["tiered_first"] = size / best_med(first, 1)[0] / 1e9
    tiered.wait_prefetch()
    out["tiered_second"] = size / best_med(first, 1)[0] / 1e9
    out["tiered_from_disk_blocks"] = tiered.disk.counters["blocks_read"]
    say(
        f"tiered: first restore (disk, promoted) {out['tiered_first']:.2f} GB/s, "
        f"second (host) {out['tiered_second']:.2f}"
    )
    tiered.close(persist=False)
    return out


def report(args, out: dict) -> None:
    mc, sr = out["memcpy"][0], out["seq_read"][0]
    rows = [
        ("memcpy (np.copyto, 1 thread)", out["memcpy"], None),
        ("disk sequential read, cold", out["seq_read"][:2], None),
        ("host restore, sum64 digests", out["host_sum64"], mc),
        ("host restore, crc32 digests", out["host_crc32"], mc),
        ("disk restore (DiskTier), cold", out["disk"], sr),
        ("disk read alone (DiskTier.read)", out["disk_read"], sr),
    ]
    print()
    print(f"{out['tokens']:,}-token DeepSeek-V4-Flash prefix, {out['bytes'] / 1e6:.0f} MB (bf16)")
    print(f"{'':34} {'GB/s best':>10} {'median':>8}  {'best / reference':>16}")
    for name, (b, m), ref in rows:
        ratio = f"{b / ref:.2f} x {'memcpy' if ref == mc else 'seq read'}" if ref else ""
        print(f"{name:34} {b:10.2f} {m:8.2f}  {ratio:>16}")
    print(f"warm sequential read (page cache): {out['seq_read'][2]:.2f} GB/s")
    print(
        f"writes: host {out['host_write_sum64']:.2f} GB/s (sum64), {out['host_write_crc32']:.2f} (crc32); "
        f"disk {out['disk_write']:.2f} GB/s (write + fsync + publish)"
    )
    print(
        f"TieredStore, cold store: first restore {out['tiered_first']:.2f} GB/s (from disk, promoted; "
        f"{out['tiered_from_disk_blocks']} blocks read from disk), second {out['tiered_second']:.2f} GB/s (host)"
    )
    ok_host = out["host_sum64"][0] >= 0.5 * mc
    ok_disk = out["disk"][0] >= 0.5 * sr
    ok_read = out["disk_read"][0] >= 0.5 * sr
    print(f"targets: host restore >= 0.5 x memcpy: {'met' if ok_host else 'NOT met'}; "
          f"disk restore >= 0.5 x seq read: {'met' if ok_disk else 'NOT met'} "
          f"(the read alone: {'met' if ok_read else 'NOT met'})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000, help="prefix tokens (rounded up to 64-token blocks)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefault-gib", type=float, default=1.0, help="memory touched once first (0: off)")
    ap.add_argument("--dir", default=None, help="where the file and the store go (default: a temporary dir)")
    ap.add_argument("--quick", action="store_true", help="16K tokens, 2 repeats")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeats = 16_384, 2
    if args.tokens < 64 or args.repeats < 1:
        raise SystemExit(f"--tokens {args.tokens} must be >= 64 and --repeats {args.repeats} >= 1")
    cores, rev = _machine.cores(), _machine.hkv_revision()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    say(f"hkv {rev}, {now}, {platform.machine()}, {cores} cores")
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hkv-host-tier-", dir=args.dir) as root:
        os.makedirs(os.path.join(root, "seq"))
        out = run(args, root)
    report(args, out)


if __name__ == "__main__":
    main()
