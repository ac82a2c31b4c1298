"""Gemma 3 (text) in Flax NNX and its stateless forward.

`Gemma3(cfg, tensors, dtype)` builds the model from canonical tensors (transformers' `Gemma3ForCausalLM`
names without the `model.` prefix, see `expected_tensors`); `init(cfg, seed)` makes random ones;
`checkpoint.load(path)` reads an HF directory. `model(tokens int32[B, T]) -> float32[B, T, vocab]`
recomputes every position from the whole prefix; no cache is involved.

Pieces a cached path reuses (the same math, layer by layer):
    model.embed(tokens)                        int32[B, T] -> [B, T, hidden] (scaled by sqrt(hidden))
    model.rope_tables(positions)               {layer_type: (cos, sin) float32[B, T, head_dim]}
    layer = model.layers[i]; layer.layer_type  "sliding_attention" | "full_attention"
    layer.attn.project_qkv(layer.input_norm(x), cos, sin) -> q [B,T,H,D], k/v [B,T,Hkv,D] (normed, roped)
    dense_attention(q, k, v, mask, cfg.scaling)            -> o [B,T,H,D]  (or a paged kernel)
    x = x + layer.post_attention_norm(layer.attn.project_output(o))
    x = layer.ffn_block(x)                     pre-ffn norm, gated GELU-tanh MLP, post-ffn norm, residual
    model.logits(x)                            final norm, tied head, final softcap -> float32[B, T, vocab]
    attention_mask(q_pos, k_pos, window)       bool mask; `window` = tokens attended incl. the current one

Numerics follow transformers 5.24 `modeling_gemma3.py`: every RMSNorm computes in float32 as
`x * rsqrt(mean(x^2) + eps) * (1 + w)` and casts to the activation dtype; cos/sin are computed in
float32 and cast to the activation dtype; attention probabilities are a float32 softmax cast back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hkv import numerics
from hkv.core.kv_quant import round_rows
from hkv.core.layers import masked_attention
from models.layer_stack import LayerStack, run_layers
from models.placement import put
from models.stateless import forward_fn, greedy_stateless  # noqa: F401 (re-exported)

from .cache_spec import cache_spec
from .cached import cached_step
from .config import FULL, LAYER_TYPES, SLIDING, Gemma3Config

# ------------------------------------------------------------------ functions


def gemma_rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """Gemma RMSNorm over the last axis: float32 `x * rsqrt(mean(x^2) + eps) * (1 + w)`, cast to x.dtype
    (the mean and rsqrt of `hkv.numerics`, one order for every path)."""
    x32 = x.astype(jnp.float32)
    y = x32 * numerics.rms_scale(x32, eps)
    return numerics.mul(y, 1.0 + weight.astype(jnp.float32)).astype(x.dtype)


def dense(x: jnp.ndarray, kernel: jnp.ndarray) -> jnp.ndarray:
    """y = x @ kernel with a kernel held [in, out] (a checkpoint's [out, in] weight transposed once at
    load); x [..., in] -> [..., out] in x.dtype (`hkv.numerics.matmul`: float32 accumulation, the same
    bits for any number of rows). A decode step's few rows read a weight held this way ~1.7x faster
    on XLA:CPU than through `linear`'s transposed operand (benchmarks/README.md, e2e_gemma3.py)."""
    return numerics.matmul(x, kernel.astype(x.dtype)).astype(x.dtype)


def kernel_param(dtype, *weights) -> nnx.Param:
    """Checkpoint weights [out_i, in] as one [in, sum(out_i)] kernel that `dense` reads (outputs in
    the order given). One product of the joined kernel replaces a product per weight: a decode step
    reads all of them in one pass (q/k/v, gate/up)."""
    if isinstance(weights[0], jax.ShapeDtypeStruct):  # an abstract model (`models.memory_plan`)
        joined = jax.ShapeDtypeStruct((weights[0].shape[1], sum(w.shape[0] for w in weights)), weights[0].dtype)
        return nnx.Param(put(joined, dtype))
    return nnx.Param(put(np.concatenate([np.asarray(w) for w in weights]).T, dtype))


