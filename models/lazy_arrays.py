"""Arrays read per slice from the checkpoint's memory-mapped tensors (numpy only).

`read(arr, index)` is `np.asarray(arr[index])` that reads a contiguous range of a memory-mapped tensor
(a whole tensor, or a run of its leading rows) with one `os.preadv` straight into the new array instead
of page-faulting the mapping (about twice the speed on a cold file here: `benchmarks/load.py`), and
releases the GIL while it reads.

`Readahead(files)` reads a checkpoint's files in order into the OS page cache on a background thread,
a bounded window ahead of the consumer, so that the disk streams while the consumer converts and places
what was read before.

`LazyStack(parts)` is `np.stack(parts)` (optionally each part transposed) that builds nothing until it
is sliced, and then reads only the parts and rows asked for: how a layer's routed experts, stored one
tensor per expert, become one [E, ...] weight that `models.placement.OnMesh` reads device by device.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np

__all__ = ["LazyStack", "Readahead", "read", "source_file"]


def _byte_range(arr: np.ndarray, index: tuple) -> tuple[int, int, tuple[int, ...]] | None:
    """(start, stop, shape) in bytes from arr's first byte of arr[index] when that is one contiguous run
    (dims after the first are taken whole, steps of 1), else None."""
    if not arr.flags.c_contiguous:
        return None
    index = index + (slice(None),) * (arr.ndim - len(index))
    if len(index) != arr.ndim or not all(isinstance(i, slice) for i in index):
        return None
    if arr.ndim == 0:
        return 0, arr.nbytes, ()
    for d, i in enumerate(index[1:], start=1):
        if i.indices(arr.shape[d]) != (0, arr.shape[d], 1):
            return None
    start, stop, step = index[0].indices(arr.shape[0])
    if step != 1:
        return None
    stop = max(start, stop)
    row = arr.nbytes // arr.shape[0] if arr.shape[0] else 0
    return start * row, stop * row, (stop - start, *arr.shape[1:])


def read(arr, index=(), out: np.ndarray | None = None) -> np.ndarray:
    """`np.asarray(arr[index])`, a new array (or written into `out`, of that shape and dtype, and
    returned): a contiguous range of a file-backed `np.memmap` view is read with `os.preadv` (one
    call, no page faults, the GIL released); anything else is sliced.
    index: a tuple of slices (as `jax.make_array_from_callback` passes), or () for the whole array."""
    if isinstance(arr, LazyStack):
        got = arr[index]
        if out is None:
            return got
        out[...] = got
        return out
    index = index if isinstance(index, tuple) else (index,)
    mm = getattr(arr, "_mmap", None)
    where = _byte_range(arr, index) if mm is not None and getattr(arr, "filename", None) else None
    if where is None or (out is not None and not out.flags.c_contiguous):
        got = arr[index] if index else arr
        if out is None:
            return np.array(got)
        out[...] = got
        return out
    start, _, shape = where
    # np.memmap maps the file from `offset` rounded down to the allocation granularity; a view keeps
    # its parent's `_mmap` and `offset`
    mapped_from = arr.offset - arr.offset % mmap.ALLOCATIONGRANULARITY
    base = np.frombuffer(mm, np.uint8).__array_interface__["data"][0]
    offset = arr.__array_interface__["data"][0] - base + mapped_from + start
    if out is None:
        out = np.empty(shape, arr.dtype)
    elif out.shape != shape or out.dtype != arr.dtype:
        raise ValueError(f"out {out.shape} {out.dtype} must be {shape} {arr.dtype}")
    view = out.reshape(-1).view(np.uint8)
    with open(arr.filename, "rb", buffering=0) as f:
        done = 0
        while done < view.nbytes:
            n = os.preadv(f.fileno(), [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{arr.filename}: short read at byte {offset + done} ({done} of {view.nbytes})")
            done += n
    return out


class LazyStack:
    """`np.stack(parts)` (each part transposed first when `transpose`) without building it: slicing
    reads only the parts and rows asked for. parts: arrays (memory-mapped views) of one shape and dtype.

    Attributes: shape, dtype, ndim, nbytes (as the stacked array's)."""

    def __init__(self, parts: Sequence, transpose: bool = False):
        if not parts:
            raise ValueError("LazyStack needs at least one part")
        first = parts[0]
        for p in parts:
            if tuple(p.shape) != tuple(first.shape) or np.dtype(p.dtype) != np.dtype(first.dtype):
                raise ValueError(f"LazyStack parts differ: {p.shape} {p.dtype} vs {first.shape} {first.dtype}")
        self.parts = list(parts)
        self.transpose = transpose
        inner = tuple(first.shape)[::-1] if transpose else tuple(first.shape)
        self.shape = (len(parts), *inner)
        self.dtype = np.dtype(first.dtype)
        self.ndim = len(self.shape)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (self.ndim - len(index))
        lead, rest = index[0], index[1:]
        picked = range(len(self.parts))[lead]
        if isinstance(picked, int):
            return self._part(picked, rest)
        shape = np.broadcast_to(np.empty((), self.dtype), self.shape)[(lead, *rest)].shape  # reads nothing
        out = np.empty(shape, self.dtype)  # each part read straight into its row
        for j, i in enumerate(picked):
            self._part(i, rest, out[j])
        return out

    def _part(self, i: int, rest: tuple, out: np.ndarray | None = None) -> np.ndarray:
        p = self.parts[i]
        if self.transpose:
            got = read(p, rest[::-1]).T
            if out is None:
                return got
            out[...] = got
            return out
        return read(p, rest, out)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[(slice(None),) * self.ndim]
        return out if dtype is None else out.astype(dtype)


def source_file(value) -> str | None:
    """The file a memory-mapped tensor (or a `LazyStack`'s first part, or a quantized tensor's data:
    anything with a `.data` or `.parts`) is read from, or None."""
    for _ in range(4):
        if isinstance(value, np.ndarray):
            return getattr(value, "filename", None) or None
        if isinstance(value, LazyStack):
            value = value.parts[0]
        elif isinstance(getattr(type(value), "data", None), property) or "data" in getattr(value, "__dict__", {}):
            value = value.data
        else:
            return None
    return None


class Readahead:
    """Reads `files` in order (`chunk` bytes at a time) on a background thread, so the OS page cache
    holds them before the consumer's reads ask; it stays at most `window` bytes ahead of the bytes the
    consumer reports with `advance`. Read errors stop it quietly (the consumer's own reads report them).
    Use as a context manager, or call `close()`."""

    def __init__(self, files, window: int = 1 << 30, chunk: int = 16 << 20):
        if window < chunk:
            raise ValueError(f"window={window} must be at least chunk={chunk}")
        self.files = list(files)
        self.window = window
        self.chunk = chunk
        self.read_bytes = 0  # read ahead so far
        self._consumed = 0
        self._stop = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hkv-readahead", daemon=True)
        self._thread.start()

    def advance(self, nbytes: int) -> None:
        """The consumer has used `nbytes` more of the files (in their order)."""
        with self._cv:
            self._consumed += int(nbytes)
            self._cv.notify_all()

    def _run(self) -> None:
        buf = bytearray(self.chunk)
        try:
            for path in self.files:
                with open(path, "rb", buffering=0) as f:
                    while True:
                        with self._cv:
                            self._cv.wait_for(lambda: self._stop or self.read_bytes - self._consumed < self.window)
                            if self._stop:
                                return
                        n = f.readinto(buf)
                        if not n:
                            break
                        self.read_bytes += n
        except OSError:
            return

    def close(self) -> None:
        """Stop reading ahead and wait for the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    def __enter__(self) -> Readahead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
