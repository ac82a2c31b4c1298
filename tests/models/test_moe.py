"""DeepSeek-V4's routed experts: the CPU paths (each pair through its own expert for fewer pairs than
experts, dense for a few tokens, tiles for many) equal the `ragged_dot` grouped matmul that GPUs and
TPUs run, whatever the routing's skew."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.deepseek_v4.config import tiny_config
from models.deepseek_v4.model import init


@pytest.fixture(scope="module")
def layer():
    cfg = tiny_config()
    model = init(cfg, seed=0)
    return next(l.ffn for l in model.layers if not l.ffn.is_hash)


def routed_inputs(layer, n: int, seed: int, dtype=jnp.float32):
    """n random tokens [n, hidden] in `dtype`, k distinct random experts each, random weights."""
    rng = np.random.default_rng(seed)
    e, k = layer.n_experts, layer.top_k
    x = jnp.asarray(rng.standard_normal((n, layer.w_gate.value.shape[1])), dtype)
    idx = np.stack([rng.permutation(e)[:k] for _ in range(n)])
    return x, idx, jnp.asarray(rng.random((n, k)), jnp.float32)


@pytest.mark.parametrize("n", [1, 3, 40, 300])
@pytest.mark.parametrize("skew", ["random", "one expert", "two experts"])
def test_cpu_paths_equal_the_grouped_matmul(layer, n, skew):
    rng = np.random.default_rng(n)
    e, k = layer.n_experts, layer.top_k
    x = jnp.asarray(rng.standard_normal((n, layer.w_gate.value.shape[1])), jnp.float32)
    if skew == "random":
        idx = np.stack([rng.permutation(e)[:k] for _ in range(n)])
    elif skew == "one expert":  # every pair of slot 0 on expert e-1: its run spans many tiles
        idx = np.stack([[e - 1] + list(rng.permutation(e - 1)[: k - 1]) for _ in range(n)])
    else:
        idx = np.tile(np.array([[1, 0]])[:, :k], (n, 1))
    idx = jnp.asarray(idx, jnp.int32)
    w = jnp.asarray(rng.random((n, k)), jnp.float32)
    want = np.asarray(jax.jit(layer.experts_ragged)(x, w, idx))
    for path in (layer.experts_cpu, layer.experts_tiled, layer.experts_routed):
        np.testing.assert_allclose(np.asarray(jax.jit(path)(x, w, idx)), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("n", [3, 300])
def test_a_pair_of_no_expert_here_leaves_the_others_alone(layer, n):
    """A pair whose id is the expert count (another device's, under expert parallelism) changes no other
    pair's output on any path, and the grouped matmul computes nothing for it (a zero row)."""
    rng = np.random.default_rng(n)
    e, k = layer.n_experts, layer.top_k
    x = jnp.asarray(rng.standard_normal((n, layer.w_gate.value.shape[1])), jnp.float32)
    idx = np.stack([rng.permutation(e)[:k] for _ in range(n)])
    away = rng.random(idx.shape) < 0.5
    stacks = layer.stacks()
    for path in (stacks.pairs_ragged, stacks.pairs_tiled, lambda x, i, e: stacks.pairs_routed(x, i)):
        want = np.asarray(jax.jit(path, static_argnums=2)(x, jnp.asarray(idx, jnp.int32), e))
        got = np.asarray(jax.jit(path, static_argnums=2)(x, jnp.asarray(np.where(away, e, idx), jnp.int32), e))
        np.testing.assert_array_equal(got[~away], want[~away])
        if path == stacks.pairs_ragged:
            assert not got[away].any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_and_tiled_paths_give_each_token_the_same_bits(layer, dtype):
    """The numerical contract inside the experts: a token's output is the same bits whether it ran
    alone or beside others, through its own experts only or the dense path (decode) or in the tiles of
    a long prompt (prefill), in float32 and bfloat16 (products padded to the probed row floor)."""
    from hkv import numerics

    x, idx, w = routed_inputs(layer, 300, 7, dtype)
    idx = jnp.asarray(idx, jnp.int32)
    tiled = np.asarray(numerics.jit(layer.experts_tiled)(x, w, idx))
    dense = numerics.jit(layer.experts_cpu)
    routed = numerics.jit(layer.experts_routed)
    for rows in ([5], [0, 1], [3, 9, 200]):
        sel = (x[jnp.asarray(rows)], w[jnp.asarray(rows)], idx[jnp.asarray(rows)])
        for name, path in (("experts_cpu", dense), ("experts_routed", routed)):
            got = np.asarray(path(*sel))
            np.testing.assert_array_equal(got, tiled[rows], err_msg=f"{name}, rows {rows} in {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("n", [3, 300])  # decode (pairs through their own experts) and prefill (tiles)
@pytest.mark.parametrize("quantized", [False, True, "bfloat16"], ids=["dense", "fp4", "fp4-bfloat16"])
def test_expert_parallel_runs_only_local_experts_and_gives_the_same_bits(tmp_path, n, quantized):
    """Traced under a mesh whose "model" axis splits the experts (as `hkv.MeshEngine` traces its steps),
    each device runs only the pairs routed to its own experts and one psum combines them: the program
    all-reduces pair outputs and never gathers the expert weights, and every token's output is the
    single device's bits."""
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from hkv import numerics
    from models.deepseek_v4 import load, random_tensors
    from models.deepseek_v4.release import write_release_checkpoint

    cfg = tiny_config()
    dtype = jnp.bfloat16 if quantized == "bfloat16" else jnp.float32
    if quantized:
        write_release_checkpoint(tmp_path, cfg, random_tensors(cfg, seed=0), fp8_block=16)
        model = load(tmp_path, dtype=dtype)
    else:
        model = init(cfg, seed=0)
    moe = next(l.ffn for l in model.layers if not l.ffn.is_hash)
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.standard_normal((n, cfg.hidden_size)), dtype)
    idx = jnp.asarray(np.stack([rng.permutation(moe.n_experts)[: moe.top_k] for _ in range(n)]), jnp.int32)
    w = jnp.asarray(rng.random((n, moe.top_k)), jnp.float32)
    want = np.asarray(numerics.jit(moe.experts)(x, w, idx))  # no mesh: the single device's paths

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    graphdef, state = nnx.split(moe)
    split = jax.tree.map(lambda a: NamedSharding(mesh, P("model") if a.ndim == 3 else P()), state)
    state = jax.device_put(state, split)

    def run(state, x, w, idx):
        return nnx.merge(graphdef, state).experts(x, w, idx)

    with jax.set_mesh(mesh):
        fn = numerics.jit(run)
        hlo = fn.lower(state, x, w, idx).compile().as_text()
        got = np.asarray(fn(state, x, w, idx))
    np.testing.assert_array_equal(got.astype(np.float32).view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert "all-reduce" in hlo and "all-gather" not in hlo


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (8, 1)], ids=str)
@pytest.mark.parametrize("n", [3, 300])  # decode (pairs through their own experts) and prefill (tiles)
def test_experts_split_over_the_data_axis_give_each_shard_its_tokens_bits(shape, n):
    """Traced per data shard (as `hkv.MeshEngine(..., expert_axes=("data", "model"))` traces its steps)
    with the 8 experts split over every device: each shard's tokens are all-gathered over "data", every
    device runs the pairs routed to its one expert, and each shard gets back exactly the single
    device's bits for its own tokens; the weights are never gathered."""
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from hkv import numerics

    cfg = tiny_config(n_routed_experts=8)
    moe = next(l.ffn for l in init(cfg, seed=0).layers if not l.ffn.is_hash)
    d = shape[0]
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.standard_normal((d, n, cfg.hidden_size)), jnp.float32)
    # shard 0 routes everything to expert 0 (one device's load is every pair of its shard)
    idx = np.stack([rng.permutation(moe.n_experts)[: moe.top_k] for _ in range(d * n)]).reshape(d, n, -1)
    idx[0] = np.arange(moe.top_k)
    idx = jnp.asarray(idx, jnp.int32)
    w = jnp.asarray(rng.random((d, n, moe.top_k)), jnp.float32)
    want = np.stack([np.asarray(numerics.jit(moe.experts)(x[i], w[i], idx[i])) for i in range(d)])

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "model"))
    graphdef, state = nnx.split(moe)

    def experts(a):  # the stacked experts [E, ...]; the rest is 2-D or less
        return a.ndim == 3

    state = jax.device_put(
        state, jax.tree.map(lambda a: NamedSharding(mesh, P(("data", "model")) if experts(a) else P()), state)
    )
    specs = jax.tree.map(lambda a: P("data") if experts(a) else P(), state)

    def run(state, x, w, idx):
        return nnx.merge(graphdef, state).experts(x[0], w[0], idx[0])[None]

    fn = numerics.jit(
        jax.shard_map(
            run, mesh=mesh, in_specs=(specs, P("data"), P("data"), P("data")), out_specs=P("data"),
            axis_names={"data"}, check_vma=False,
        )
    )  # fmt: skip
    hlo = fn.lower(state, x, w, idx).compile().as_text()
    got = np.asarray(fn(state, x, w, idx))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert "reduce-scatter" in hlo or "all-reduce" in hlo
    gathered = re.findall(r"= (?:f32|s32)\[([\d,]+)\][^\n]*all-gather\(", hlo)
    assert gathered
    assert all(int(s.split(",")[0]) == d * n for s in gathered), gathered  # tokens only, never weights