def cos_sin(positions: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions int[...] -> (cos, sin) float32[..., 2 * len(inv_freq)] (frequencies repeated for both halves)."""
    angles = numerics.mul(positions.astype(jnp.float32)[..., None], jnp.asarray(inv_freq, jnp.float32))
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate-half RoPE: x [B, T, H, D] with cos/sin [B, T, D] (float32; cast to x.dtype first, as transformers)."""
    cos = cos.astype(x.dtype)[:, :, None, :]
    sin = sin.astype(x.dtype)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return numerics.mul(x, cos) + numerics.mul(rotated, sin)


def attention_mask(q_pos: jnp.ndarray, k_pos: jnp.ndarray, window: int | None = None) -> jnp.ndarray:
    """bool[..., Tq, Tk]: causal, and for a sliding layer only the last `window` tokens including the current
    one (`q - window < k <= q`, transformers' sliding_window semantics). q_pos [..., Tq], k_pos [..., Tk]."""
    q = q_pos[..., :, None]
    k = k_pos[..., None, :]
    mask = k <= q
    if window is not None:
        mask = mask & (k > q - window)
    return mask


def dense_attention(
    q: jnp.ndarray,
    k: jnp.ndarray,
    v: jnp.ndarray,
    mask: jnp.ndarray,
    scale: float,
    softcap: float | None = None,
) -> jnp.ndarray:
    """Plain GQA attention. q [B, T, H, D], k/v [B, S, Hkv, D], mask bool broadcastable to [B, T, S]
    (True = visible; every row needs >= 1 visible key) -> o [B, T, H, D] in q.dtype.

    Scores accumulate in float32, optional tanh softcap, a float32 softmax whose probabilities are cast
    to v.dtype for the value product — in the numerical contract's order
    (`hkv.core.layers.masked_attention`: key k at position k of a tile grid), so hkv's cached steps
    reproduce it bit for bit."""
    return masked_attention(q, k, v, mask, scale=scale, softcap=softcap)


# ------------------------------------------------------------------- modules


class Attention(nnx.Module):
    """Gemma 3 self-attention weights (`layers.N.self_attn.*`): the q/k/v projections joined into one
    kernel `qkv_proj` [hidden, (H + 2 Hkv) * D], `o_proj` [H * D, hidden] (kernels held [in, out], see
    `dense` and `kernel_param`) and the q/k RMSNorms."""

    def __init__(self, cfg: Gemma3Config, layer: int, tensors: dict, dtype):
        p = f"layers.{layer}.self_attn."
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.kv_quant = cfg.kv_quant_spec()  # the cache's row format (the stateless forward rounds K and V to it)
        # q, k and v projections joined: [hidden, (H + 2 Hkv) * D]
        self.qkv_proj = kernel_param(dtype, *(tensors[p + n + "_proj.weight"] for n in "qkv"))
        self.o_proj = kernel_param(dtype, tensors[p + "o_proj.weight"])
        self.q_norm = nnx.Param(put(tensors[p + "q_norm.weight"], dtype))
        self.k_norm = nnx.Param(put(tensors[p + "k_norm.weight"], dtype))

    def project_qkv(self, x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray):
        """Normed hidden x [B, T, hidden] -> q [B, T, H, D], k [B, T, Hkv, D] (q/k-normed, roped), v [B, T, Hkv, D]."""
        b, t, _ = x.shape
        qkv = dense(x, self.qkv_proj.value)
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[..., :nq].reshape(b, t, self.num_heads, self.head_dim)
        k = qkv[..., nq : nq + nkv].reshape(b, t, self.num_kv_heads, self.head_dim)
        v = qkv[..., nq + nkv :].reshape(b, t, self.num_kv_heads, self.head_dim)
        q = apply_rope(gemma_rms_norm(q, self.q_norm.value, self.eps), cos, sin)
        k = apply_rope(gemma_rms_norm(k, self.k_norm.value, self.eps), cos, sin)
        return q, k, v

    def project_output(self, o: jnp.ndarray) -> jnp.ndarray:
        """Attention output o [B, T, H, D] -> [B, T, hidden]."""
        return dense(o.reshape(*o.shape[:2], -1), self.o_proj.value)


class MLP(nnx.Module):
    """Gated GELU-tanh MLP (`layers.N.mlp.{gate,up,down}_proj`): `gate_up_proj` [hidden, 2 * intermediate]
    (gate then up, joined) and `down_proj` [intermediate, hidden], kernels held [in, out] (`dense`)."""

    def __init__(self, cfg: Gemma3Config, layer: int, tensors: dict, dtype):
        p = f"layers.{layer}.mlp."
        self.gate_up_proj = kernel_param(dtype, tensors[p + "gate_proj.weight"], tensors[p + "up_proj.weight"])
        self.down_proj = kernel_param(dtype, tensors[p + "down_proj.weight"])

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        gate_up = dense(x, self.gate_up_proj.value)
        inner = gate_up.shape[-1] // 2
        gate = numerics.gelu_tanh(gate_up[..., :inner])
        return dense(gate * gate_up[..., inner:], self.down_proj.value)


class DecoderLayer(nnx.Module):
    """One Gemma 3 block (sandwich norms around attention and around the MLP)."""

    def __init__(self, cfg: Gemma3Config, layer: int, tensors: dict, dtype):
        p = f"layers.{layer}."
        self.layer_type = cfg.layer_types[layer]
        self.window = cfg.window if self.layer_type == SLIDING else None
        self.eps = cfg.rms_norm_eps
        self.scaling = cfg.scaling
        norm = {n: nnx.Param(put(tensors[p + n + ".weight"], dtype)) for n in _LAYER_NORMS}
        self.input_layernorm = norm["input_layernorm"]
        self.post_attention_layernorm = norm["post_attention_layernorm"]
        self.pre_feedforward_layernorm = norm["pre_feedforward_layernorm"]
        self.post_feedforward_layernorm = norm["post_feedforward_layernorm"]
        self.attn = Attention(cfg, layer, tensors, dtype)
        self.mlp = MLP(cfg, layer, tensors, dtype)

    def input_norm(self, x: jnp.ndarray) -> jnp.ndarray:
        return gemma_rms_norm(x, self.input_layernorm.value, self.eps)

    def post_attention_norm(self, x: jnp.ndarray) -> jnp.ndarray:
        return gemma_rms_norm(x, self.post_attention_layernorm.value, self.eps)

    def ffn_block(self, x: jnp.ndarray) -> jnp.ndarray:
        """Residual MLP half: x + post_ffn_norm(mlp(pre_ffn_norm(x)))."""
        h = self.mlp(gemma_rms_norm(x, self.pre_feedforward_layernorm.value, self.eps))
        return x + gemma_rms_norm(h, self.post_feedforward_layernorm.value, self.eps)

    def __call__(self, x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
        """Stateless: x [B, T, hidden], cos/sin [B, T, D] of this layer's type, mask bool [B, T, T]."""
        q, k, v = self.attn.project_qkv(self.input_norm(x), cos, sin)
        # the values the cache holds: each head's rows rounded tile by tile (tiles never cross heads)
        k, v = (round_rows(self.attn.kv_quant, a.reshape(*a.shape[:2], -1)).reshape(a.shape) for a in (k, v))
        o = dense_attention(q, k, v, mask, self.scaling)
        x = x + self.post_attention_norm(self.attn.project_output(o))
        return self.ffn_block(x)


_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class Gemma3(nnx.Module):
    """Gemma 3 causal LM (text). `model(tokens int32[B, T]) -> float32[B, T, vocab]` (stateless)."""

    def __init__(self, cfg: Gemma3Config, tensors: dict, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        # The head is held [hidden, vocab] (`dense`). Tied (every Gemma 3 release): the embedding table is
        # held only so, and `embed` reads its columns; untied: the table [vocab, hidden] beside it.
        if cfg.tie_word_embeddings:
            self.embed_tokens = None
            self.lm_head = kernel_param(dtype, tensors["embed_tokens.weight"])
        else:
            self.embed_tokens = nnx.Param(put(tensors["embed_tokens.weight"], dtype))
            self.lm_head = kernel_param(dtype, tensors["lm_head.weight"])
        self.norm = nnx.Param(put(tensors["norm.weight"], dtype))
        # repeating runs of layers (5 sliding : 1 full) are held stacked so that steps scan them;
        # `self.layers[i]` is still layer i (`models.layer_stack.LayerStack`)
        self.layers = LayerStack([DecoderLayer(cfg, i, tensors, dtype) for i in range(cfg.num_hidden_layers)])
        # float32(sqrt(hidden)) cast to the weight dtype (transformers' embed_scale buffer; 55.4256 -> 55.5 in bf16)
        self._embed_scale = float(np.float32(cfg.hidden_size**0.5))
        # Static (hashable) float32 inverse frequencies per layer type; exact round trip via float.
        self._freqs = tuple((t, tuple(float(v) for v in cfg.rope[t].inv_freq(cfg.head_dim))) for t in LAYER_TYPES)

    @property
    def freqs(self) -> dict[str, np.ndarray]:
        """{layer_type: float32[head_dim // 2]} inverse RoPE frequencies (linear scaling already applied)."""
        return {t: np.asarray(v, np.float32) for t, v in self._freqs}

    # ------------------------------------------------------------ shared pieces
    def rope_tables(self, positions: jnp.ndarray) -> dict[str, tuple[jnp.ndarray, jnp.ndarray]]:
        """positions int32[B, T] -> {"sliding_attention" | "full_attention": (cos, sin) float32[B, T, head_dim]}."""
        return {t: cos_sin(positions, f) for t, f in self.freqs.items()}

    def embed(self, tokens: jnp.ndarray) -> jnp.ndarray:
        """int32[B, T] -> [B, T, hidden] in the model dtype, scaled by sqrt(hidden) (in that dtype)."""
        if self.embed_tokens is None:  # tied: the table's rows are the head kernel's columns
            rows = jnp.moveaxis(self.lm_head.value[:, tokens], 0, -1)
        else:
            rows = self.embed_tokens.value[tokens]
        return numerics.mul(rows, jnp.asarray(self._embed_scale, jnp.float32).astype(rows.dtype))

    def logits(self, x: jnp.ndarray) -> jnp.ndarray:
        """Final hidden [B, T, hidden] -> float32[B, T, vocab]: final norm, (tied) head, final softcap."""
        h = gemma_rms_norm(x, self.norm.value, self.cfg.rms_norm_eps)
        out = dense(h, self.lm_head.value)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            out = jnp.tanh(out / cap) * cap
        return out.astype(jnp.float32)

    # ------------------------------------------------------------ hkv.CachedModel
    @property
    def vocab_size(self) -> int:
        """Token ids lie in [0, vocab_size) (`hkv.CachedModel`)."""
        return self.cfg.vocab_size

    def cache_spec(self, block_tokens: int = 16, model_id: str = "unknown"):
        """The `hkv.CacheSpec` of this model (storage dtype = the model dtype), see `cache_spec.cache_spec`."""
        return cache_spec(self.cfg, dtype=self.dtype.name, block_tokens=block_tokens, model_id=model_id)

    def cached_step(self, layout, cache, tokens, slots, n_valid, **options):
        """One cached step through hkv (`hkv.CachedModel.cached_step`), see `cached.cached_step`
        (options: kernel_backend, interpret, seal, scan_layers, read_tokens)."""
        return cached_step(self, layout, cache, tokens, slots, n_valid, **options)

    def check_tokens(self, tokens) -> None:
        """Raise ValueError for token ids outside [0, vocab_size) or a bad shape (host-side check)."""
        arr = np.asarray(tokens)
        if arr.ndim != 2:
            raise ValueError(f"tokens.shape={arr.shape} must be [batch, T]")
        if arr.size and (arr.min() < 0 or arr.max() >= self.cfg.vocab_size):
            raise ValueError(
                f"token ids range [{arr.min()}, {arr.max()}] must lie in [0, vocab_size={self.cfg.vocab_size})"
            )

    # ---------------------------------------------------------------- forward
    def __call__(self, tokens: jnp.ndarray, *, scan_layers: bool | None = None) -> jnp.ndarray:
        """Stateless forward: int32[B, T] -> float32[B, T, vocab]. Position t sees tokens [0, t]
        (sliding layers: the last `cfg.window` of them, t included).

        scan_layers: run repeating layers under one `jax.lax.scan` over their stacked weights (None:
        `models.layer_stack.SCAN_LAYERS`, True; False: a Python loop over the layers)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
        rope = self.rope_tables(positions)
        masks = {
            FULL: attention_mask(positions, positions),
            SLIDING: attention_mask(positions, positions, self.cfg.window),
        }

        def one(layer, x):
            cos, sin = rope[layer.layer_type]
            return layer(x, cos, sin, masks[layer.layer_type])

        x = run_layers(self, self.embed(tokens), one, scan_layers)
        return self.logits(x)


# ------------------------------------------------------------------- tensors


def expected_tensors(cfg: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Canonical tensor names (transformers' Gemma3ForCausalLM names without `model.`) -> shape."""
    h, d, hid = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, hid), "norm.weight": (hid,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, hid)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (h * d, hid)
        out[p + "self_attn.k_proj.weight"] = (cfg.num_key_value_heads * d, hid)
        out[p + "self_attn.v_proj.weight"] = (cfg.num_key_value_heads * d, hid)
        out[p + "self_attn.o_proj.weight"] = (hid, h * d)
        out[p + "self_attn.q_norm.weight"] = (d,)
        out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, hid)
        out[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, hid)
        out[p + "mlp.down_proj.weight"] = (hid, cfg.intermediate_size)
        for n in _LAYER_NORMS:
            out[p + n + ".weight"] = (hid,)
    return out


def random_tensors(cfg: Gemma3Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random canonical float32 tensors: normal(0, 0.02) matrices, normal(0, 0.1) norm weights (Gemma norms
    scale by 1 + w, so transformers' zero init would hide a missing `1 +`). Deterministic in `seed`."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_tensors(cfg).items():
        std = 0.1 if name.endswith("norm.weight") else 0.02
        out[name] = rng.normal(0.0, std, shape).astype(np.float32)
    return out


def init(cfg: Gemma3Config, seed: int = 0, dtype=jnp.float32) -> Gemma3:
    """A Gemma 3 with random weights (see `random_tensors`), e.g. `init(tiny_config(), 0)`."""
    return Gemma3(cfg, random_tensors(cfg, seed), dtype)
