"""Arrays read per slice from the checkpoint's memory-mapped tensors (numpy only).

`LazyStack(parts)` is `np.stack(parts)` (optionally each part transposed) that builds nothing until it
is sliced, and then reads only the parts and rows asked for: how a layer's routed experts, stored one
tensor per expert, become one [E, ...] weight that `models.placement.OnMesh` reads device by device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["LazyStack"]


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
        return np.stack([self._part(i, rest) for i in picked]) if len(picked) else np.empty((0,), self.dtype)

    def _part(self, i: int, rest: tuple) -> np.ndarray:
        p = self.parts[i]
        if self.transpose:
            return np.asarray(p[rest[::-1]]).T
        return np.asarray(p[rest])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[(slice(None),) * self.ndim]
        return out if dtype is None else out.astype(dtype)
