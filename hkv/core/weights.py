"""Weights identity: `weights_digest(state)`, a digest of a model's weights themselves (every element,
every dtype, every shape, every parameter path) — the part of the ABI fingerprint that says *which*
weights produced a cache's bytes (a label like `model_id` cannot: two models with the same label and
different weights would share cached blocks and produce wrong tokens).

How (so that no weight crosses to the host and every backend gives the same digest):
  1. on device: the bits of every array as unsigned integers of its width (bitcast; bool as uint8,
     64/128-bit types as 2/4 uint32 words per element, 4-bit types via uint4; PRNG keys by their key
     data), widened to uint32. Word e at flat index i becomes, for each of `LANES` = 4 lanes,
     h_l(e, i) = fmix32(e ^ (i * A_l + s_l)), fmix32 being murmur3's finaliser (a bijection of uint32),
     A_l odd, s_l a per-lane, per-chunk salt; each lane is the wrapping uint32 sum of h_l. Integer
     ops only, and a wrapping sum does not depend on the reduction order: CPU, GPU and TPU give the
     same lanes. Since h_l is a bijection of e for a fixed i, changing any ONE element changes every
     lane — a single changed weight is always detected, not just with high probability; several
     changed elements collide only by accident (4 x 32 bits per array).
     Leaves of at most `SMALL` elements (norms, biases, gates: most leaves, few bytes) are hashed as
     one concatenation (indices run over it), `GROUP` elements per program: one compilation per model
     structure instead of one per shape. A bigger leaf is hashed alone, in chunks of `CHUNK` elements
     (the chunk number salts the lanes, so flat indices never wrap), one program per (shape, dtype):
     the layers of a model share it.
  2. on the host: blake2b-128 over (sorted parameter path, dtype name, shape) of every leaf, then
     the lanes — so any change of a path, a dtype (e.g. a bf16 copy of the same weights) or a shape
     changes the digest too.

It identifies weights against accidents — another checkpoint, seed, fine-tune or dtype, a corrupted
tensor — not against an adversary who controls the weights (the lane sums are not a cryptographic
hash; whoever can choose weights can construct a collision).

Cost: one pass over the weights, compute-bound on CPU (XLA:CPU does not vectorise the 32-bit
integer multiplies well); a GPU or TPU runs it at memory bandwidth. For a tiny model the first
call in a process is mostly compiling. Memory: no copy of a big leaf; the small leaves' concatenation
(<= `GROUP` words).

The digest of an engine's weights is computed once per set of weight arrays: `weights_digest` keeps
a small cache keyed by the identity of the leaf arrays (held by weak references, so a cached entry
never keeps weights alive and dies with them). Building several engines on the same loaded model, or
`Engine.restore`, does not re-hash. jax arrays are immutable, so an in-memory change of a weight
means a new array object (e.g. `model.w.value = new`) — a cache miss, hashed afresh; a state holding
any mutable leaf (a numpy array) is never cached.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LANES = 4
CHUNK = 1 << 28  # elements hashed per device program call (flat indices stay below 2**32)
SMALL = 1 << 20  # leaves of at most this many elements are hashed together in one program...
GROUP = 1 << 24  # ...with at most this many elements per program
_MIX_A = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)  # odd multipliers, one per lane
_MIX_B = (0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09)
DIGEST_HEX_CHARS = 32

__all__ = ["DIGEST_HEX_CHARS", "LANES", "WeightsDigestError", "weights_digest"]


class WeightsDigestError(ValueError):
    """A weights state holds a leaf that cannot be hashed (neither an array nor a plain scalar)."""


def _fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection of uint32 (xor-shifts and odd multiplies)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _as_words(x: jax.Array) -> jax.Array:
    """The bits of `x` as a flat uint32 vector, one word per element (or 2 / 4 words per 64 / 128-bit
    element); exact for every dtype jax stores (4-bit types via uint4, bool via uint8)."""
    dt = jnp.dtype(x.dtype)
    if dt == jnp.bool_:
        return x.astype(jnp.uint8).astype(jnp.uint32).reshape(-1)
    bits = jax.dtypes.itemsize_bits(dt)
    unsigned = {4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}
    if bits in unsigned:
        u = x if dt == unsigned[bits] else jax.lax.bitcast_convert_type(x, unsigned[bits])
        return u.astype(jnp.uint32).reshape(-1)
    # 64 or 128 bits: one bitcast to [..., bits/32] uint32 words
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)


@jax.jit
def _lanes(x: jax.Array, chunk: jax.Array) -> jax.Array:
    """uint32[LANES]: the wrapping sums of h_l(word, index) over one chunk of an array (module docstring).

    Args:
      x: any array (<= CHUNK elements' worth of words).
      chunk: uint32[] the chunk number (mixed into every index).
    Returns:
      uint32[LANES].
    """
    w = _as_words(x)
    idx = jnp.arange(w.shape[0], dtype=jnp.uint32)
    out = []
    for a, b in zip(_MIX_A, _MIX_B, strict=True):
        salt = _fmix32(chunk * jnp.uint32(a) + jnp.uint32(b))
        h = _fmix32(w ^ (idx * jnp.uint32(a) + salt))
        out.append(jnp.sum(h, dtype=jnp.uint32))
    return jnp.stack(out)


@jax.jit
def _lanes_concat(xs: tuple) -> jax.Array:
    """uint32[LANES]: `_lanes` of the concatenated words of small arrays, as ONE program: a model's
    many small leaves (norms, biases, gates) cost one compilation per model structure, not one per
    shape. Flat indices run over the concatenation, so every element keeps a distinct index."""
    return _lanes.__wrapped__(jnp.concatenate([_as_words(x) for x in xs]), jnp.uint32(0))


def _as_device(x):
    """A leaf as a jax array whose bits are the leaf's bits (PRNG keys as key data; numpy 64-bit arrays,
    which jnp.asarray would narrow without x64, as their uint32 words)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    if isinstance(x, np.ndarray) or np.isscalar(x):
        x = np.asarray(x)
        if x.dtype.itemsize >= 8 and x.dtype.kind in "iufc":
            x = np.ascontiguousarray(x).view(np.uint32)
        return jnp.asarray(x)
    return x


