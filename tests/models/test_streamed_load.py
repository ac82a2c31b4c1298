"""`load(path, mesh=...)` (issue 45, item 2): each device's slice of each weight read from the
memory-mapped shards of a many-shard release checkpoint and put on that device, sharded exactly as
`hkv.MeshEngine` shards the model, quantized weights kept quantized, host memory near one weight."""

from __future__ import annotations

import glob
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from hkv.engine.sharded import weight_shardings
from models.deepseek_v4 import DeepseekV4, expert_parallel_dim, load, random_tensors, tensor_parallel_dim, tiny_config
from models.deepseek_v4.checkpoint import read_checkpoint, read_config, read_safetensors
from models.deepseek_v4.release import write_release_checkpoint
from models.lazy_arrays import read
from models.placement import LazyStack, OnMesh, placing

CFG = tiny_config(hidden_size=512, moe_intermediate_size=256)


def mesh_of(data: int, model: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: data * model]).reshape(data, model), ("data", "model"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    path = tmp_path_factory.mktemp("many-shards")
    files = write_release_checkpoint(path, CFG, random_tensors(CFG, seed=6), fp8_block=32, max_shard_bytes=200_000)
    assert len([f for f in files if f.endswith(".safetensors")]) >= 15
    stored = [a.nbytes for f in glob.glob(str(path / "*.safetensors")) for a in read_safetensors(f).values()]
    return path, max(stored), sum(stored)


def flat(model) -> dict:
    return {k: v.get_value() for k, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize(
    ("shape", "expert_axes"),
    [((2, 4), ()), ((2, 2), ("data", "model"))],
    ids=["experts-over-model", "experts-over-all"],
)
def test_each_weight_lands_sharded_as_the_mesh_engine_shards_it(shards, shape, expert_axes):
    path, _, _ = shards
    mesh = mesh_of(*shape)
    model = load(path, dtype=jnp.float32, mesh=mesh, expert_axes=expert_axes)
    single = flat(load(path, dtype=jnp.float32))
    state = nnx.state(model)
    experts = {"expert_axes": expert_axes, "expert_dim_of": expert_parallel_dim}
    want = dict(nnx.to_flat_state(weight_shardings(state, mesh, "model", tensor_parallel_dim, **experts)))
    got = flat(model)
    assert got.keys() == single.keys()
    for k, a in got.items():
        assert a.sharding.is_equivalent_to(want[k].get_value(), a.ndim), (k, a.sharding, want[k])
        assert a.dtype == single[k].dtype and a.shape == single[k].shape, k
        np.testing.assert_array_equal(np.asarray(a), np.asarray(single[k]), err_msg=str(k))
    experts = [a for k, a in got.items() if k[-2:] == ("w_down", "data")]
    assert experts and all(a.dtype == jnp.uint8 for a in experts)
    ways = 4  # the experts over the model axis's 4 devices, or over (data, model) = (2, 2)
    for a in experts:  # each device its share of the experts, FP4 packed
        assert {s.data.shape[-3] for s in a.addressable_shards} == {CFG.n_routed_experts // ways}
        assert len({s.index[-3].start for s in a.addressable_shards}) == ways
    queries = [a for k, a in got.items() if k[-2:] == ("wq_b", "data") and "indexer" not in k]
    assert queries and all(a.dtype == jnp.float8_e4m3fn for a in queries)
    assert all({s.data.shape[-2] for s in a.addressable_shards} == {a.shape[-2] // shape[1]} for a in queries)


def test_host_memory_holds_about_one_weight_at_a_time(shards):
    path, largest, total = shards
    mesh = mesh_of(2, 4)
    load(path, dtype=jnp.bfloat16, mesh=mesh)  # compile the stacking once, outside the measurement
    cfg = read_config(path)
    tracemalloc.start()
    tensors = read_checkpoint(path, cfg, keep_quantized=True)  # memory-mapped views
    with placing(OnMesh(mesh, "model", tensor_parallel_dim)) as placement:
        model = DeepseekV4(cfg, tensors, jnp.bfloat16)
    final, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # What the placement itself reads and converts for one weight: at most the largest weight.
    assert 0 < placement.peak_staging_bytes <= largest
    # The process's transient host memory while loading (on CPU the devices' buffers are host memory
    # too, and stay: `final`): about one weight's worth (dequantizing on the host instead, as
    # `keep_quantized=False` does, takes 8x), while the checkpoint is over 20x that.
    assert peak - final <= 2 * largest, (peak, final, largest)
    assert total >= 20 * largest
    model_bytes = sum(a.nbytes for a in jax.tree.leaves(nnx.state(model)))
    assert placement.bytes_placed == model_bytes  # every weight went through the placement


def test_a_lazy_stack_reads_only_the_parts_asked_for():
    reads = []

    class Counting(np.ndarray):
        def __getitem__(self, index):
            reads.append(id(self))
            return super().__getitem__(index)

    parts = [np.arange(12, dtype=np.float32).reshape(3, 4).view(Counting) + i for i in range(4)]
    stack = LazyStack(parts, transpose=True)
    assert stack.shape == (4, 4, 3) and stack.dtype == np.float32 and stack.nbytes == 4 * 48
    reads.clear()
    got = stack[1:3, :2, 1:]
    np.testing.assert_array_equal(got, np.stack([np.asarray(p).T for p in parts])[1:3, :2, 1:])
    assert reads == [id(parts[1]), id(parts[2])]
    np.testing.assert_array_equal(np.asarray(stack), np.stack([np.asarray(p).T for p in parts]))
    with pytest.raises(ValueError, match=r"LazyStack parts differ"):
        LazyStack([np.zeros((2, 2)), np.zeros((2, 3))])


def test_a_bad_mesh_is_refused_and_a_bar_shows_the_bytes(shards, capsys):
    path, _, _ = shards
    with pytest.raises(ValueError, match=r"mesh=.* must be a jax.sharding.Mesh"):
        load(path, dtype=jnp.float32, mesh=[0, 1])
    load(path, dtype=jnp.float32, mesh=mesh_of(1, 2), progress_bars=True)
    assert "hkv: placing weights" in capsys.readouterr().err


@pytest.mark.parametrize("offset", [0, 8 + 13, 4096 + 5], ids=["from-0", "header", "past-a-page"])
def test_read_gives_the_slice_whether_it_preads_or_slices(tmp_path, offset):
    data = np.random.default_rng(0).standard_normal((6, 5, 4)).astype(np.float32)
    f = tmp_path / "t.bin"
    f.write_bytes(b"x" * offset + data.tobytes())
    mapped = np.memmap(f, dtype=np.uint8, mode="r", offset=offset)
    arr = mapped[: data.nbytes].view(np.float32).reshape(data.shape)
    for index in [
        (),
        (slice(1, 4),),
        (slice(2, 3), slice(None), slice(None)),
        (slice(None), slice(1, 3)),
        (slice(0, 6, 2),),
    ]:
        got = read(arr, index)
        assert type(got) is np.ndarray and got.flags.owndata
        np.testing.assert_array_equal(got, data[index] if index else data)
    np.testing.assert_array_equal(read(arr[3], ()), data[3])  # a view further in
