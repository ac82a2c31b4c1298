"""The arithmetic a DeepSeek-V4 prefill cannot avoid, counted from the model's own weights and config
(the floor `benchmarks/roofline.py` holds hkv's prefill against).

A prefill of T tokens from position 0 (2 FLOPs per multiply-add):
- **weights**: every token through every per-token linear weight of every layer once (attention's
  projections, the compressors' and the indexer's, the router, the shared expert, the
  hyper-connection mixers), through its top-k routed experts (k of E, not all E), and the head for
  the last token only (the logits a prefill returns). Read off the model's weight leaves, so a
  quantized or stacked model counts the same; the embedding is a lookup.
- **attention**: each query at position t scores and weighs its keys (2 x heads x head_dim each,
  twice): the sliding window's min(t + 1, window) rows in every layer, plus a CSA layer's top-k
  compressed entries (min(index_topk, (t + 1) // m)) and an HCA layer's every compressed entry
  ((t + 1) // m).
- **indexer**: a CSA layer's lightning indexer scores every compressed entry for each query
  (2 x index_heads x index_head_dim each).
Elementwise work (norms, softmax, rope, pooling, mixing) is not counted: it is not matmul arithmetic.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import CSA, HCA
from .model import expert_parallel_dim

_NOT_PRODUCTS = ("ape", "tid2eid")  # 2-D leaves that are added or looked up, not multiplied


@dataclasses.dataclass(frozen=True)
class PrefillFlops:
    """FLOPs of one prefill of `tokens` tokens, by kind (see the module docstring).

    Attributes:
      weights: the per-token linear weights' products (routed experts at top-k) and the last row's head.
      attention: scores and weighted values over the keys each query attends.
      indexer: the CSA indexer's scores over every compressed entry.
    """

    tokens: int
    weights: int
    attention: int
    indexer: int

    @property
    def total(self) -> int:
        return self.weights + self.attention + self.indexer


@dataclasses.dataclass(frozen=True)
class WeightProduct:
    """One linear weight as a prefill multiplies by it: `rows_per_token` rows of [.., k_in] times the
    weight [k_in, n_out] per token (top-k / E for a routed expert's stack, 1 otherwise; 0 for the head,
    which multiplies the last row only), `count` such weights (a stacked run, or an expert stack's E)."""

    name: str
    k_in: int
    n_out: int
    count: int
    rows_per_token: float

    @property
    def macs_per_token(self) -> float:
        return self.count * self.k_in * self.n_out * self.rows_per_token


def weight_products(model) -> list[WeightProduct]:
    """Every linear weight of `model` (`WeightProduct`), read off its weight leaves: a quantized or
    stacked model counts as the plain one."""
    cfg = model.cfg
    out = []
    for path, leaf in nnx.to_flat_state(nnx.state(model)):
        names = [str(p) for p in path]
        value = leaf.get_value()
        if names[-1] == "scale":
            continue  # a quantized weight's scale grid (its data counts the weight), or a 1-D mixer scale
        quantized = names[-1] == "data"  # stored FP8 / packed FP4 (uint8)
        if names[-1] in ("data", "value"):
            names = names[:-1]
        if names[0] == "embed" or not (quantized or jnp.issubdtype(value.dtype, jnp.floating)):
            continue
        if names[-1] in _NOT_PRODUCTS or value.ndim < 2:
            continue
        shape = _logical_shape(model, names, value)
        name = ".".join(names)
        if expert_parallel_dim(name, shape) is not None:  # [.., E, in, out] dense; [.., E, out, in] quantized
            k_in, n_out = (shape[-2], shape[-1]) if not quantized else (shape[-1], shape[-2])
            count = int(np.prod(shape[:-2]))
            out.append(WeightProduct(name, k_in, n_out, count, cfg.num_experts_per_tok / cfg.n_routed_experts))
        else:  # [.., out, in]
            rows = 0.0 if names[0] == "head" else 1.0
            out.append(WeightProduct(name, shape[-1], shape[-2], int(np.prod(shape[:-2])), rows))
    return out


def _logical_shape(model, names: list[str], value) -> tuple[int, ...]:
    """The weight at `names` as the model multiplies by it (a packed FP4 byte holds two values)."""
    node = model
    for n in names:
        node = node[int(n)] if n.isdigit() else getattr(node, n)
    shape = getattr(node, "shape", None)  # a `QuantizedLinear` knows its logical [.., out, in]
    if shape is not None and not hasattr(node, "get_value"):
        return tuple(value.shape[: value.ndim - len(shape)]) + tuple(shape)  # [R] of a stacked run first
    return tuple(value.shape)


def prefill_flops(model, tokens: int) -> PrefillFlops:
    """The FLOPs of a prefill of `tokens` tokens from position 0 (see the module docstring).

    Args:
      model: a `DeepseekV4` (its config and weights' shapes are read; no value is).
      tokens: the prompt length T >= 1.
    Raises:
      ValueError: tokens < 1.
    """
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens={tokens!r} must be an integer >= 1")
    cfg = model.cfg
    products = weight_products(model)
    per_token = sum(p.macs_per_token for p in products)
    head = sum(p.count * p.k_in * p.n_out for p in products if p.rows_per_token == 0)
    t1 = np.arange(1, tokens + 1, dtype=np.int64)  # keys up to and including each query's position
    window = np.minimum(t1, cfg.sliding_window).sum()
    keys = indexed = 0
    for kind in cfg.layer_types:
        keys += window
        if kind == CSA:
            entries = t1 // cfg.compress_rate_csa
            keys += np.minimum(entries, cfg.index_topk).sum()
            indexed += entries.sum()
        elif kind == HCA:
            keys += (t1 // cfg.compress_rate_hca).sum()
    attention = 4 * cfg.num_attention_heads * cfg.head_dim * int(keys)
    indexer = 2 * cfg.index_n_heads * cfg.index_head_dim * int(indexed)
    weights = 2 * (round(tokens * per_token) + head)
    return PrefillFlops(tokens=tokens, weights=weights, attention=attention, indexer=indexer)