def test_a_token_naming_one_expert_twice_counts_its_output_once_on_every_path(layer):
    """A hash table may give a token the same expert in two slots: every path adds that expert's output
    once, weighted by both slots' weights, and the paths agree bit for bit."""
    from hkv import numerics

    n, e = 300, layer.n_experts
    x, idx, w = routed_inputs(layer, n, 3)
    idx[::3, 1] = idx[::3, 0]  # every third token: its first expert twice
    idx = jnp.asarray(idx, jnp.int32)
    outputs = np.asarray(jax.jit(layer.stacks().pairs_ragged, static_argnums=2)(x, idx, e))  # [N, k, hidden]
    rounded = outputs.astype(np.float32)
    want = np.zeros((n, x.shape[1]), np.float64)
    for t in range(n):
        for ex in set(np.asarray(idx[t]).tolist()):
            slots = np.flatnonzero(np.asarray(idx[t]) == ex)
            want[t] += float(np.asarray(w[t])[slots].sum()) * rounded[t, slots[0]].astype(np.float64)
    tiled = np.asarray(numerics.jit(layer.experts_tiled)(x, w, idx))
    np.testing.assert_allclose(tiled, want, rtol=1e-5, atol=1e-6)
    for path in (layer.experts_cpu, layer.experts_routed):
        for rows in ([0], [0, 1, 2], list(range(40))):
            sel = tuple(a[jnp.asarray(rows)] for a in (x, w, idx))
            np.testing.assert_array_equal(np.asarray(numerics.jit(path)(*sel)), tiled[rows])


