"""A toy hybrid-attention model written only against hkv's public API: the README's "bring your own model".

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
from hkv.core.layers import causal_entry_limit, indexer_scores, select_topk, selection_bias


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


def pool(kv: jax.Array, gate: jax.Array, ratio: int) -> jax.Array:
    """Softmax-gated pooling of each window of `ratio` rows: [B, T, W] -> [B, T // ratio, W]."""
    b, t, w = kv.shape
    n = t // ratio
    kv, gate = kv[:, : n * ratio].reshape(b, n, ratio, w), gate[:, : n * ratio].reshape(b, n, ratio, w)
    return jnp.sum(kv * jax.nn.softmax(gate.astype(jnp.float32), axis=2), axis=2).astype(kv.dtype)


def attention(q, keys, values, visible):
    """Plain softmax attention. q [B, T, H, D]; keys, values [B, S, Hkv, D]; visible bool[B, T, S]."""
    b, t, h, d = q.shape
    hkv_ = keys.shape[2]
    qg = q.reshape(b, t, hkv_, h // hkv_, d)
    logits = jnp.einsum("btkgd,bskd->btkgs", qg, keys) * d**-0.5
    logits = jnp.where(visible[:, :, None, None, :], logits, -jnp.inf)
    out = jnp.einsum("btkgs,bskd->btkgd", jax.nn.softmax(logits, axis=-1), values)
    return out.reshape(b, t, h, d)


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
        q = self.wq(x).reshape(b, t, -1, self.cfg.head_dim)
        k = self.wk(x).reshape(b, t, self.hkv, self.cfg.head_dim)
        return q, k, (self.wv(x).reshape(k.shape) if self.wv is not None else k)

    def indexer_q(self, x):
        b, t, _ = x.shape
        return self.iq(x).reshape(b, t, self.cfg.index_heads, self.cfg.index_dim), self.iw(x)

    def finish(self, x, o):
        x = x + self.wo(o.reshape(*o.shape[:2], -1))
        return x + self.down(jax.nn.gelu(self.up(norm(x))))

    def __call__(self, x):
        """Stateless layer over a whole sequence x [B, T, hidden]."""
        kind, h = self.kind, norm(x)
        q, k, v = self.qkv(h)
        t = jnp.arange(x.shape[1])
        visible = (t[None, :] <= t[:, None]) & ((t[None, :] > t[:, None] - kind.window) if kind.window else True)
        visible = jnp.broadcast_to(visible, (x.shape[0],) + visible.shape)
        if isinstance(kind, Compressed):
            m = kind.ratio
            entries = pool(self.ckv(h), self.cgate(h), m)[:, :, None, :]  # [B, T // m, 1, D]
            n = entries.shape[1]
            limit = jnp.broadcast_to(causal_entry_limit(t, m), (x.shape[0], x.shape[1]))
            seen = jnp.arange(n)[None, None, :] < limit[..., None]
            if kind.topk:
                iq, iw = self.indexer_q(h)
                scores = indexer_scores(iq, iw, pool(self.ikv(h), self.igate(h), m), self.cfg.index_dim)
                seen = selection_bias(select_topk(scores, limit, kind.topk), n) == 0
            k, v = jnp.concatenate([k, entries], 1), jnp.concatenate([v, entries], 1)
            visible = jnp.concatenate([visible, seen], -1)
        return self.finish(x, attention(q, k, v, visible))


def norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class ToyModel(nnx.Module):
    """A small hybrid model implementing `hkv.CachedModel`."""

    def __init__(self, cfg: ToyConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, rngs=rngs)
        self.layers = nnx.List([Layer(cfg, kind, rngs) for kind in cfg.layers])
        self.head = nnx.Linear(cfg.hidden, cfg.vocab_size, use_bias=False, rngs=rngs)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def cache_spec(self, block_tokens: int = 16, model_id: str = "toy") -> hkv.CacheSpec:
        layers = tuple(layer.spec() for layer in self.layers)
        return hkv.CacheSpec(layers, dtype="float32", block_tokens=block_tokens, model_id=model_id)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Stateless forward: int32[B, T] -> float32[B, T, vocab]."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(norm(x)).astype(jnp.float32)

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
    ):
        """The same layers over `hkv.run_step`: each reads and writes its cache through `hkv.LayerCache`
        (read_tokens: `hkv.Step.read_tokens`)."""

        def forward(cache, step: hkv.Step):
            x = self.embed(step.tokens)
            for i, layer in enumerate(self.layers):
                kind, view, h = layer.kind, hkv.LayerCache(step, i), norm(x)
                q, k, v = layer.qkv(h)
                shared = isinstance(kind, Compressed)
                cache = view.write_kv(cache, k, None if shared else v)
                picks = None
                if shared:
                    fn = lambda kv, gate, *_: pool(kv, gate, kind.ratio)  # noqa: E731  (first_token, no overlap)
                    cache = view.compress(cache, layer.ckv(h), layer.cgate(h), fn)
                    if kind.topk:
                        cache = view.compress(cache, layer.ikv(h), layer.igate(h), fn, which="indexer")
                        picks = view.index_topk(cache, *layer.indexer_q(h), kind.topk)
                o = view.attend(cache, q, k, None if shared else v, compressed=shared, picks=picks)
                x = layer.finish(x, o)
            return cache, self.head(norm(x))

        return hkv.run_step(layout, cache, jnp.asarray(tokens), jnp.asarray(slots), jnp.asarray(n_valid), forward,
                            seal=seal, kernel_backend=kernel_backend, interpret=interpret, read_tokens=read_tokens)  # fmt: skip


def init(config: ToyConfig = ToyConfig(), seed: int = 0) -> ToyModel:
    """A `ToyModel` with random weights."""
    return ToyModel(config, nnx.Rngs(seed))
