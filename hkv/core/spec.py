"""What a model's layers keep in the cache: `CacheSpec`, model-agnostic, with an ABI fingerprint.

A layer owns (article §2):
* an SWA object — the K=V rows of its last `window` tokens (`window=None`: a plain full-attention
  layer, whose rows never leave the window);
* optionally a compressor: COMPRESSED entries (one per `ratio` tokens) and its TAIL (the < ratio
  projected rows not yet compressed, plus for overlapping compressors the previous window's slice);
* optionally an indexer: INDEXER keys over the compressed entries (its own compressor and TAIL).

Layers whose objects have the same storage layout share one paged pool and one page table per slot
(a *group*): e.g. all DeepSeek-V4 layers' SWA rows, all CSA layers' compressed entries.
The model package builds the spec from its config (`models.deepseek_v4.cache_spec`); hkv never
imports a model.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json

import jax.numpy as jnp

KERNEL_LAYOUT_VERSION = 1


class ObjectKind(enum.IntEnum):
    """The article's five cache objects (bit positions in the state table's `form` field)."""

    COMPRESSED = 0
    TAIL = 1
    SWA = 2
    INDEXER = 3
    DISK = 4


@dataclasses.dataclass(frozen=True)
class CompressorSpec:
    """A compressor: `ratio` tokens -> one entry of `entry_dim`; projections are `proj_width` wide
    (2 * entry_dim for an overlapping compressor, whose entry w also pools window w-1's first half)."""

    ratio: int
    entry_dim: int
    proj_width: int
    overlap: bool

    def __post_init__(self):
        if self.ratio < 1:
            raise ValueError(f"ratio={self.ratio} must be >= 1")
        want = 2 * self.entry_dim if self.overlap else self.entry_dim
        if self.proj_width != want:
            raise ValueError(f"proj_width={self.proj_width} must be {want} (overlap={self.overlap})")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Cache objects of one layer.

    kv_dim: width of one SWA row, the bytes a token keeps in this layer's window: its keys and values
      of every KV head, `[K head 0 | ... | K head Hkv-1 | V head 0 | ... | V head Hkv-1]`, or with
      `shared_kv` one row per head that is both K and V (DeepSeek-V4: one shared 512-wide head).
    window: tokens a query attends to, itself included; None = full attention (rows never leave).
    num_kv_heads: KV heads in a row (>= 1; GQA/MQA). shared_kv: K = V (the row holds K only).
    compressor / indexer: the layer's compressor and its indexer (article §2), or None.
    """

    kv_dim: int
    window: int | None
    compressor: CompressorSpec | None = None
    indexer: CompressorSpec | None = None
    num_kv_heads: int = 1
    shared_kv: bool = True

    def __post_init__(self):
        if self.kv_dim < 1:
            raise ValueError(f"kv_dim={self.kv_dim} must be >= 1")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1 or None (full attention)")
        if self.indexer is not None and self.compressor is None:
            raise ValueError("an indexer needs a compressor on the same layer")
        if self.indexer is not None and self.indexer.ratio != self.compressor.ratio:
            raise ValueError(f"indexer ratio {self.indexer.ratio} must equal compressor ratio {self.compressor.ratio}")
        if self.compressor is not None and self.window is None:
            raise ValueError(
                "a layer with a compressor needs a window (window=None keeps every row: its compressed entries "
                "would duplicate them, and the compressed decode kernels attend over a sliding window)"
            )
        if not isinstance(self.num_kv_heads, int) or self.num_kv_heads < 1:
            raise ValueError(f"num_kv_heads={self.num_kv_heads!r} must be an integer >= 1")
        per_head = self.num_kv_heads * (1 if self.shared_kv else 2)
        if self.kv_dim % per_head:
            raise ValueError(
                f"kv_dim={self.kv_dim} must be a multiple of {per_head} "
                f"(num_kv_heads={self.num_kv_heads} x {'K=V' if self.shared_kv else 'K and V'})"
            )

    @classmethod
    def attention(
        cls, head_dim: int, num_kv_heads: int = 1, window: int | None = None, *, shared_kv: bool = False, **objects
    ) -> LayerSpec:
        """The spec of an attention layer with `num_kv_heads` heads of `head_dim` (K and V separate unless
        `shared_kv`); `objects` may add `compressor=` / `indexer=`."""
        return cls(head_dim * num_kv_heads * (1 if shared_kv else 2), window, num_kv_heads=num_kv_heads,
                   shared_kv=shared_kv, **objects)  # fmt: skip

    @property
    def head_dim(self) -> int:
        """Width of one K (or V) head."""
        return self.kv_dim // (self.num_kv_heads * (1 if self.shared_kv else 2))


KV_QUANT_FORMATS = ("fp8_e4m3",)


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """FP8 storage of the cache's rows (SWA rows, COMPRESSED entries, INDEXER keys), DeepSeek's FP8 KV
    layout: each row's leading `dim - rope_dims` values as float8 e4m3 with one power-of-two scale
    (ue8m0: a biased exponent byte) per `tile` values, and its trailing `rope_dims` values (the rotary
    channels) kept in the spec's dtype. TAILs stay in the spec's dtype (they are projections not yet
    compressed, at most `ratio` rows per compressor).

    A row of `dim` values is stored as `row_bytes(dim, itemsize)` bytes:
    `[e4m3 values (dim - rope_dims) | exponents ((dim - rope_dims) / tile) | rope values (rope_dims x itemsize)]`
    (`hkv.core.kv_quant.pack_rows`). Power-of-two scales make quantize-dequantize exact arithmetic up
    to the e4m3 rounding itself, so every path that rounds a row the same way gets the same bits.

    format: "fp8_e4m3" (the only one). tile: values per scale (>= 1). rope_dims: trailing values
    kept unquantized (>= 0).
    """

    format: str = "fp8_e4m3"
    tile: int = 64
    rope_dims: int = 0

    def __post_init__(self):
        if self.format not in KV_QUANT_FORMATS:
            raise ValueError(f"format={self.format!r} must be one of {KV_QUANT_FORMATS}")
        if not isinstance(self.tile, int) or self.tile < 1:
            raise ValueError(f"tile={self.tile!r} must be an integer >= 1")
        if not isinstance(self.rope_dims, int) or self.rope_dims < 0:
            raise ValueError(f"rope_dims={self.rope_dims!r} must be an integer >= 0")

    def check_dim(self, dim: int, what: str) -> None:
        """Raise ValueError unless rows of `dim` values can be stored: `dim - rope_dims` a multiple of
        `tile` (0: a row of rope values only, stored as is)."""
        n = dim - self.rope_dims
        if n < 0 or n % self.tile:
            raise ValueError(
                f"{what}: a row of {dim} values keeps {self.rope_dims} rope values, and the other {n} must be a "
                f"multiple of tile={self.tile} (>= 0)"
            )

    def row_bytes(self, dim: int, itemsize: int) -> int:
        """Bytes of one stored row of `dim` values (rope values of `itemsize` bytes)."""
        n = dim - self.rope_dims
        return n + n // self.tile + self.rope_dims * itemsize


@dataclasses.dataclass(frozen=True)
class Group:
    """Layers sharing one paged pool. kind SWA/COMPRESSED/INDEXER; `unit` tokens per stored row;
    `keep` rows retained per slot (None = all); `dim` row width."""

    kind: ObjectKind
    layers: tuple[int, ...]
    unit: int
    dim: int
    keep: int | None


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Every cache object of a model, with storage dtype, `block_tokens` and ABI identity.

    dtype: storage dtype of SWA rows, compressed entries, indexer keys and tail projections.
    block_tokens: tokens per cache block (the state table's and prefix index's granularity).
    model_id: a label for the weights (e.g. checkpoint revision), for display only: NOT part of the
      ABI fingerprint (two engines on the same weights with different labels share cached blocks).
    weights_digest: the identity of the weights themselves (`hkv.weights.weights_digest`, 32 hex
      chars; every element, dtype, shape and parameter path) — part of the ABI fingerprint. `Engine`
      sets it from the model it runs; None: a spec not bound to any weights (layout-only uses, tests).
    kv_quant: a `KVQuant` (FP8 rows: SWA, COMPRESSED and INDEXER pools hold packed uint8 rows; the
      model's stateless forward must round its K/V the same way, `hkv.core.kv_quant.round_rows`), or
      None: rows stored in `dtype`.
    """

    layers: tuple[LayerSpec, ...]
    dtype: str = "float32"
    block_tokens: int = 16
    model_id: str = "unknown"
    kernel_layout_version: int = KERNEL_LAYOUT_VERSION
    weights_digest: str | None = None
    kv_quant: KVQuant | None = None

    def __post_init__(self):
        if not self.layers:
            raise ValueError("a CacheSpec needs at least one layer")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens={self.block_tokens} must be >= 1")
        jnp.dtype(self.dtype)  # raises for an unknown dtype
        q = self.kv_quant
        if q is not None:
            if not isinstance(q, KVQuant):
                raise ValueError(f"kv_quant={q!r} must be a KVQuant or None")
            if self.dtype not in ("bfloat16", "float16", "float32"):
                raise ValueError(f"kv_quant needs a float dtype (bfloat16, float16, float32), not dtype={self.dtype!r}")
            for i, l in enumerate(self.layers):
                q.check_dim(l.kv_dim, f"layer {i} SWA")
                for name, c in (("compressor", l.compressor), ("indexer", l.indexer)):
                    if c is not None:
                        q.check_dim(c.entry_dim, f"layer {i} {name}")
        d = self.weights_digest
        if d is not None and not (isinstance(d, str) and len(d) == 32 and all(c in "0123456789abcdef" for c in d)):
            raise ValueError(
                f"weights_digest={d!r} must be None or 32 lowercase hex characters (hkv.weights.weights_digest)"
            )

    @property
    def storage_dtype(self):
        """The dtype of cache values as the model sees them (and of TAILs, which are never quantized)."""
        return jnp.dtype(self.dtype)

    def row_dtype(self):
        """The dtype of the SWA / COMPRESSED / INDEXER pools: uint8 (packed rows) with `kv_quant`, else
        `storage_dtype`."""
        return jnp.dtype(jnp.uint8) if self.kv_quant is not None else self.storage_dtype

    def row_width(self, dim: int) -> int:
        """Elements of `row_dtype` one stored row of `dim` values takes (its last pool axis)."""
        if self.kv_quant is None:
            return dim
        return self.kv_quant.row_bytes(dim, self.storage_dtype.itemsize)

    def row_bytes(self, dim: int) -> int:
        """Bytes of one stored row of `dim` values."""
        return self.row_width(dim) * self.row_dtype().itemsize

    def groups(self) -> tuple[Group, ...]:
        """Layers grouped by storage layout, in a stable order (SWA groups, compressed, indexer).
        Memoised on the instance too: hashing a spec (43 layers for V4-Flash) for the shared cache costs
        ~12 us, paid per block by a restore's shape checks (`hkv.engine.offload.expected_objects`)."""
        memo = self.__dict__.get("_groups_memo")
        if memo is None:
            memo = _groups(self)
            object.__setattr__(self, "_groups_memo", memo)  # not a field: equality and hash ignore it
        return memo

    def _compute_groups(self) -> tuple[Group, ...]:
        found: dict[tuple, list[int]] = {}
        for i, l in enumerate(self.layers):
            found.setdefault((ObjectKind.SWA, 1, l.kv_dim, l.window), []).append(i)
        for i, l in enumerate(self.layers):
            if l.compressor is not None:
                c = l.compressor
                found.setdefault((ObjectKind.COMPRESSED, c.ratio, c.entry_dim, None), []).append(i)
        for i, l in enumerate(self.layers):
            if l.indexer is not None:
                c = l.indexer
                found.setdefault((ObjectKind.INDEXER, c.ratio, c.entry_dim, None), []).append(i)
        keep = lambda kind, window: (window - 1) if (kind == ObjectKind.SWA and window is not None) else None
        return tuple(
            Group(kind=k[0], layers=tuple(v), unit=k[1], dim=k[2], keep=keep(k[0], k[3])) for k, v in found.items()
        )

    def group_of(self, kind: ObjectKind, layer: int) -> int:
        """Index of the group holding `kind` objects of `layer`."""
        for gi, g in enumerate(self.groups()):
            if g.kind == kind and layer in g.layers:
                return gi
        raise ValueError(f"layer {layer} has no {kind.name} object")

    def compressors(self) -> tuple[tuple[int, str, CompressorSpec], ...]:
        """(layer, "compressor" | "indexer", spec) for every compressor, in TAIL storage order."""
        out = []
        for i, l in enumerate(self.layers):
            if l.compressor is not None:
                out.append((i, "compressor", l.compressor))
            if l.indexer is not None:
                out.append((i, "indexer", l.indexer))
        return tuple(out)

    def to_json(self) -> dict:
        """Every field as plain JSON (`model_id` included, for display; see `abi_json`)."""
        return {**self.abi_json(), "model_id": self.model_id}

    def abi_json(self) -> dict:
        """The fields the ABI fingerprint hashes: weights digest, storage dtype, dims, ratios, windows,
        block_tokens, kernel layout version, the FP8 row format if any — not the `model_id` label."""
        out = {
            "layers": [dataclasses.asdict(l) for l in self.layers],
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
            "kernel_layout_version": self.kernel_layout_version,
            "weights_digest": self.weights_digest,
        }
        if self.kv_quant is not None:  # (absent otherwise: unquantized specs keep their fingerprints)
            out["kv_quant"] = dataclasses.asdict(self.kv_quant)
        return out

    def fingerprint(self) -> str:
        """ABI fingerprint: blake2b-128 (32 hex chars) over `abi_json()` — the weights themselves (their
        digest), dtypes, dims, ratios, windows, block_tokens and kernel layout version. Two caches may
        share bytes only if these match; the `model_id` label does not enter."""
        blob = json.dumps(self.abi_json(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(blob, digest_size=16, person=b"hkv-abi-v2").hexdigest()


@functools.lru_cache(maxsize=64)
def _groups(spec: CacheSpec) -> tuple[Group, ...]:
    """Groups of a (frozen, hashable) spec, computed once: layouts call this on every jit trace."""
    return spec._compute_groups()