def test_the_combine_of_many_experts_builds_nothing_per_expert():
    """Combining a prefill chunk's pair outputs costs what the pairs hold: with 256 experts the
    compiled routed-experts step's scratch stays far below one [tokens, experts, hidden] array (the
    combine once built one: for DeepSeek-V4-Flash's 8K-token chunk, 34 GB)."""
    from hkv import numerics

    cfg = tiny_config(n_routed_experts=256, num_experts_per_tok=6)
    moe = next(l.ffn for l in init(cfg, seed=0).layers if not l.ffn.is_hash)
    n = 1024
    x = jax.ShapeDtypeStruct((n, cfg.hidden_size), jnp.float32)
    w = jax.ShapeDtypeStruct((n, moe.top_k), jnp.float32)
    idx = jax.ShapeDtypeStruct((n, moe.top_k), jnp.int32)
    per_expert = n * moe.n_experts * cfg.hidden_size * 4
    # the CPU path (XLA:CPU lowers `ragged_dot` itself to a dense masked product over every expert)
    temp = numerics.jit(moe.experts_cpu).lower(x, w, idx).compile().memory_analysis().temp_size_in_bytes
    assert temp < per_expert / 3, (temp, per_expert)  # 1.05x it before


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tiles_run_a_group_at_a_time_give_the_same_bits(layer, monkeypatch, dtype):
    """A prefill chunk whose tiles' gathered weights exceed `GATHER_BYTES` runs its tiles a group at a
    time (a loop); every token's output is the same bits as all tiles in one product."""
    from hkv import numerics
    from models.deepseek_v4 import moe

    x, idx, w = routed_inputs(layer, 300, 11, dtype)
    idx = jnp.asarray(idx, jnp.int32)
    whole = np.asarray(numerics.jit(layer.experts_tiled)(x, w, idx))
    per_tile = 3 * layer.w_gate.value.shape[1] * layer.w_gate.value.shape[2] * jnp.dtype(dtype).itemsize
    monkeypatch.setattr(moe, "GATHER_BYTES", 3 * per_tile)  # 3 tiles a group: the last group padded
    grouped = numerics.jit(layer.experts_tiled)
    assert "while" in grouped.lower(x, w, idx).as_text()
    np.testing.assert_array_equal(np.asarray(grouped(x, w, idx)), whole)