def _leaf_lanes(x) -> list[jax.Array]:
    """Per-chunk lane vectors of one array leaf (device arrays; nothing is copied to the host)."""
    n = int(np.prod(x.shape, dtype=np.int64))
    per = jax.dtypes.itemsize_bits(x.dtype) // 32 or 1  # uint32 words per element (64-bit: 2)
    step = max(CHUNK // per, 1)
    if n <= step:
        return [_lanes(x, jnp.uint32(0))]  # flattened inside the program (a sharded array stays in place)
    flat = x.reshape(-1)
    return [_lanes(flat[s : s + step], jnp.uint32(k)) for k, s in enumerate(range(0, n, step))]


def _leaves(state) -> list[tuple[str, Any]]:
    """(path, leaf) of every leaf of a pytree (an `nnx.State`, a dict of arrays, ...), sorted by path."""
    out = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(state)]
    out.sort(key=lambda t: t[0])
    return out


def _digest(leaves: list[tuple[str, Any]]) -> str:
    h = hashlib.blake2b(digest_size=DIGEST_HEX_CHARS // 2, person=b"hkv-weights-v1")
    pending = []
    for path, x in leaves:
        if x is None or (isinstance(x, (bool, int, float, str)) and not hasattr(x, "dtype")):
            # plain Python metadata in the state (rare): part of the identity by value
            h.update(f"{path}\0scalar\0{type(x).__name__}\0{x!r}\0".encode())
            continue
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            raise WeightsDigestError(
                f"weights leaf {path} is a {type(x).__name__}, not an array or a plain "
                f"scalar: it cannot be part of the weights digest"
            )
        pending.append((path, str(x.dtype), tuple(int(d) for d in x.shape), _as_device(x)))
    small = [p for p in pending if p[3].size <= SMALL]
    big = [p for p in pending if p[3].size > SMALL]
    # small leaves hashed together (in path order, in groups of <= GROUP elements), then every big leaf
    # chunk by chunk (in path order); the grouping follows from the shapes hashed below
    groups, size = [], 0
    for p in small:
        if not groups or size + p[3].size > GROUP:
            groups.append([])
            size = 0
        groups[-1].append(p[3])
        size += p[3].size
    lanes = [[_lanes_concat(tuple(g))] for g in groups] + [_leaf_lanes(p[3]) for p in big]
    host = jax.device_get(lanes)  # one transfer: 16 bytes per chunk, never a weight
    for group, items in (("small", small), ("big", big)):
        for path, dtype, shape, _ in items:
            h.update(f"{group}\0{path}\0{dtype}\0{shape}\0".encode())
    for chunks in host:
        for lane in chunks:
            h.update(np.asarray(lane, np.uint32).astype("<u4").tobytes())
    return h.hexdigest()


_CACHE: dict[tuple[tuple[str, int], ...], tuple[tuple[weakref.ref, ...], str]] = {}
_LOCK = threading.Lock()


def weights_digest(state) -> str:
    """Digest of a model's weights: blake2b-128 (32 hex chars) over every leaf's path, dtype, shape and
    on-device lane sums (module docstring). Equal for equal weights on any backend; differs when any
    single element, dtype, shape or path differs.

    Args:
      state: a pytree of the weights, e.g. the `nnx.State` of `nnx.split(model)` (array leaves of any
        dtype and shape, sharded or not; plain Python scalars are hashed by value).
    Returns:
      str, 32 lowercase hex characters.
    Raises:
      WeightsDigestError: a leaf is neither an array nor a plain scalar (names its path).

    Cost: one on-device pass over the weights (see above); repeated calls on the same (immutable,
    jax.Array) leaves return the cached digest at no cost.
    """
    leaves = _leaves(state)
    arrays = [x for _, x in leaves]
    cacheable = bool(arrays) and all(isinstance(x, jax.Array) for x in arrays)
    key = tuple((p, id(x)) for p, x in leaves)
    if cacheable:
        with _LOCK:
            hit = _CACHE.get(key)
            if hit is not None and all(r() is x for r, x in zip(hit[0], arrays, strict=True)):
                return hit[1]
    digest = _digest(leaves)
    if cacheable:
        try:
            refs = tuple(weakref.ref(x) for x in arrays)
        except TypeError:  # an array type without weak references: not cached
            return digest
        with _LOCK:
            for k in [k for k, (rs, _) in _CACHE.items() if any(r() is None for r in rs)]:
                del _CACHE[k]  # entries whose weights are gone
            _CACHE[key] = (refs, digest)
    return digest
