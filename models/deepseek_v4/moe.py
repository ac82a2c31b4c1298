"""DeepSeek-V4 mixture of experts: hash-routed (`tid2eid[token]`) or top-k routed experts, plus one
shared expert; SwiGLU with `swiglu_limit` clamps (gate clamped above, up clamped both sides).

Routed experts run as one grouped matmul (`jax.lax.ragged_dot`) over (token, slot) pairs sorted by
expert, so cost scales with tokens x top-k, not tokens x experts, and shapes stay static. That holds
where XLA has a native grouped matmul (GPU, TPU). On CPU `ragged_dot` lowers to a dense masked product
over every (pair, expert): tokens x top-k x experts, worse than computing every expert for every token.
There (`jax.lax.platform_dependent`) fewer (token, slot) pairs than experts (decode of a few
sequences) run each pair through its own expert's gathered weights (tokens x top-k), a few more
tokens run every expert densely, weighted by the routing (tokens x experts), and many tokens
(prefill) run in tiles of pairs that each belong to one expert, each expert's pairs padded to whole
tiles (tokens x top-k + experts x tile rows). A tile holds `TILE` rows, or fewer (`Experts.tile`) where
a float32 product's kernel changes its order below `TILE` rows but not below a smaller tile: every
product then stays within the row counts that sum in one order, and a decode step's few rows are
padded to 2, not to 64.

On a mesh whose "model" axis splits the experts (a step traced by `hkv.MeshEngine`, or under
`jax.set_mesh`), the experts run expert parallel (`MoE.experts_parallel`): each device only the pairs
routed to its own experts, by the paths above over its local experts, and one psum over "model"
combines them — no device gathers another's expert weights, and every token's output is the single
device's bits. Where the experts are also split over the data axis a step is traced per shard of
(`hkv.MeshEngine(..., expert_axes=("data", "model"))`: attention data-parallel, the experts over every
device), each data shard's tokens are all-gathered over that axis, each device runs the pairs routed
to its E / (D x M) experts for every shard's tokens, and a psum over "model" then a reduce-scatter over
the data axis hand each shard its own tokens' pair outputs: drop-free, and still one device's bits.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from hkv import numerics
from models.placement import LazyStack, put

from .config import HASH_MOE, DeepseekV4Config
from .norms import linear
from .quant_format import host_dense
from .quant_format import stack as stack_quantized
from .quantized import QuantizedLinear, dequantize_device, quantized_or_param, weight

TILE = 64  # pairs per tile of the CPU grouped matmul (at most; `Experts.tile`)
# Smaller tiles tried, largest first, where a float32 product's order changes below TILE rows
TILES = (32, 16, 8)
# Most bytes of expert weights the CPU grouped matmul gathers at once (each tile its expert's three
# projections): more tiles than that fits run a group at a time in a loop, so a long prefill chunk of
# a large model holds a few experts' copies, not one per tile (a 4K-token chunk of DeepSeek-V4-Flash
# split 8 ways: 416 tiles of 48 MiB). Small models run every tile in one product.
GATHER_BYTES = 256 * 2**20


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


def _combine_pairs(pairs: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray, dtype) -> jnp.ndarray:
    """Each token's weighted sum of its k pair outputs: sum_j w[n, j] * pairs[n, j] (each output
    rounded to `dtype` first), the terms added in float32 strictly in ascending expert id
    (`numerics.ordered_sum`), so a token's sum depends on its own pairs only: the same bits for any
    number of tokens, on every path and mesh (the numerical contract). A token naming one expert in
    several slots (a hash table may) counts that expert's output once, weighted by those slots'
    weights summed. O(N k hidden): nothing of the shape [N, experts, hidden] is built (a prefill chunk
    of DeepSeek-V4-Flash, 256 experts of 4096, would need 4 MiB per token for it).

    Args:
      pairs: [N, k, hidden], pair j of token n the output of expert idx[n, j].
      weights: [N, k] routing weights. idx: int32[N, k] expert ids.
      dtype: the activations' dtype (the result's).
    Returns:
      [N, hidden] in `dtype`.
    """
    n = idx.shape[0]
    same = idx[:, :, None] == idx[:, None, :]  # [N, k, k]
    merged = numerics.fixed_sum(jnp.where(same, weights[:, None, :].astype(jnp.float32), 0.0), axis=-1)
    order = jnp.argsort(idx, axis=-1, stable=True)  # [N, k]: the slots by expert id
    ids = jnp.take_along_axis(idx, order, axis=-1)
    first = jnp.concatenate([jnp.ones((n, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=-1)
    w = jnp.take_along_axis(merged, order, axis=-1)
    y = jnp.take_along_axis(pairs, order[..., None], axis=1).astype(dtype).astype(jnp.float32)
    terms = jnp.where(first[..., None], numerics.mul(w[..., None], y), 0.0)  # a repeated expert: once
    return numerics.ordered_sum(terms, axis=1).astype(dtype)


EXPERT_AXIS = "model"  # the mesh axis that splits the routed experts (`hkv.MeshEngine`'s model axis)


def data_split(mesh, local: int, n: int) -> tuple[str, ...]:
    """The manual mesh axes (the data axis `hkv.MeshEngine` traces its steps per shard of) that split n
    routed experts when this shard's stack holds `local` of them: () where local == n.

    Raises:
      ValueError: local != n and the manual axes' sizes times local is not n (a stack split some
        other way than over the data shards the step is traced for).
    """
    if local == n:
        return ()
    manual = tuple(a for a in mesh.axis_names if a in getattr(mesh, "manual_axes", ()))
    shards = math.prod(mesh.shape[a] for a in manual)
    if not manual or local * shards != n:
        raise ValueError(
            f"this shard holds {local} of {n} routed experts, but the step is traced over manual mesh axes "
            f"{manual} of {shards} shards; experts split over the data axis need {n} = {local} x shards"
        )
    return manual


def splits(mesh, n: int) -> bool:
    """Whether a step traced under `mesh` (the abstract mesh in context) splits n things (experts,
    vocabulary rows) over its "model" axis: an automatic axis of more than one device that divides n."""
    if EXPERT_AXIS not in mesh.axis_names or EXPERT_AXIS in getattr(mesh, "manual_axes", ()):
        return False
    m = mesh.shape[EXPERT_AXIS]
    return m > 1 and n % m == 0


@dataclasses.dataclass(frozen=True)
class ExpertStack:
    """One projection of every expert as the model holds it: dense `value` [E, in, out], or quantized
    (`data`, `scale` [E, out, in...] of `fmt` / `block`, dequantized to `dtype`; see `QuantizedLinear`)."""

    value: jax.Array | None = None
    data: jax.Array | None = None
    scale: jax.Array | None = None
    fmt: str | None = None
    block: tuple[int, int] | None = None
    dtype: object = None

    @classmethod
    def of(cls, w: QuantizedLinear | nnx.Param) -> ExpertStack:
        if isinstance(w, QuantizedLinear):
            return cls(data=w.data.value, scale=w.scale.value, fmt=w.fmt, block=w.block, dtype=w.dtype)
        return cls(value=w.value)

    def arrays(self) -> tuple[jax.Array, ...]:
        return (self.value,) if self.value is not None else (self.data, self.scale)

    def with_arrays(self, arrays: tuple) -> ExpertStack:
        if self.value is not None:
            return dataclasses.replace(self, value=arrays[0])
        return dataclasses.replace(self, data=arrays[0], scale=arrays[1])

    def weights(self, expert: jnp.ndarray | None, dt) -> jnp.ndarray:
        """[G, in, out] in `dt`: every expert (expert None) or experts `expert` int32[G] (gathered first:
        a quantized stack reads only those experts' bytes, then dequantizes)."""
        if self.value is None:
            data, scale = (self.data, self.scale) if expert is None else (self.data[expert], self.scale[expert])
            dense = dequantize_device(data, scale, self.fmt, self.block).astype(self.dtype)  # [G, out, in]
            return jnp.swapaxes(dense, -1, -2).astype(dt)
        v = self.value.astype(dt)
        return v if expert is None else v[expert]


@dataclasses.dataclass(frozen=True)
class Experts:
    """The routed experts' three projections (`ExpertStack`s) and the SwiGLU limit: the grouped
    products, each giving every (token, slot) pair's output [N, k, hidden] float32 (`pairs_*`)."""

    gate: ExpertStack
    up: ExpertStack
    down: ExpertStack
    limit: float

    @classmethod
    def of(cls, w_gate, w_up, w_down, limit: float) -> Experts:
        return cls(ExpertStack.of(w_gate), ExpertStack.of(w_up), ExpertStack.of(w_down), limit)

    def arrays(self) -> tuple[jax.Array, ...]:
        """Every array of the three stacks (each [E, ...]), for passing through `shard_map`."""
        return self.gate.arrays() + self.up.arrays() + self.down.arrays()

    def with_arrays(self, arrays: tuple) -> Experts:
        a, b = len(self.gate.arrays()), len(self.up.arrays())
        return dataclasses.replace(
            self,
            gate=self.gate.with_arrays(arrays[:a]),
            up=self.up.with_arrays(arrays[a : a + b]),
            down=self.down.with_arrays(arrays[a + b :]),
        )

    def tile(self, dt) -> tuple[int, int]:
        """(rows per tile of the CPU grouped matmul, the row floor of every expert product) for products
        in `dt`: `TILE` rows and the probed floor at that count (`numerics.tile_rows_floor`: 2, or 64
        for float32 products whose kernel changes order below 64 rows), unless that floor is not 2 and
        a smaller tile of `TILES` has floor 2 for both products' shapes (float32 [256, 256] experts on
        XLA:CPU: counts 2..32 share one order, 2..64 do not): then that tile and 2. Every product of
        the experts (a tile, one routed pair, the dense path's tokens: at most a tile's rows) then sums
        each element in one order, so a token's bits are the same on every path."""
        hidden, inter = jax.eval_shape(lambda: self.gate.weights(None, dt)).shape[-2:]

        def floor(rows: int) -> int:
            return max(numerics.tile_rows_floor(dt, a, b, rows) for a, b in ((hidden, inter), (inter, hidden)))

        if (top := floor(TILE)) == numerics.MIN_ROWS:
            return TILE, top
        return next(((r, numerics.MIN_ROWS) for r in TILES if floor(r) == numerics.MIN_ROWS), (TILE, top))

    def rows(self, rows: jnp.ndarray, expert: jnp.ndarray | None) -> jnp.ndarray:
        """SwiGLU of expert `expert[g]` over rows[g] (expert None: rows[g] go to expert g): rows [G, R,
        hidden] with R <= `tile(rows.dtype)[0]` -> float32 [G, R, hidden], as batched products (rows
        padded to the tile's floor: a tile's, one pair's or a few tokens' rows sum in one order)."""
        dt = rows.dtype
        tile, floor = self.tile(dt)
        if rows.shape[1] > tile:
            raise ValueError(f"{rows.shape[1]} rows per product: at most the tile's {tile} sum in one order")
        wg, wu, wd = (s.weights(expert, dt) for s in (self.gate, self.up, self.down))
        gate = numerics.batched_matmul(rows, wg, rows_floor=floor).astype(dt)
        up = numerics.batched_matmul(rows, wu, rows_floor=floor).astype(dt)
        return numerics.batched_matmul(swiglu(gate, up, self.limit), wd, rows_floor=floor)

    def tile_rows(self, rows: jnp.ndarray, expert: jnp.ndarray) -> jnp.ndarray:
        """`rows(rows, expert)` over G tiles, as many tiles at a time as `GATHER_BYTES` of gathered
        weights hold (at least one): one batched product where all fit or there are at most twice as
        many tiles as experts, else a loop over groups of tiles (the tiles padded to whole groups with
        zero rows). Each tile's product is the same bits either way (a batched product's elements do
        not depend on the batch).
        rows [G, R, hidden], expert int32[G] -> float32 [G, R, hidden]."""
        g = rows.shape[0]
        dt = rows.dtype
        shapes = (jax.eval_shape(lambda s=s: s.weights(None, dt)).shape for s in (self.gate, self.up, self.down))
        per_tile = sum(math.prod(shape[-2:]) for shape in shapes)
        per = max(1, GATHER_BYTES // (per_tile * jnp.dtype(dt).itemsize))
        # at most twice as many tiles as experts (a decode step: every expert a tile or two): the loop
        # would cost more than it saves, as XLA copies the stack whole into it (one byte per weight,
        # float32 scales: 1.1 GB more at 8 slots of V4-Flash on (1, 8))
        if per >= g or g <= 2 * self.gate.arrays()[0].shape[-3]:
            return self.rows(rows, expert)
        steps = -(-g // per)
        pad = steps * per - g
        rows = jnp.pad(rows, ((0, pad), (0, 0), (0, 0))).reshape(steps, per, *rows.shape[1:])
        expert = jnp.pad(expert, (0, pad)).reshape(steps, per)

        def group(_, xs):
            return None, self.rows(*xs)

        _, y = jax.lax.scan(group, None, (rows, expert))
        return y.reshape(steps * per, *y.shape[2:])[:g]

    def pairs(self, x: jnp.ndarray, idx: jnp.ndarray, n_experts: int) -> jnp.ndarray:
        """Every pair's output by the path this backend and size call for: `pairs_ragged` where
        `ragged_dot` is native; on CPU `pairs_routed` while tokens x top-k < experts, else `pairs_tiled`.
        A pair whose id is `n_experts` (no expert: another device's, `MoE.experts_parallel`) leaves the
        other pairs' outputs as they are; its own row is unspecified (zeros from `pairs_ragged`)."""
        n, k = idx.shape

        def cpu(x, idx):
            return self.pairs_routed(x, idx) if n * k < n_experts else self.pairs_tiled(x, idx, n_experts)

        return jax.lax.platform_dependent(x, idx, cpu=cpu, default=lambda x, idx: self.pairs_ragged(x, idx, n_experts))

    def pairs_routed(self, x: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
        """Each pair through its own expert's weights gathered for it, one row per product (rows padded
        to the tiled path's floor: the same bits). x [N, hidden], idx int32[N, k] -> [N, k, hidden]."""
        n, k = idx.shape
        y = self.rows(jnp.repeat(x, k, axis=0)[:, None, :], idx.reshape(-1))[:, 0]  # [N * k, hidden]
        return y.reshape(n, k, -1)

    def pairs_tiled(self, x: jnp.ndarray, idx: jnp.ndarray, n_experts: int) -> jnp.ndarray:
        """Grouped matmul in tiles: the N*k pairs sorted by expert, each expert's run padded to whole
        tiles of `tile` rows (`Experts.tile`; P = N*k + experts*(tile-1) rows at most, static), every
        tile multiplied by its expert's weights (one batched product over the tiles). -> [N, k, hidden]."""
        n, k = idx.shape
        e, m = n_experts, n * k
        flat = idx.reshape(-1)
        tile = self.tile(x.dtype)[0]
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        padded = (sizes + tile - 1) // tile * tile
        padded_end = jnp.cumsum(padded)
        padded_start = padded_end - padded  # each expert's first padded row
        order = jnp.argsort(flat, stable=True)  # pairs by expert
        expert = flat[order]
        starts = jnp.cumsum(sizes) - sizes  # each expert's first place among the sorted pairs
        rank = jnp.arange(m, dtype=jnp.int32) - starts[expert]  # place within its expert
        # gathers, not scatters (XLA:CPU runs a scatter as a loop of one-row updates): pair i's padded
        # row, through the inverse of `order`; and each padded row's pair (or none: a zero row)
        dest = (padded_start[expert] + rank)[jnp.argsort(order)]
        tiles = max(2, -(-(m + e * (tile - 1)) // tile))  # >= 2: a batch of one is another product
        p = jnp.arange(tiles * tile, dtype=jnp.int32)
        run = jnp.searchsorted(padded_end, p, side="right").astype(jnp.int32)  # the expert whose run holds p
        run_c = jnp.minimum(run, e - 1)  # rows past the last run: any expert (their rows are zeros)
        off = p - padded_start[run_c]
        real = (run < e) & (off < sizes[run_c])
        pair = order[jnp.clip(starts[run_c] + off, 0, m - 1)]
        rows = jnp.where(real[:, None], x[pair // k], jnp.zeros((), x.dtype))
        tile_expert = run_c[::tile]  # a tile lies in one expert's run: its first row's
        y = self.tile_rows(rows.reshape(tiles, tile, -1), tile_expert).reshape(tiles * tile, -1)
        return y[dest].reshape(n, k, -1)

    def pairs_ragged(self, x: jnp.ndarray, idx: jnp.ndarray, n_experts: int) -> jnp.ndarray:
        """One `jax.lax.ragged_dot` per projection over the pairs sorted by expert. -> float32 [N, k, hidden]."""
        n, k = idx.shape
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        rows = x[order // k]
        sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
        wg, wu, wd = (s.weights(None, x.dtype) for s in (self.gate, self.up, self.down))
        g = jax.lax.ragged_dot(rows, wg, sizes)
        u = jax.lax.ragged_dot(rows, wu, sizes)
        y = jax.lax.ragged_dot(swiglu(g, u, self.limit), wd, sizes)
        y = y[jnp.argsort(order)].reshape(n, k, -1)  # back in pair order (the inverse permutation)
        return y.astype(jnp.float32)  # float32 as the other paths' (exact: it is rounded to x.dtype next)


class MoE(nnx.Module):
    """Routed experts + shared expert of layer `layer` (weights under `layers.N.ffn.`).

    Stacked expert weights: w_gate, w_up [E, hidden, inter]; w_down [E, inter, hidden] — or, kept
    quantized (`QuantizedLinear`), in the checkpoint's layout [E, out, in] (w_gate, w_up [E, inter,
    hidden]; w_down [E, hidden, inter]), dequantized per step (only the routed experts where a step
    gathers them) and transposed to the former (`ExpertStack.weights`).
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

    def stacks(self) -> Experts:
        """The routed experts' weights as an `Experts` bundle (what the grouped products read)."""
        return Experts.of(self.w_gate, self.w_up, self.w_down, self.limit)

    def experts(self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
        """Weighted sum of the selected experts' outputs. x [N, hidden], weights [N, k], idx int32[N, k]
        -> [N, hidden]: expert parallel (`experts_parallel`) inside a mesh whose "model" axis splits the
        experts; else `ragged_dot` where it is native, on CPU `experts_cpu`."""
        mesh = jax.sharding.get_abstract_mesh()
        over = self.data_axes(mesh)
        if over or splits(mesh, self.n_experts):
            return self.experts_parallel(x, weights, idx, mesh, over)
        return jax.lax.platform_dependent(x, weights, idx, cpu=self.experts_cpu, default=self.experts_ragged)

    def data_axes(self, mesh) -> tuple[str, ...]:
        """The manual mesh axes this trace's stacks are split over (`data_split`: the stack holds fewer
        experts than the config), else ()."""
        return data_split(mesh, self.stacks().gate.arrays()[0].shape[-3], self.n_experts)

    def experts_cpu(self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
        """`experts` without `ragged_dot`: `experts_routed` while tokens x top-k < experts, every expert
        for every token while the tokens fit one tile and that is fewer rows than the tiled grouping,
        else `experts_tiled`. All compute each (token, expert) pair as a row of the same product
        ([rows, hidden] x [hidden, inter], batched, at most a tile's rows padded to one floor:
        `Experts.tile`), so a token's output is the same bits on every path (the numerical contract)."""
        n, k = idx.shape
        e = self.n_experts
        if n * k < e:
            return self.experts_routed(x, weights, idx)
        stacks = self.stacks()
        tile = stacks.tile(x.dtype)[0]
        if n <= tile and n * e <= 2 * (n * k + e * tile):
            xe = jnp.broadcast_to(x[None], (e, *x.shape))  # [E, N, hidden]: products batched over the experts
            y = stacks.rows(xe, None)  # [E, N, hidden] float32
            pairs = jnp.take_along_axis(jnp.swapaxes(y, 0, 1), idx[..., None], axis=1)  # [N, k, hidden]
            return _combine_pairs(pairs, weights, idx, x.dtype)
        return self.experts_tiled(x, weights, idx)

    def experts_routed(self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
        """Each (token, slot) pair through its own expert only (`Experts.pairs_routed`): the arithmetic
        and weight reads of tokens x top-k experts, not of every expert (what `experts_cpu` runs while
        tokens x top-k < experts: a decode step of a few sequences). x [N, hidden] -> [N, hidden]."""
        pairs = self.stacks().pairs_routed(x, idx)
        return _combine_pairs(pairs, weights, idx, x.dtype)

    def experts_tiled(self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
        """Grouped matmul in tiles (`Experts.pairs_tiled`). x [N, hidden] -> [N, hidden]."""
        pairs = self.stacks().pairs_tiled(x, idx, self.n_experts)
        return _combine_pairs(pairs, weights, idx, x.dtype)

    def experts_ragged(self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
        """`experts` as one `jax.lax.ragged_dot` per projection (`Experts.pairs_ragged`)."""
        pairs = self.stacks().pairs_ragged(x, idx, self.n_experts)
        return _combine_pairs(pairs, weights, idx, x.dtype)

    def experts_parallel(
        self, x: jnp.ndarray, weights: jnp.ndarray, idx: jnp.ndarray, mesh, over: tuple[str, ...] = ()
    ) -> jnp.ndarray:
        """Expert parallelism over the mesh's "model" axis (inside a step traced on that mesh, e.g. by
        `hkv.MeshEngine`) and, with `over` (`data_split`: the manual data axes this step is traced per
        shard of), over those too. Each device holds E / (D x M) experts and runs only the (token,
        slot) pairs routed to them (`Experts.pairs`, on its local experts: drop-free, hash-routed
        layers alike); the other pairs' rows are zeros. One `psum` over "model" gives every device of
        the shard every pair's output, each computed by exactly one device (the sum adds only zeros
        to it: the same value), and the combine is the single device's. Within a shard the tokens are
        already on every device of "model" (attention ends in an all-reduce); across data shards they
        are all-gathered over `over` first and the pair outputs reduce-scattered back, each shard
        keeping its own tokens'. x [N, hidden] -> [N, hidden]."""
        d = math.prod(mesh.shape[a] for a in over)
        m = mesh.shape[EXPERT_AXIS] if splits(mesh, self.n_experts // d) else 1
        local = self.n_experts // (d * m)
        stacks = self.stacks()

        def on_device(x, idx, *arrays):
            if over:  # every data shard's tokens: [D * N, ...], shard-major
                x = jax.lax.all_gather(x, over, tiled=True)
                idx = jax.lax.all_gather(idx, over, tiled=True)
            shard = jax.lax.axis_index(over) * m if over else 0
            if m > 1:
                shard = shard + jax.lax.axis_index(EXPERT_AXIS)
            first = shard * local
            mine = (idx >= first) & (idx < first + local)
            # another device's pair gets the id `local` (no expert here): `ragged_dot` leaves it out of
            # every group (no arithmetic where the grouped matmul is native), and the CPU paths' rows
            # for it are dropped below
            pairs = stacks.with_arrays(arrays).pairs(x, jnp.where(mine, idx - first, local), local)
            pairs = jnp.where(mine[..., None], pairs, 0.0)
            if m > 1:
                pairs = jax.lax.psum(pairs, EXPERT_AXIS)
            if over:  # each shard its own tokens' outputs, summed over the shards (one is not zero)
                pairs = jax.lax.psum_scatter(pairs, over, scatter_dimension=0, tiled=True)
            return pairs

        arrays = stacks.arrays()
        if m == 1:  # the data axes are manual already: this trace is one device's
            pairs = on_device(x, idx, *arrays)
        else:
            pairs = jax.shard_map(
                on_device,
                mesh=mesh,
                in_specs=(P(), P()) + tuple(P(*([None] * (a.ndim - 3)), EXPERT_AXIS) for a in arrays),
                out_specs=P(),
                axis_names={EXPERT_AXIS},
                check_vma=False,
            )(x, idx, *arrays)
        return _combine_pairs(pairs, weights, idx, x.dtype)

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