@pytest.fixture(scope="module")
def wide_layer():
    """A routed-experts layer of [256, 256] float32 experts, a shape whose XLA:CPU kernels sum rows
    2..32 in one order but not rows 2..64 (where this CPU's probe says so)."""
    cfg = tiny_config(hidden_size=256, moe_intermediate_size=256, n_routed_experts=8)
    return next(l.ffn for l in init(cfg, seed=0).layers if not l.ffn.is_hash)


def test_experts_whose_kernel_changes_below_a_tile_run_smaller_tiles_in_one_order(wide_layer):
    """Whatever tile this CPU's probe gives the experts, every path gives each token the same bits:
    its own experts (decode of a few tokens), every expert (a few more), or the tiles of a long prompt."""
    from hkv import numerics

    layer = wide_layer
    tile, floor = layer.stacks().tile(jnp.float32)
    assert floor == numerics.MIN_ROWS or tile == 64, (tile, floor)
    x, idx, w = routed_inputs(layer, 300, 5)
    idx = jnp.asarray(idx, jnp.int32)
    tiled = np.asarray(numerics.jit(layer.experts_tiled)(x, w, idx))
    for rows in ([4], [0, 1, 2], list(range(8)), list(range(tile)), list(range(tile + 1))):
        sel = tuple(a[jnp.asarray(rows)] for a in (x, w, idx))
        for path in (layer.experts_cpu, layer.experts_routed):
            np.testing.assert_array_equal(np.asarray(numerics.jit(path)(*sel)), tiled[rows], err_msg=f"{len(rows)}")


def test_a_decode_step_pads_expert_products_to_the_smaller_tiles_floor(wide_layer, monkeypatch):
    """Where float32 products of [256, 256] experts sum 2..32 rows in one order but not 2..64 (the probe
    of this VM's CPU), the experts run in tiles of 32 rows with a floor of 2: a decode step of 8 tokens
    multiplies 8 rows per expert, not 64 (the padding to 64 cost a mid-size model's batch-8 decode step
    most of its time)."""
    import hkv.numerics
    from hkv import numerics

    def probe(dtype, k, n, rows=None):  # this VM's CPU at [256, 256]
        return 64 if rows is None or rows > 32 else 2

    monkeypatch.setattr(hkv.numerics, "tile_rows_floor", probe)
    layer = wide_layer
    assert layer.stacks().tile(jnp.float32) == (32, 2)
    n, e, hidden = 8, layer.n_experts, 256
    x = jax.ShapeDtypeStruct((n, hidden), jnp.float32)
    w = jax.ShapeDtypeStruct((n, layer.top_k), jnp.float32)
    idx = jax.ShapeDtypeStruct((n, layer.top_k), jnp.int32)
    flops = numerics.jit(layer.experts_cpu).lower(x, w, idx).compile().cost_analysis()["flops"]
    padded = 3 * e * 64 * hidden * hidden * 2  # every expert's three products over 64 rows
    assert flops < padded / 4, (flops, padded)
