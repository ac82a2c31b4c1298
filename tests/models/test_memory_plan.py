"""`models.memory_plan` (issue 45, item 5): the plan read off an abstract model is what the placed
model and its cache really hold, and `plan` finds the most slots that fit, temporaries included.
(The real configs' plan runs in tests/test_scaling_doc.py: docs/scaling.md quotes it. Compiling
the decode step for its temporaries is `slow`.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from hkv.core.state import init_cache
from models.deepseek_v4 import DeepseekV4, load, random_tensors, tensor_parallel_dim, tiny_config
from models.deepseek_v4.release import abstract_release_tensors, write_release_checkpoint
from models.memory_plan import (
    RESERVE_FRACTION,
    Platform,
    abstract_mesh,
    abstract_model,
    cache_bytes,
    compile_temporaries,
    layout_for,
    per_device_bytes,
    plan,
)

CFG = tiny_config()


def mesh_of(data: int, model: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: data * model]).reshape(data, model), ("data", "model"))


def build():
    return DeepseekV4(CFG, abstract_release_tensors(CFG, fp8_block=16), jnp.bfloat16)


def test_the_abstract_model_is_the_placed_model_byte_for_byte(tmp_path):
    write_release_checkpoint(tmp_path, CFG, random_tensors(CFG, seed=1), fp8_block=16)
    mesh = mesh_of(2, 4)
    placed = nnx.state(load(tmp_path, dtype=jnp.bfloat16, mesh=mesh))
    abstract = nnx.state(abstract_model(build, abstract_mesh((2, 4)), "model", tensor_parallel_dim))
    got, want = dict(nnx.to_flat_state(abstract)), dict(nnx.to_flat_state(placed))
    assert got.keys() == want.keys()
    for k, a in got.items():
        b = want[k].get_value()
        a = a.get_value()
        assert (a.shape, a.dtype, a.sharding.spec) == (b.shape, b.dtype, b.sharding.spec), k
    held: dict = {}  # bytes each device really holds
    for leaf in jax.tree.leaves(placed):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    assert per_device_bytes(abstract) == max(held.values())
    assert per_device_bytes(abstract) < sum(a.nbytes for a in jax.tree.leaves(placed))  # the experts are split


def test_cache_bytes_are_what_init_cache_allocates():
    spec = DeepseekV4(CFG, random_tensors(CFG), jnp.bfloat16).cache_spec(block_tokens=16)
    real = init_cache(layout_for(spec, 3, 256))
    assert cache_bytes(spec, 3, 256) == sum(x.nbytes for x in jax.tree.leaves(real))


def test_plan_finds_the_most_slots_that_fit_with_their_temporaries():
    model = abstract_model(build, abstract_mesh((2, 4)), "model", tensor_parallel_dim)
    spec = model.cache_spec(block_tokens=16)
    weights = per_device_bytes(nnx.state(model))
    per_slot = cache_bytes(spec, 2, 256) - cache_bytes(spec, 1, 256)
    hbm = int((weights + 10 * per_slot + 50_000) / (1 - RESERVE_FRACTION))
    node = Platform("test", 8, hbm, "made up")

    def temps(slots: int) -> int:  # growing faster than linear: the plan must check its answer
        return 1_000 * slots + 300 * slots * slots

    for temporaries in (None, temps):
        p = plan(model, spec, "tiny", node, (2, 4), 256, temporaries)
        assert p.fits and p.slots_per_node == 2 * p.slots_per_shard
        extra = (lambda s: temps(s)) if temporaries else (lambda s: 0)
        s = p.slots_per_shard
        assert weights + cache_bytes(spec, s, 256) + extra(s) <= p.usable_bytes
        assert weights + cache_bytes(spec, s + 1, 256) + extra(s + 1) > p.usable_bytes
    assert plan(model, spec, "tiny", Platform("small", 8, weights, "made up"), (2, 4), 256).slots_per_shard == 0
    with pytest.raises(ValueError, match=r"mesh \(4, 4\) has 16 devices; test has 8"):
        plan(model, spec, "tiny", node, (4, 4), 256)


@pytest.mark.slow
def test_compiled_temporaries_come_from_the_lowered_decode_step():
    mesh = mesh_of(1, 4)
    model = abstract_model(build, mesh, "model", tensor_parallel_dim)
    spec = model.cache_spec(block_tokens=16)
    one, four = (compile_temporaries(model, spec, mesh, s, 256) for s in (1, 4))
    assert 0 < one < four  # more slots, more scratch
    short, long = (compile_temporaries(model, spec, mesh, 1, 256, chunk=c) for c in (16, 128))
    assert one < short < long  # a prefill chunk: more tokens, more scratch


@pytest.mark.slow
def test_the_mesh_dispatch_temporaries_of_experts_over_every_device():
    """The "EP over all" layout's temporaries come from the mesh engine's own decode dispatch over the
    whole (8, 1) mesh (`ShardedSteps.decode_all`), its all-gathered tokens included."""
    from hkv.engine.weight_split import WeightSplit
    from models.deepseek_v4 import expert_parallel_dim
    from models.memory_plan import compile_mesh_temporaries

    cfg = tiny_config(n_routed_experts=8)
    mesh, axes = mesh_of(8, 1), ("data", "model")
    model = abstract_model(
        lambda: DeepseekV4(cfg, abstract_release_tensors(cfg), jnp.float32), mesh, "model", tensor_parallel_dim,
        expert_axes=axes, expert_dim_of=expert_parallel_dim,
    )  # fmt: skip
    g, j, _ = model.layers.locate(1)
    stack = model.layers.groups[g][j].ffn.w_gate.data.value  # a routed-expert stack: one expert per device
    assert stack.sharding.shard_shape(stack.shape)[-3] == 1
    split = WeightSplit(mesh, "model", tensor_parallel_dim, axes, expert_parallel_dim)
    spec = model.cache_spec(block_tokens=16)
    one, four = (compile_mesh_temporaries(model, spec, mesh, split, s, 256) for s in (1, 4))
    assert 0 < one < four
    short, long = (compile_mesh_temporaries(model, spec, mesh, split, 1, 256, chunk=c) for c in (16, 128))
    assert one < short < long  # the prefill dispatch: one row of `chunk` tokens on every shard
