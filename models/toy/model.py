"""A toy hybrid-attention model written only against hkv's public API: docs/bring-your-own-model.md.

Each layer is one of
  * `Attn(window=w, num_kv_heads=h)`: GQA attention over the last w tokens (window=None: full attention);
  * `Compressed(ratio=m, window=w, topk=k)`: one shared K=V head over the last w tokens plus compressed
    entries, one per m tokens (a softmax-gated pooling of each window of m projected rows); with `topk`
    an indexer picks the k best entries instead of all (a sparse layer). Query t sees entries
    e < (t + 1) // m.

`__call__` is the stateless forward (the oracle); `cached_step` runs the same math through
`hkv.run_step` / `hkv.LayerCache`. No positional encoding: causal masks alone order the tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import hkv
from hkv.core.layers import causal_entry_limit, indexer_scores, select_topk, sequence_attention


@dataclasses.dataclass(frozen=True)
class Attn:
    """GQA attention over a window of `window` tokens (None: full attention)."""

    window: int | None = None
    num_kv_heads: int = 1


@dataclasses.dataclass(frozen=True)
class Compressed:
    """Shared K=V single-head attention over a `window` plus compressed entries of `ratio` tokens each;
    `topk`: a learned indexer selects that many entries (None: all causal entries)."""

    ratio: int
    window: int = 4
    topk: int | None = None


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    """`layers`: one `Attn` or `Compressed` per layer; the rest are the (tiny) dimensions. `index_heads` /
    `index_dim`: the indexer of sparse layers (`Compressed(topk=k)`)."""

    layers: tuple = (Attn(window=4, num_kv_heads=2), Attn(window=None), Compressed(ratio=4, window=4, topk=2))
    vocab_size: int = 64
    hidden: int = 32
    num_heads: int = 4
    head_dim: int = 8
    index_heads: int = 16
    index_dim: int = 4
    dtype: str = "float32"  # weights, activations and the cache ("float32" or "bfloat16")


def pool(kv: jax.Array, gate: jax.Array, ratio: int) -> jax.Array:
    """Softmax-gated pooling of each window of `ratio` rows: [B, T, W] -> [B, T // ratio, W]."""
    b, t, w = kv.shape
    n = t // ratio
    kv, gate = kv[:, : n * ratio].reshape(b, n, ratio, w), gate[:, : n * ratio].reshape(b, n, ratio, w)
    return hkv.numerics.fixed_sum(kv * hkv.numerics.softmax(gate, axis=2), axis=2).astype(kv.dtype)


def linear(x: jax.Array, layer: nnx.Linear) -> jax.Array:
    """`layer(x)` (no bias) through `hkv.numerics.linear`: the same bits for any number of rows."""
    return hkv.numerics.matmul(x, layer.kernel.value.astype(x.dtype)).astype(x.dtype)


class Layer(nnx.Module):
    def __init__(self, cfg: ToyConfig, kind, rngs: nnx.Rngs):
        self.kind, self.cfg = kind, cfg
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
        hd, d = cfg.hidden, cfg.head_dim
        self.hkv = kind.num_kv_heads if isinstance(kind, Attn) else 1
        self.wq, self.wo = lin(hd, cfg.num_heads * d), lin(cfg.num_heads * d, hd)
        self.wk = lin(hd, self.hkv * d)
        self.wv = lin(hd, self.hkv * d) if isinstance(kind, Attn) else None  # compressed layers: K = V
        self.up, self.down = lin(hd, 2 * hd), lin(2 * hd, hd)
        if isinstance(kind, Compressed):
            self.ckv, self.cgate = lin(hd, d), lin(hd, d)
        if isinstance(kind, Compressed) and kind.topk:
            self.iq, self.iw = lin(hd, cfg.index_heads * cfg.index_dim), lin(hd, cfg.index_heads)
            self.ikv, self.igate = lin(hd, cfg.index_dim), lin(hd, cfg.index_dim)

    def spec(self) -> hkv.LayerSpec:
        k, d = self.kind, self.cfg.head_dim
        if isinstance(k, Attn):
            return hkv.LayerSpec.attention(d, k.num_kv_heads, k.window)
        comp = hkv.CompressorSpec(k.ratio, d, d, overlap=False)
        idx = hkv.CompressorSpec(k.ratio, self.cfg.index_dim, self.cfg.index_dim, overlap=False) if k.topk else None
        return hkv.LayerSpec.attention(d, 1, k.window, shared_kv=True, compressor=comp, indexer=idx)

    def qkv(self, x):
        b, t, _ = x.shape
        q = linear(x, self.wq).reshape(b, t, -1, self.cfg.head_dim)
        k = linear(x, self.wk).reshape(b, t, self.hkv, self.cfg.head_dim)
        return q, k, (linear(x, self.wv).reshape(k.shape) if self.wv is not None else k)

    def indexer_q(self, x):
        b, t, _ = x.shape
        return linear(x, self.iq).reshape(b, t, self.cfg.index_heads, self.cfg.index_dim), linear(x, self.iw)

    def compressor_rows(self, h, which: str = "compressor"):
        """The compressor's (or its indexer's) projected kv and gate rows of h [B, T, hidden]."""
        if which == "indexer":
            return linear(h, self.ikv), linear(h, self.igate)
        return linear(h, self.ckv), linear(h, self.cgate)

    def finish(self, x, o):
        x = x + linear(o.reshape(*o.shape[:2], -1), self.wo)
        return x + linear(hkv.numerics.gelu_tanh(linear(norm(x), self.up)), self.down)

    def __call__(self, x):
        """Stateless layer over a whole sequence x [B, T, hidden]."""
        kind, h = self.kind, norm(x)
        q, k, v = self.qkv(h)
        t = jnp.arange(x.shape[1])
        entries = limit = picks = None
        if isinstance(kind, Compressed):
            m = kind.ratio
            entries = pool(*self.compressor_rows(h), m)  # [B, T // m, D]
            limit = jnp.broadcast_to(causal_entry_limit(t, m), (x.shape[0], x.shape[1]))
            if kind.topk:
                iq, iw = self.indexer_q(h)
                scores = indexer_scores(iq, iw, pool(*self.compressor_rows(h, "indexer"), m), self.cfg.index_dim)
                picks = select_topk(scores, limit, kind.topk)
        o = sequence_attention(q, k, v, window=kind.window, scale=self.cfg.head_dim**-0.5, entries=entries,
                               entry_limit=limit, picks=picks)  # fmt: skip
        return self.finish(x, o)


def norm(x):
    return hkv.numerics.mul(x, hkv.numerics.rms_scale(x, 1e-6).astype(x.dtype))


class ToyModel(nnx.Module):
    """A small hybrid model implementing `hkv.CachedModel`."""

    def __init__(self, cfg: ToyConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        # dtype: the activations' (nnx.Embed otherwise computes in float32 whatever its table's dtype:
        # bfloat16 weights gave float32 activations, and a cache the engine refuses)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.layers = nnx.List([Layer(cfg, kind, rngs) for kind in cfg.layers])
        self.head = nnx.Linear(cfg.hidden, cfg.vocab_size, use_bias=False, rngs=rngs)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def cache_spec(self, block_tokens: int = 16, model_id: str = "toy") -> hkv.CacheSpec:
        layers = tuple(layer.spec() for layer in self.layers)
        return hkv.CacheSpec(layers, dtype=self.cfg.dtype, block_tokens=block_tokens, model_id=model_id)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Stateless forward: int32[B, T] -> float32[B, T, vocab]."""
        x = self.embed(jnp.asarray(tokens, jnp.int32))
        for layer in self.layers:
            x = layer(x)
        return linear(norm(x), self.head).astype(jnp.float32)

    def cached_step(
        self,
        layout,
        cache,
        tokens,
        slots,
        n_valid,
        *,
        seal=True,
        kernel_backend=None,
        interpret=False,
        read_tokens=None,
        logit_rows=None,
        snapshots=None,
    ):
        """The same layers over `hkv.run_step`: each reads and writes its cache through `hkv.LayerCache`
        (read_tokens: `hkv.Step.read_tokens`; logit_rows: the rows whose logits to compute, `hkv.Step.head_rows`;
        snapshots: the interior block boundaries whose snapshots the step prepares, `hkv.InteriorSnapshots`)."""

        def forward(cache, step: hkv.Step):
            x = self.embed(step.tokens)
            for i, layer in enumerate(self.layers):
                kind, view, h = layer.kind, hkv.LayerCache(step, i), norm(x)
                q, k, v = layer.qkv(h)
                shared = isinstance(kind, Compressed)
                cache = view.write_kv(cache, k, None if shared else v)
                picks = None
                if shared:
                    fn = lambda kv, gate, *_, ratio=kind.ratio: pool(kv, gate, ratio)  # *_: first_token, no overlap
                    cache = view.compress(cache, *layer.compressor_rows(h), fn)
                    if kind.topk:
                        cache = view.compress(cache, *layer.compressor_rows(h, "indexer"), fn, which="indexer")
                        picks = view.index_topk(cache, *layer.indexer_q(h), kind.topk)
                o = view.attend(cache, q, k, None if shared else v, compressed=shared, picks=picks)
                x = layer.finish(x, o)
            return cache, linear(norm(step.head_rows(x)), self.head)

        return hkv.run_step(layout, cache, jnp.asarray(tokens), jnp.asarray(slots), jnp.asarray(n_valid), forward,
                            seal=seal, kernel_backend=kernel_backend, interpret=interpret,
                            read_tokens=read_tokens, logit_rows=logit_rows, snapshots=snapshots)  # fmt: skip


def init(config: ToyConfig = ToyConfig(), seed: int = 0) -> ToyModel:
    """A `ToyModel` with random weights (in `config.dtype`)."""
    model = ToyModel(config, nnx.Rngs(seed))
    if config.dtype != "float32":
        graphdef, state = nnx.split(model)
        state = jax.tree.map(lambda x: x.astype(config.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
        model = nnx.merge(graphdef, state)
    return model
