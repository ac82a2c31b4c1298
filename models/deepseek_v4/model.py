"""The DeepSeek-V4 model in Flax NNX and its stateless forward — the definition of truth for hkv.

`DeepseekV4(cfg, tensors, dtype)` builds the model from canonical checkpoint tensors (see
`tensor_layout.py`); `init(cfg, seed)` makes random ones; `load(path)` reads an HF-format directory.
Calling the model on int32[B, T] token ids returns float32[B, T, vocab] logits; no cache is
involved, every position is computed from the whole prefix. It is jit-compatible (`forward_fn`).

Numerics follow transformers 5.24 `modeling_deepseek_v4.py`: norms, hyper-connections, sinks,
compressor position biases and the router bias stay float32 whatever `dtype` the rest has.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models.placement import OnMesh, placing, put
from models.stateless import forward_fn, greedy_stateless  # noqa: F401 (re-exported)

from .attention import Attention
from .cache_spec import cache_spec
from .cached import cached_step
from .config import DeepseekV4Config
from .hyper_connection import HyperConnection, HyperHead, merge
from .layer_scan import LayerStack, stateless_layers
from .moe import EXPERT_AXIS, MoE, splits
from .norms import linear, rms_norm
from .quant_format import KEPT_QUANTIZED, QuantizedTensor, host_dense
from .quantized import quantized_or_param, weight
from .rope import cos_sin, inv_freq
from .tensor_layout import INT, expected_tensors

# Tensor/expert parallelism over a mesh's model axis: weight name (last two path parts) -> split dim.
# Linear weights are [out, in]; negative dims stay right when layers are stacked for a scan.
_TP_DIMS = {
    ("attn", "wq_b"): -2,  # query heads (column parallel)
    ("attn", "attn_sink"): -1,  # one sink per query head
    ("attn", "wo_a"): -2,  # the grouped output projection: groups x rank
    ("attn", "wo_b"): -1,  # its input: groups x rank (row parallel: one all-reduce)
    ("ffn", "w_up"): -3,  # routed experts (expert parallel)
    ("ffn", "w_gate"): -3,
    ("ffn", "w_down"): -3,
}


def tensor_parallel_dim(path: str, shape: tuple[int, ...]) -> int | None:
    """The dimension of the weight at `path` (e.g. "layers.groups.1.0.attn.wq_b"; a stacked run's leaves
    are [repetitions, ...], so dims count from the end) that tensor/expert parallelism splits, or None
    to replicate it: query heads and their sinks, the grouped output
    projection, the routed experts, and the embedding and head (by vocabulary rows: `embed_lookup`) are
    split; the single shared K=V head (`wkv`), the compressors,
    the indexer (its head sum is a fixed-order tree, which a split would turn into cross-device
    permutes inside the decode loop), norms, hyper-connections and the shared expert are
    replicated (the cache they produce is replicated within a data shard)."""
    parts = tuple(path.split("."))
    if len(parts) >= 2 and parts[-1] in ("data", "scale") and (parts[-3:-1] in _TP_DIMS or parts[:-1] == ("head",)):
        parts = parts[:-1]  # a quantized weight's data and scale grid split along the same dim
    if parts in (("embed",), ("head",)):  # vocab parallel: [vocab, hidden] split by vocabulary rows
        return -2 if len(shape) == 2 else None
    dim = _TP_DIMS.get(parts[-2:]) if len(parts) >= 2 else None
    if dim is None or len(shape) < -dim:
        return None
    return dim


_EXPERT_STACKS = (("ffn", "w_up"), ("ffn", "w_gate"), ("ffn", "w_down"))


def expert_parallel_dim(path: str, shape: tuple[int, ...]) -> int | None:
    """The expert dimension of the routed-expert stack at `path` ([E, ...], or [repetitions, E, ...]
    in a stacked run; a quantized stack's ".data" and ".scale" alike), or None for any other weight:
    what `hkv.MeshEngine(..., expert_axes=...)` splits over several mesh axes."""
    parts = tuple(path.split("."))
    if parts and parts[-1] in ("data", "scale"):
        parts = parts[:-1]
    if parts[-2:] not in _EXPERT_STACKS or len(shape) < 3:
        return None
    return _TP_DIMS[parts[-2:]]


def embed_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """table[tokens]: table [vocab, hidden], tokens int[...] -> [..., hidden]. Traced under a mesh whose
    "model" axis divides the vocabulary (the table split by rows, `tensor_parallel_dim`), each device
    looks up the tokens its rows hold and an all-gather over "model" hands every device each token's
    row from its owner: exact (a copy), and no device gathers the whole table."""
    mesh = jax.sharding.get_abstract_mesh()
    axis = EXPERT_AXIS
    if not splits(mesh, table.shape[0]):
        return table[tokens]
    rows = table.shape[0] // mesh.shape[axis]

    def on_device(table, tokens):
        first = jax.lax.axis_index(axis) * rows
        local = table[jnp.clip(tokens - first, 0, rows - 1)]  # [..., hidden]; other devices' tokens: any row
        every = jax.lax.all_gather(local, axis)  # [m, ..., hidden]
        owner = (tokens // rows).astype(jnp.int32)
        return jnp.take_along_axis(every, owner[None, ..., None], axis=0)[0]

    return jax.shard_map(
        on_device, mesh=mesh, in_specs=(P(axis, None), P()), out_specs=P(), axis_names={axis}, check_vma=False
    )(table, tokens)


class DecoderLayer(nnx.Module):
    """Attention block and MoE block, each wrapped by a hyper-connection (weights under `layers.N.`)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, tensors: dict, dtype):
        p = f"layers.{layer}."
        hc = dict(hc_mult=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps
        self.attn_norm = nnx.Param(put(tensors[p + "attn_norm.weight"], jnp.float32))
        self.ffn_norm = nnx.Param(put(tensors[p + "ffn_norm.weight"], jnp.float32))
        self.hc_attn = HyperConnection(
            tensors[p + "hc_attn_fn"], tensors[p + "hc_attn_base"], tensors[p + "hc_attn_scale"], **hc
        )
        self.hc_ffn = HyperConnection(
            tensors[p + "hc_ffn_fn"], tensors[p + "hc_ffn_base"], tensors[p + "hc_ffn_scale"], **hc
        )
        self.attn = Attention(cfg, layer, tensors, dtype)
        self.ffn = MoE(cfg, layer, tensors, dtype)

    def ffn_block(self, streams: jnp.ndarray, token_ids: jnp.ndarray) -> jnp.ndarray:
        """The MoE half of the layer: streams [B, T, N, hidden] -> new streams."""
        post, comb, collapsed = self.hc_ffn(streams)
        out = self.ffn(rms_norm(collapsed, self.ffn_norm.value, self.eps), token_ids)
        return merge(post, comb, out, streams)

    def __call__(self, streams, token_ids, positions, rope, freqs):
        post, comb, collapsed = self.hc_attn(streams)
        out = self.attn(rms_norm(collapsed, self.attn_norm.value, self.eps), positions, rope, freqs)
        streams = merge(post, comb, out, streams)
        return self.ffn_block(streams, token_ids)


class DeepseekV4(nnx.Module):
    """DeepSeek-V4 causal LM. `model(tokens int32[B, T]) -> float32[B, T, vocab]` (stateless)."""

    def __init__(self, cfg: DeepseekV4Config, tensors: dict, dtype=jnp.float32):
        """Args:
        cfg: the config.
        tensors: canonical name -> array (`expected_tensors(cfg)`), or `QuantizedTensor` for weights a
          checkpoint stores quantized: linear weights (`quant_format.KEPT_QUANTIZED`) stay quantized on
          the device (`quantized.QuantizedLinear`), any other is dequantized here.
        dtype: the dtype of the weights and activations (norms, mHC, sinks, biases stay float32).
        """
        tensors = {
            k: host_dense(v) if isinstance(v, QuantizedTensor) and not KEPT_QUANTIZED.match(k) else v
            for k, v in tensors.items()
        }
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed = nnx.Param(put(tensors["embed.weight"], dtype, "embed"))
        head = tensors["embed.weight"] if cfg.tie_word_embeddings else tensors["head.weight"]
        self.head = quantized_or_param(head, dtype, "head")
        self.norm = nnx.Param(put(tensors["norm.weight"], jnp.float32))
        self.hc_head = HyperHead(
            tensors["hc_head_fn"],
            tensors["hc_head_base"],
            tensors["hc_head_scale"],
            eps=cfg.hc_eps,
            norm_eps=cfg.rms_norm_eps,
        )
        # repeating runs of layers are held stacked (one module per period position, a leading axis per
        # repetition) so that steps scan them; `self.layers[i]` is still layer i (`layer_scan.LayerStack`)
        self.layers = LayerStack([DecoderLayer(cfg, i, tensors, dtype) for i in range(cfg.num_hidden_layers)])
        # Static (hashable) copies of the float32 inverse frequencies; exact round trip via float.
        self._freqs = tuple((fam, tuple(float(v) for v in inv_freq(cfg, fam))) for fam in ("main", "compress"))

    @property
    def freqs(self) -> dict[str, np.ndarray]:
        """{"main" | "compress": float32[rope_dim // 2]} inverse RoPE frequencies."""
        return {fam: np.asarray(v, np.float32) for fam, v in self._freqs}

    # ------------------------------------------------------------ shared pieces
    def rope_tables(self, positions: jnp.ndarray) -> dict[str, tuple[jnp.ndarray, jnp.ndarray]]:
        """positions int32[B, T] -> {family: (cos, sin)} float32[B, T, rope_dim // 2]."""
        return {
            fam: cos_sin(positions, self.freqs[fam], self.cfg.rope_for[fam].attention_factor)
            for fam in ("main", "compress")
        }

    def embed_streams(self, tokens: jnp.ndarray) -> jnp.ndarray:
        """int32[B, T] -> residual streams [B, T, hc_mult, hidden]."""
        x = embed_lookup(self.embed.value, tokens)
        return jnp.broadcast_to(x[:, :, None, :], x.shape[:2] + (self.cfg.hc_mult, x.shape[-1]))

    def logits(self, streams: jnp.ndarray) -> jnp.ndarray:
        """Final streams [B, T, N, hidden] -> float32[B, T, vocab]."""
        h = rms_norm(self.hc_head(streams), self.norm.value, self.cfg.rms_norm_eps)
        return linear(h, weight(self.head)).astype(jnp.float32)

    @property
    def vocab_size(self) -> int:
        """Token ids lie in [0, vocab_size) (`hkv.CachedModel`)."""
        return self.cfg.vocab_size

    def check_tokens(self, tokens) -> None:
        """Raise ValueError for token ids outside [0, vocab_size) or a bad shape (host-side check)."""
        arr = np.asarray(tokens)
        if arr.ndim != 2:
            raise ValueError(f"tokens.shape={arr.shape} must be [batch, T]")
        if arr.size and (arr.min() < 0 or arr.max() >= self.cfg.vocab_size):
            raise ValueError(
                f"token ids range [{arr.min()}, {arr.max()}] must lie in [0, vocab_size={self.cfg.vocab_size})"
            )

    # The module functions themselves, not bound methods: `hkv.MeshEngine` keys its shared programs
    # by them (`WeightSplit`), and a bound method would keep this model alive in that cache and make
    # two models of one structure look different.
    tensor_parallel_dim = staticmethod(tensor_parallel_dim)
    """(path, shape) -> the dimension of that weight split over a mesh's model axis, or None."""

    def lockstep_axes(self) -> tuple[str, ...]:
        """The manual mesh axes this trace's routed experts are split over (`moe.data_split`: a per-
        data-shard program of `hkv.MeshEngine(..., expert_axes=(data, ...))`), else (): the shards of
        these axes must run every step together (`hkv.core.protocol.lockstep_axes`)."""
        mesh = jax.sharding.get_abstract_mesh()
        for _, node in nnx.iter_graph(self):
            if isinstance(node, MoE):
                return node.data_axes(mesh)
        return ()

    expert_parallel_dim = staticmethod(expert_parallel_dim)
    """(path, shape) -> the expert dimension of a routed-expert stack (`expert_axes` split it), else None."""

    # -------------------------------------------------------------- cached path
    def cache_spec(self, block_tokens: int = 16, model_id: str = "unknown"):
        """The `hkv.CacheSpec` of this model (storage in the model's dtype)."""
        return cache_spec(self.cfg, dtype=self.dtype.name, block_tokens=block_tokens, model_id=model_id)

    def cached_step(self, layout, cache, tokens, slots, n_valid, **options):
        """One prefill chunk or decode step through the hkv cache; see `models.deepseek_v4.cached`
        (options: kernel_backend, interpret, seal, scan_layers, read_tokens)."""
        return cached_step(self, layout, cache, tokens, slots, n_valid, **options)

    # ---------------------------------------------------------------- forward
    def __call__(self, tokens: jnp.ndarray, *, scan_layers: bool | None = None) -> jnp.ndarray:
        """Stateless forward: int32[B, T] -> float32[B, T, vocab]. Position t sees tokens [0, t].

        scan_layers: run repeating layers under one `jax.lax.scan` over their stacked weights (None:
        `layer_scan.SCAN_LAYERS`, True; False: a Python loop; see `models.deepseek_v4.layer_scan`)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
        rope = self.rope_tables(positions)
        streams = self.embed_streams(tokens)
        streams = stateless_layers(self, streams, tokens, positions, rope, scan_layers)
        return self.logits(streams)


def random_tensors(cfg: DeepseekV4Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random canonical tensors for `cfg` (float32), initialised like transformers' `_init_weights`:
    normal(0, 0.02) for matrices, ones for norm weights and mHC scales, zeros for biases, sinks and
    position biases, and a random token->expert table for hash layers. Deterministic in `seed`."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, (shape, kind) in expected_tensors(cfg).items():
        if kind == INT:  # tid2eid: k distinct experts per token
            perm = np.argsort(rng.random((shape[0], cfg.n_routed_experts)), axis=1)
            out[name] = perm[:, : shape[1]].astype(np.int64)
        elif name.endswith("norm.weight") or name.endswith("_scale"):
            out[name] = np.ones(shape, np.float32)
        elif name.endswith(("_base", "attn_sink", ".ape", "gate.bias")):
            out[name] = np.zeros(shape, np.float32)
        else:
            out[name] = rng.normal(0.0, 0.02, shape).astype(np.float32)
    return out


def init(cfg: DeepseekV4Config, seed: int = 0, dtype=jnp.float32) -> DeepseekV4:
    """A DeepSeek-V4 with random weights (see `random_tensors`), e.g. `init(tiny_config(), 0)`."""
    return DeepseekV4(cfg, random_tensors(cfg, seed), dtype)


def load(
    path: str | os.PathLike,
    dtype=jnp.bfloat16,
    progress: Callable[[str], None] | None = None,
    *,
    dequantize: bool = False,
    mesh: Mesh | None = None,
    model_axis: str = "model",
    progress_bars: bool | None = None,
    expert_axes: Sequence[str] = (),
) -> DeepseekV4:
    """Load an HF-format DeepSeek-V4 directory (`config.json` + `*.safetensors`, sharded or not).

    Tensor names may follow the original DeepSeek release, transformers' `save_pretrained`, or
    transformers' in-memory names. FP8 (block-scaled e4m3) and FP4 (e2m1 experts) linear weights stay
    quantized on the device (`quantized.QuantizedLinear`: the stored values and scale grid, dequantized
    inside each step, the same bits as dequantizing here); with `dequantize=True` they are dequantized
    on load instead, as plain weights in `dtype`. Other quantizations are rejected by name. Missing,
    unexpected or mis-shaped tensors raise `CheckpointError` naming each one. Weights are cast to
    `dtype` (norms, mHC, sinks, position biases and router biases stay float32).

    Args:
      progress: called with a message per safetensors shard opened.
      mesh: None: every weight on the default device. A `jax.sharding.Mesh`: each weight sharded as
        `hkv.Engine(model, config, mesh=mesh)` shards it (split over `model_axis` where
        `tensor_parallel_dim` says and the axis divides it, replicated otherwise), each device's slice
        read from the memory-mapped shards and put on that device (`models.placement.OnMesh`): the
        whole model is never on one device or in host memory, and each process of a multi-process
        mesh reads only its own devices' slices.
      progress_bars: a bar over the bytes placed on the mesh (None: when interactive).
      expert_axes: the routed experts split over these mesh axes instead (`expert_parallel_dim`), as
        `hkv.Engine(model, config, mesh=mesh, expert_axes=...)` splits them: e.g. ("data", "model")
        for data-parallel attention with E / (D x M) experts per device.
    """
    from .checkpoint import read_checkpoint, read_config

    cfg = read_config(path)
    tensors = read_checkpoint(path, cfg, progress=progress, keep_quantized=not dequantize)
    if mesh is None:
        return DeepseekV4(cfg, tensors, dtype)
    experts = {"expert_axes": tuple(expert_axes), "expert_dim_of": expert_parallel_dim}
    with placing(OnMesh.for_checkpoint(tensors, mesh, model_axis, tensor_parallel_dim, progress_bars, **experts)):
        return DeepseekV4(cfg, tensors, dtype)
