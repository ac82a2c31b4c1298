"""DeepSeek-V4 mixture of experts: hash-routed (`tid2eid[token]`) or top-k routed experts, plus one
shared expert; SwiGLU with `swiglu_limit` clamps (gate clamped above, up clamped both sides).

Routed experts run as one grouped matmul (`jax.lax.ragged_dot`) over (token, slot) pairs sorted by
expert, so cost scales with tokens x top-k, not tokens x experts, and shapes stay static. That holds
where XLA has a native grouped matmul (GPU, TPU). On CPU `ragged_dot` lowers to a dense masked product
over every (pair, expert): tokens x top-k x experts, worse than computing every expert for every token.
There (`jax.lax.platform_dependent`) fewer (token, slot) pairs than experts (decode of a few
sequences) run each pair through its own expert's gathered weights (tokens x top-k), a few more
tokens run every expert densely, weighted by the routing (tokens x experts), and many tokens
(prefill) run in tiles of `TILE` pairs that each belong to one expert, each expert's pairs padded to
whole tiles (tokens x top-k + experts x TILE rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hkv import numerics
from models.placement import LazyStack, put

from .config import HASH_MOE, DeepseekV4Config
from .norms import linear
from .quant_format import host_dense
from .quant_format import stack as stack_quantized
from .quantized import QuantizedLinear, quantized_or_param, weight

TILE = 64  # pairs per tile of the CPU grouped matmul


def score(logits: jnp.ndarray, scoring_func: str) -> jnp.ndarray:
    """Router scores from logits [N, E]: sqrt(softplus), softmax over experts, or sigmoid."""
    if scoring_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if scoring_func == "softmax":
        return numerics.softmax(logits, axis=-1).astype(logits.dtype)
    if scoring_func == "sigmoid":
        return numerics.sigmoid(logits).astype(logits.dtype)
    raise ValueError(f"{scoring_func=} must be one of sqrtsoftplus, softmax, sigmoid")


def swiglu(gate: jnp.ndarray, up: jnp.ndarray, limit: float) -> jnp.ndarray:
    """silu(min(gate, limit)) * clip(up, -limit, limit)."""
    return numerics.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def _combine_pairs(pairs: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray, n_experts: int, dtype) -> jnp.ndarray:
    """`_combine` of each token's k pair outputs: pairs [N, k, hidden] (pair j of token n ran expert
    idx[n, j]) placed at their experts (zeros elsewhere), weights [N, k], idx int32[N, k] -> [N, hidden]."""
    # a select per slot, not a scatter: XLA:CPU runs a scatter as a loop of one-row updates (N * k
    # iterations, each its own thunks), ~5% of a long prefill. The same values land (the last slot
    # naming an expert wins, as the scatter's updates in order), so the same bits follow.
    n, k = idx.shape
    at = idx[:, :, None] == jnp.arange(n_experts, dtype=idx.dtype)  # [N, k, E]
    per_expert = jnp.zeros((n, n_experts, pairs.shape[-1]), pairs.dtype)
    for j in range(k):
        per_expert = jnp.where(at[:, j, :, None], pairs[:, j, None, :], per_expert)
    return _combine(per_expert, weights, idx, dtype)


def _combine(outputs: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray, dtype) -> jnp.ndarray:
    """sum_e w[n, e] * outputs[n, e] over every expert e (w zero where token n did not pick e), as one
    [1, E] x [E, hidden] float32 product per token (`numerics.batched_matmul`: the same bits for any
    number of tokens; on a mesh that splits the experts, a sum of partial products across devices).
    outputs [N, E, hidden] (rounded to `dtype` first), weights [N, k], idx int32[N, k] -> [N, hidden]."""
    e = outputs.shape[1]
    dense = numerics.fixed_sum(jnp.where(idx[..., None] == jnp.arange(e), weights[..., None], 0.0), axis=1)
    y = outputs.astype(dtype).astype(jnp.float32)
    return numerics.batched_matmul(dense.astype(jnp.float32)[:, None, :], y)[:, 0].astype(dtype)


class MoE(nnx.Module):
    """Routed experts + shared expert of layer `layer` (weights under `layers.N.ffn.`).

    Stacked expert weights: w_gate, w_up [E, hidden, inter]; w_down [E, inter, hidden] — or, kept
    quantized (`QuantizedLinear`), in the checkpoint's layout [E, out, in] (w_gate, w_up [E, inter,
    hidden]; w_down [E, hidden, inter]), dequantized per step (only the routed experts where a step
    gathers them) and transposed to the former (`expert_weights`).
    """

    def __init__(self, cfg: DeepseekV4Config, layer: int, tensors: dict, dtype):
        p = f"layers.{layer}.ffn."
        e = cfg.n_routed_experts
        self.is_hash = cfg.mlp_layer_types[layer] == HASH_MOE
        self.top_k = cfg.num_experts_per_tok
        self.n_experts = e
        self.scoring_func = cfg.scoring_func
        self.scaling = cfg.routed_scaling_factor
        self.limit = cfg.swiglu_limit
        self.gate = quantized_or_param(tensors[p + "gate.weight"], dtype, p + "gate")
        if self.is_hash:
            self.tid2eid = nnx.Variable(put(tensors[p + "gate.tid2eid"], jnp.int32))
        else:
            self.bias = nnx.Param(put(tensors[p + "gate.bias"], jnp.float32))

        def stack(w: str, name: str) -> QuantizedLinear | nnx.Param:
            parts = [tensors[p + f"experts.{i}.{w}.weight"] for i in range(e)]
            quantized = stack_quantized(parts)  # kept as stored: [E, out, in]
            if quantized is not None:
                return QuantizedLinear(quantized, dtype, p + name)
            return nnx.Param(put(LazyStack([host_dense(t) for t in parts], transpose=True), dtype, p + name))

        self.w_gate = stack("w1", "w_gate")
        self.w_up = stack("w3", "w_up")
        self.w_down = stack("w2", "w_down")
        self.shared_w1 = quantized_or_param(tensors[p + "shared_experts.w1.weight"], dtype, p + "shared_w1")
        self.shared_w2 = quantized_or_param(tensors[p + "shared_experts.w2.weight"], dtype, p + "shared_w2")
        self.shared_w3 = quantized_or_param(tensors[p + "shared_experts.w3.weight"], dtype, p + "shared_w3")

    def route(self, x: jnp.ndarray, token_ids: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """x [N, hidden], token_ids int[N] -> (weights [N, k], expert ids int32[N, k])."""
        scores = score(linear(x, weight(self.gate)), self.scoring_func)
        if self.is_hash:
            idx = self.tid2eid.value[token_ids]
        else:
            biased = scores.astype(jnp.float32) + self.bias.value
            _, idx = jax.lax.top_k(biased, self.top_k)
        w = jnp.take_along_axis(scores, idx, axis=-1)
        w = numerics.div(w, numerics.fixed_sum(w, axis=-1, keepdims=True) + 1e-20)
        return numerics.mul(w, jnp.asarray(self.scaling, w.dtype)), idx.astype(jnp.int32)

    def experts(self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
        """Weighted sum of the selected experts' outputs. x [N, hidden], weights [N, k], idx int32[N, k]
        -> [N, hidden]: `ragged_dot` where it is native, on CPU `experts_cpu`."""
        return jax.lax.platform_dependent(x, weights, idx, cpu=self.experts_cpu, default=self.experts_ragged)

    def experts_cpu(self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
        """`experts` without `ragged_dot`: `experts_routed` while tokens x top-k < experts, every expert
        for every token while that is fewer rows than the tiled grouping, else `experts_tiled`. All
        compute each (token, expert) pair as a row of the same product ([rows, hidden] x [hidden,
        inter], batched, rows padded to one floor), so a token's output is the same bits on every path
        (the numerical contract)."""
        n, k = idx.shape
        e = self.n_experts
        if n * k < e:
            return self.experts_routed(x, weights, idx)
        if n * e <= 2 * (n * k + e * TILE):
            dt = x.dtype
            xe = jnp.broadcast_to(x[None], (e, *x.shape))  # [E, N, hidden]: products batched over the experts
            y = self._expert_rows(xe, None)  # [E, N, hidden] float32
            return _combine(jnp.swapaxes(y, 0, 1), weights, idx, dt)
        return self.experts_tiled(x, weights, idx)

    def experts_routed(self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
        """Each (token, slot) pair through its own expert only, one row per product, against that
        expert's weights gathered for it: the arithmetic and weight reads of tokens x top-k experts, not
        of every expert (what `experts_cpu` runs while tokens x top-k < experts: a decode step of a
        few sequences). A pair's row is multiplied as in `experts_tiled` (rows padded to the same
        floor), so a token's output is the same bits as on the other paths. x [N, hidden] -> [N, hidden]."""
        n, k = idx.shape
        flat = idx.reshape(-1)
        y = self._expert_rows(jnp.repeat(x, k, axis=0)[:, None, :], flat)[:, 0]  # [N * k, hidden] float32
        return _combine_pairs(y.reshape(n, k, -1), weights, idx, self.n_experts, x.dtype)

    def expert_weights(self, expert: jnp.ndarray | None, dt) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
        """(w_gate, w_up [G, hidden, inter], w_down [G, inter, hidden]) in `dt`: of every expert (expert
        None, G = E) or of experts `expert` int32[G] (gathered: quantized weights read only those
        experts' bytes, then dequantize)."""

        def one(w: QuantizedLinear | nnx.Param) -> jnp.ndarray:
            if isinstance(w, QuantizedLinear):
                dense = w.dense() if expert is None else w.take(expert)  # [G, out, in], the model's dtype
                return jnp.swapaxes(dense, -1, -2).astype(dt)
            v = w.value.astype(dt)
            return v if expert is None else v[expert]

        return one(self.w_gate), one(self.w_up), one(self.w_down)

    def _expert_rows(self, rows: jnp.ndarray, expert: jnp.ndarray | None) -> jnp.ndarray:
        """SwiGLU of expert `expert[g]` over rows[g] (expert None: rows[g] go to expert g): rows [G, R,
        hidden] -> float32 [G, R, hidden], as batched products (rows padded to `numerics.min_rows`)."""
        dt = rows.dtype
        wg, wu, wd = self.expert_weights(expert, dt)
        # rows per product: a tile's (TILE) or, in decode, one per token: padded to where every count up
        # to TILE sums in one order (2 rows; float32 products whose kernel changes below TILE: TILE)
        hidden, inter = wg.shape[-2:]
        floor_in = numerics.tile_rows_floor(dt, hidden, inter, TILE)
        floor_out = numerics.tile_rows_floor(dt, inter, hidden, TILE)
        gate = numerics.batched_matmul(rows, wg, rows_floor=floor_in).astype(dt)
        up = numerics.batched_matmul(rows, wu, rows_floor=floor_in).astype(dt)
        return numerics.batched_matmul(swiglu(gate, up, self.limit), wd, rows_floor=floor_out)

    def experts_tiled(self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
        """Grouped matmul in tiles: the N*k (token, slot) pairs sorted by expert, each expert's run
        padded to whole tiles of `TILE` rows (P = N*k + experts*(TILE-1) rows at most, static), every
        tile multiplied by its expert's weights (one batched product over the tiles). x [N, hidden] ->
        [N, hidden]."""
        n, k = idx.shape
        e, m = self.n_experts, n * k
        flat = idx.reshape(-1)
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        padded = (sizes + TILE - 1) // TILE * TILE
        padded_end = jnp.cumsum(padded)
        padded_start = padded_end - padded  # each expert's first padded row
        order = jnp.argsort(flat, stable=True)  # pairs by expert
        expert = flat[order]
        starts = jnp.cumsum(sizes) - sizes  # each expert's first place among the sorted pairs
        rank = jnp.arange(m, dtype=jnp.int32) - starts[expert]  # place within its expert
        # gathers, not scatters (XLA:CPU runs a scatter as a loop of one-row updates): pair i's padded
        # row, through the inverse of `order`; and each padded row's pair (or none: a zero row)
        dest = (padded_start[expert] + rank)[jnp.argsort(order)]
        tiles = max(2, -(-(m + e * (TILE - 1)) // TILE))  # >= 2: a batch of one is another product
        p = jnp.arange(tiles * TILE, dtype=jnp.int32)
        run = jnp.searchsorted(padded_end, p, side="right").astype(jnp.int32)  # the expert whose run holds p
        run_c = jnp.minimum(run, e - 1)  # rows past the last run: any expert (their rows are zeros)
        off = p - padded_start[run_c]
        real = (run < e) & (off < sizes[run_c])
        pair = order[jnp.clip(starts[run_c] + off, 0, m - 1)]
        rows = jnp.where(real[:, None], x[pair // k], jnp.zeros((), x.dtype))
        tile_expert = run_c[::TILE]  # a tile lies in one expert's run: its first row's
        y = self._expert_rows(rows.reshape(tiles, TILE, -1), tile_expert).reshape(tiles * TILE, -1)
        return _combine_pairs(y[dest].reshape(n, k, -1), weights, idx, e, x.dtype)

    def experts_ragged(self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
        """`experts` as one `jax.lax.ragged_dot` per projection over the pairs sorted by expert."""
        n, k = idx.shape
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        rows = x[order // k]
        sizes = jnp.bincount(flat, length=self.n_experts).astype(jnp.int32)
        wg, wu, wd = self.expert_weights(None, x.dtype)
        g = jax.lax.ragged_dot(rows, wg, sizes)
        u = jax.lax.ragged_dot(rows, wu, sizes)
        y = jax.lax.ragged_dot(swiglu(g, u, self.limit), wd, sizes)
        out = y[jnp.argsort(order)].reshape(n, k, -1)  # back in pair order (the inverse permutation)
        return _combine_pairs(out, weights, idx, self.n_experts, x.dtype)

    def shared(self, x: jnp.ndarray) -> jnp.ndarray:
        return linear(
            swiglu(linear(x, weight(self.shared_w1)), linear(x, weight(self.shared_w3)), self.limit),
            weight(self.shared_w2),
        )

    def __call__(self, x: jnp.ndarray, token_ids: jnp.ndarray) -> jnp.ndarray:
        """x [B, T, hidden], token_ids int[B, T] -> [B, T, hidden]."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        weights, idx = self.route(flat, token_ids.reshape(-1))
        return (self.experts(flat, weights, idx) + self.shared(flat)).reshape(b, t, d)
