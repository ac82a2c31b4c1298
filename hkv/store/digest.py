"""Per-object digests of the tiers: `sum64`, a lane-weighted 64-bit sum that runs at memory-read
speed, and zlib's `crc32`.

`sum64`: the bytes as uint64 words summed per lane of `LANES` words, each lane times its own odd
constant (plus a crc32 of the last < 8 bytes, and the length). Any change confined to one word (a
flipped bit or byte, a stray write) always changes it, and words moved between lanes almost always
do. It runs at about 16 GB/s on blocks of V4-Flash shapes on the 2-core VM, against 4 GB/s for
zlib's crc32 (stronger against reordered words). The host tier checks every read with it, and disk
manifests of version 3 carry it per object (on top of zarr's crc32c per chunk).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
import zlib

import numpy as np

CHECKS = ("sum64", "crc32")
LANES = 512
_WEIGHTS = np.random.default_rng(0x686B76).integers(0, 1 << 63, LANES, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def digest(a: np.ndarray, check: str = "sum64") -> int:
    """An object's digest (see the module docstring).

    Args:
        a: a C-contiguous array of any dtype and shape.
        check: one of `CHECKS`.
    Returns:
        The digest: an int in [0, 2**64) for "sum64", [0, 2**32) for "crc32".
    Raises:
        ValueError: another `check`.
    """
    raw = a.reshape(-1).view(np.uint8)
    if check == "crc32":
        return zlib.crc32(raw)
    if check != "sum64":
        raise ValueError(f"check={check!r} must be one of {CHECKS}")
    n = raw.shape[0] // 8
    words = raw[: n * 8].view(np.uint64)
    full = n // LANES * LANES
    total = np.zeros(1, np.uint64)
    if full:
        lanes = words[:full].reshape(-1, LANES).sum(axis=0, dtype=np.uint64)
        total += (lanes * _WEIGHTS).sum(dtype=np.uint64)
    if n > full:
        total += (words[full:] * _WEIGHTS[: n - full]).sum(dtype=np.uint64)
    tail = zlib.crc32(raw[n * 8 :]) ^ (raw.shape[0] << 32)
    return int(total[0]) ^ tail


PARALLEL_BYTES = 8 << 20  # below this many bytes `digest_many` runs on the calling thread


class LazyPool:
    """A thread pool created on first use (a process that never reads pays no threads), shared by
    every tier of the process.

    Args:
        workers: its threads.
        prefix: their names' prefix.
    """

    def __init__(self, workers: int, prefix: str):
        self.workers, self.prefix = workers, prefix
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def get(self) -> concurrent.futures.ThreadPoolExecutor:
        """The pool (created now if it does not exist yet)."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix=self.prefix)
            return self._pool


_DIGESTS = LazyPool(os.cpu_count() or 1, "hkv-digest")  # (not the read pool: its threads wait on I/O)


def digest_many(arrays: list[np.ndarray | None], check: str = "sum64") -> list[int | None]:
    """`digest` of each array (None stays None), on every core once they hold `PARALLEL_BYTES` or
    more (numpy's reductions and zlib release the GIL; a restore of many blocks from host memory is
    bounded by this pass).

    Args:
        arrays: C-contiguous arrays, or None.
        check: one of `CHECKS`.
    Returns:
        Their digests, in order.
    Raises:
        ValueError: another `check`.
    """
    if check not in CHECKS:
        raise ValueError(f"check={check!r} must be one of {CHECKS}")
    total = sum(a.nbytes for a in arrays if a is not None)
    workers = _DIGESTS.workers
    if total < PARALLEL_BYTES or workers < 2 or len(arrays) < 2:
        return [None if a is None else digest(a, check) for a in arrays]
    # contiguous runs of about equal bytes, one task each
    cuts, acc, share = [0], 0, total / workers
    for i, a in enumerate(arrays):
        acc += 0 if a is None else a.nbytes
        if acc >= share * len(cuts) and len(cuts) < workers:
            cuts.append(i + 1)
    cuts.append(len(arrays))
    runs = [arrays[a:b] for a, b in itertools.pairwise(cuts) if b > a]
    done = _DIGESTS.get().map(lambda run: [None if a is None else digest(a, check) for a in run], runs)
    return [d for run in done for d in run]


__all__ = ["CHECKS", "LANES", "PARALLEL_BYTES", "LazyPool", "digest", "digest_many"]
