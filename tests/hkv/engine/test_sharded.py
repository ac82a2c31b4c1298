"""`hkv.MeshEngine` on 8 CPU devices (tests/conftest.py forces them): data-parallel attention over
the mesh's "data" axis, the model tensor/expert-parallel over "model".

- tokens identical to the single-device `hkv.Engine` (greedy and seeded sampling), with prefix reuse
  routed to the shard that holds the prefix, and with a restore from a shared disk tier;
- every cache leaf sharded over the data axis (no pool replicated across shards), the data shards'
  pieces on disjoint devices, the weights split over the model axis where the model says so;
- the compiled decode step has no collective on a cache-shaped array (no cache byte crosses devices),
  and has the tensor-parallel all-reduces;
- one compilation per bucket for every shard together; the invariants hold on every shard;
- a saved mesh engine restores (`hkv.Engine.restore(path, model, mesh=)`) bit for bit, each prefix on
  its shard; another data-shard count is refused, and save waits for requests as `Engine.save` does.
The (4, 2) mesh runs in `make test`; (8, 1), (2, 4) and (1, 8) are `slow`.
"""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

import hkv
from hkv.core.policy import RetentionPolicy
from hkv.core.sampling import GREEDY, SamplingBatch
from hkv.engine.chat import tiny_chat_template
from hkv.engine.sharded import shard_config, weight_shardings
from hkv.engine.text import tiny_tokenizer
from hkv.store.tier import DiskTier
from models.deepseek_v4 import expert_parallel_dim, init, tensor_parallel_dim, tiny_config

CFG = tiny_config()
BT = 16
CONF = hkv.CacheConfig(slots=8, max_context=160, page_size=8, prefix_records=32)
OPTS = {"block_tokens": BT, "prefill_chunk": 32}
_rng = np.random.default_rng(1)
PROMPTS = [_rng.integers(0, CFG.vocab_size, n).tolist() for n in (40, 57, 33, 70)]
SEEDED = hkv.SamplingParams(temperature=0.9, top_k=20, seed=1234)
NEW = 6


def mesh_of(data: int, model: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: data * model]).reshape(data, model), ("data", "model"))


@pytest.fixture(scope="module")
def model():
    return init(CFG, seed=3)


@pytest.fixture(scope="module")
def reference(model):
    """The single-device engine's tokens: greedy, seeded, and a second turn continuing each prompt."""
    e = hkv.Engine(model, CONF, **OPTS)
    greedy = [g.tokens for g in e.generate(PROMPTS, NEW)]
    seeded = [g.tokens for g in e.generate(PROMPTS, NEW, sampling=SEEDED)]
    turn2 = [p + g + [5, 6, 7] for p, g in zip(PROMPTS, greedy, strict=True)]
    second = [g.tokens for g in e.generate(turn2, 4)]
    return {"greedy": greedy, "seeded": seeded, "turn2": turn2, "second": second}


def run_and_check(engine: hkv.MeshEngine, reference) -> None:
    """Greedy and seeded tokens == the single-device engine's; the second turn goes to the shard
    that served the first and restores its prefix there, with exact tokens."""
    first = engine.generate(PROMPTS, NEW)
    assert [g.tokens for g in first] == reference["greedy"]
    assert [g.tokens for g in engine.generate(PROMPTS, NEW, sampling=SEEDED)] == reference["seeded"]
    second = engine.generate(reference["turn2"], 4)
    assert [g.tokens for g in second] == reference["second"]
    for a, b, p in zip(first, second, reference["turn2"], strict=True):
        assert b.plan.shard == a.plan.shard, (a.plan, b.plan)
        assert b.plan.restored_tokens >= (len(p) - 4) // BT * BT - BT, b.plan
    for d in range(len(engine.shards)):
        hkv.check_invariants(engine.layout, engine.shard_cache(d))
    assert set(engine.compilations.values()) == {1}, engine.compilations


@pytest.fixture(scope="module")
def mesh_engine(model):
    """The one entry point: `hkv.Engine(..., mesh=)` builds the mesh engine."""
    engine = hkv.Engine(model, CONF, mesh=mesh_of(4, 2), tokenizer=tiny_tokenizer(CFG.vocab_size), **OPTS)
    assert isinstance(engine, hkv.MeshEngine) and len(engine.shards) == 4
    return engine


def test_shard_config_divides_every_capacity_and_names_what_does_not():
    local = shard_config(hkv.CacheConfig(slots=8, pool_pages=(40, 24), prefix_records=16, tail_snapshots=8), 4)
    assert (local.slots, local.pool_pages, local.prefix_records, local.tail_snapshots) == (2, (10, 6), 4, 2)
    with pytest.raises(ValueError, match=r"slots=6 must be a multiple of the mesh's data axis size 4"):
        shard_config(hkv.CacheConfig(slots=6), 4)
    with pytest.raises(ValueError, match=r"pool_pages\[1\]=30"):
        shard_config(hkv.CacheConfig(slots=8, pool_pages=(40, 30)), 4)
    budget = shard_config(hkv.CacheConfig(slots=8, memory_bytes=4_000_003), 4)  # each shard sizes its own part
    assert (budget.slots, budget.memory_bytes, budget.pool_pages, budget.prefix_records) == (2, 1_000_000, None, None)


def test_mesh_engine_refuses_a_bad_mesh(model):
    with pytest.raises(ValueError, match=r"must be a jax\.sharding\.Mesh"):
        hkv.MeshEngine(model, CONF, mesh=[0, 1])
    with pytest.raises(ValueError, match="data_axis='batch' is not an axis"):
        hkv.MeshEngine(model, CONF, mesh=mesh_of(4, 2), data_axis="batch")
    odd = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "model", "pipe"))
    with pytest.raises(ValueError, match=r"mesh axes \['pipe'\]"):
        hkv.MeshEngine(model, CONF, mesh=odd)


def test_deepseek_v4_weights_split_heads_and_experts_and_replicate_the_kv_head(model):
    _, weights = nnx.split(model)
    sh = weight_shardings(weights, mesh_of(4, 2), "model", tensor_parallel_dim)
    specs = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(sh)}

    def spec(layer, *names):
        g, j, _ = model.layers.locate(layer)
        key = f"['layers']['groups'][{g}][{j}]" + "".join(f"['{n}']" for n in names) + ".value"
        return specs[key]

    assert spec(1, "attn", "wq_b") == PartitionSpec("model", None)  # query heads
    assert spec(1, "attn", "wo_b") == PartitionSpec(None, "model")  # row-parallel output projection
    assert spec(1, "ffn", "w_up") == PartitionSpec("model", None, None)  # experts
    assert spec(1, "attn", "indexer", "wq_b") == PartitionSpec()  # the indexer is replicated (docs/numerics.md)
    assert spec(1, "attn", "wkv") == PartitionSpec()  # the one shared K=V head: replicated
    assert spec(1, "attn", "compressor", "wkv") == PartitionSpec()
    assert specs["['embed'].value"] == PartitionSpec("model", None)  # vocab parallel
    assert specs["['head'].value"] == PartitionSpec("model", None)


def test_stacked_layers_keep_their_repetition_axis_whole_and_split_the_same_dims():
    """Weights of a stacked run ([repetitions, ...], `models.deepseek_v4.layer_scan`) split the same
    dimension counted from the end; the leading repetition axis is never split."""
    from models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING

    cfg = tiny_config(num_hidden_layers=5, layer_types=(SLIDING, CSA, HCA, CSA, HCA),
                      mlp_layer_types=(HASH_MOE, MOE, MOE, MOE, MOE))  # fmt: skip
    stacked = init(cfg, seed=0)
    _, weights = nnx.split(stacked)
    sh = weight_shardings(weights, mesh_of(4, 2), "model", tensor_parallel_dim)
    specs = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(sh)}
    csa = "['layers']['groups'][1][0]"  # layers 1 and 3
    assert specs[csa + "['attn']['wq_b'].value"] == PartitionSpec(None, "model", None)
    assert specs[csa + "['attn']['wo_b'].value"] == PartitionSpec(None, None, "model")
    assert specs[csa + "['ffn']['w_up'].value"] == PartitionSpec(None, "model", None, None)
    assert specs[csa + "['attn']['indexer']['wq_b'].value"] == PartitionSpec()
    assert specs[csa + "['attn']['wkv'].value"] == PartitionSpec()
    # experts over every device of a (2, 2) mesh: the repetition axis whole, the expert axis split 4 ways
    over = weight_shardings(weights, mesh_of(2, 2), "model", tensor_parallel_dim,
                            expert_axes=("data", "model"), expert_dim_of=expert_parallel_dim)  # fmt: skip
    specs = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(over)}
    assert specs[csa + "['ffn']['w_up'].value"] == PartitionSpec(None, ("data", "model"), None, None)
    assert specs[csa + "['attn']['wq_b'].value"] == PartitionSpec(None, "model", None)


# slow: `make test` keeps the mesh's token equality and prefix routing through the README example below
@pytest.mark.slow
def test_mesh_tokens_equal_the_single_device_engine_with_prefix_routing(mesh_engine, reference):
    run_and_check(mesh_engine, reference)
    first = [g.plan.shard for g in mesh_engine.generate(PROMPTS, 1)]
    assert first == [g.plan.shard for g in mesh_engine.generate(PROMPTS, 1)]  # back where the prefix is
    assert sorted(first) == [0, 1, 2, 3]  # the first call spread four prompts over four idle shards


def test_every_cache_leaf_is_split_over_the_data_axis_on_disjoint_devices(mesh_engine):
    mesh = mesh_engine.mesh
    shardings = mesh_engine.cache_shardings()
    for path, leaf in jax.tree_util.tree_leaves_with_path(mesh_engine.cache):
        name = jax.tree_util.keystr(path)
        assert leaf.shape[0] == 4, name
        if leaf.size == 0:  # e.g. the overlap slice of a compressor without overlap: no bytes to place
            continue
        assert shardings[name].spec == PartitionSpec("data"), name
        assert not leaf.sharding.is_fully_replicated, name
    pool = mesh_engine.cache.groups[0].pool
    owners = {}
    for s in pool.addressable_shards:
        owners.setdefault(s.index[0].start, set()).add(s.device)
    assert sorted(owners) == [0, 1, 2, 3]
    for d, devs in owners.items():
        assert devs == set(mesh.devices[d].tolist())  # shard d lives on mesh row d: its model-axis devices
    assert pool.shape[1:] == mesh_engine.shard_cache(0).groups[0].pool.shape


def test_a_decode_step_moves_no_cache_bytes_between_devices(mesh_engine):
    """The compiled decode program's collectives all run within one data shard (replica groups of
    the model axis: nothing crosses the data axis), carry activations only (the tensor-parallel
    all-reduces, the expert counts), and none has the shape of a shard's pool, page table, state-table
    or prefix-index leaf."""
    e = mesh_engine.shards[0]
    s = mesh_engine.layout.slots
    z = np.zeros((s,), np.int32)
    args = (mesh_engine._weights, z, np.arange(s, dtype=np.int32), SamplingBatch.stack([GREEDY] * s), z,
            np.full((s, 1), -1, np.int32), e.decode_steps, False)  # fmt: skip
    hlo = e.steps.decode.lower(e.layout, mesh_engine.cache, *args).compile().as_text()
    ops = re.findall(
        r"= (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(.*?"
        r"replica_groups=(\[[\d,]*\]<=\[\d+\]|\{[\d,{}]*\})",
        hlo,
    )
    assert ops, "no collective at all: the model axis does no tensor parallelism"
    assert {op for _, op, _ in ops} <= {"all-reduce", "all-gather"}
    shards = {frozenset(range(2 * d, 2 * d + 2)) for d in range(4)}  # each data row's two devices

    def parse(groups: str) -> set[frozenset]:
        if groups.startswith("["):  # iota form "[4,2]<=[8]": ids 0..7 reshaped to [4, 2]
            shape = [int(x) for x in groups[1 : groups.index("]")].split(",")]
            return {frozenset(r) for r in np.arange(int(np.prod(shape))).reshape(shape).tolist()}
        return {frozenset(int(x) for x in g.split(",")) for g in re.findall(r"\{([\d,]+)\}", groups)}

    for _, op, groups in ops:
        assert parse(groups) == shards, f"{op} with replica groups {groups}: not within one data shard"
    cache_shapes = set()
    # leaves of a few elements are left out: their shapes are also activations' (the vocab-parallel
    # head's per-device candidates [model, slots] = (2, 2) here, gathered for sampling)
    for leaf in jax.tree.leaves(mesh_engine.shard_cache(0)):
        if leaf.ndim >= 2 and leaf.size >= 16:
            cache_shapes.add(tuple(leaf.shape))
            if leaf.ndim == 4:  # a pool [layers, pages, page_size, dim]: one layer's rows too
                cache_shapes.add(tuple(leaf.shape[1:]))
    for shape_text, op, _ in ops:
        for dims in re.findall(r"\[([\d,]*)\]", shape_text):
            shape = tuple(int(x) for x in dims.split(",") if x)
            assert shape not in cache_shapes, f"{op} on a cache-shaped array {shape}"


def check_disk_restore(engine: hkv.MeshEngine, reference) -> None:
    """Every shard's cached prefixes evicted to the shared disk tier; the second turns restore them
    from disk (on the shard each is routed to) with exact tokens."""
    assert engine.evict_prefixes() > 0
    engine.flush_disk()
    second = engine.generate(reference["turn2"], 4)
    assert [g.tokens for g in second] == reference["second"]
    assert all(g.plan.disk_tokens is not None and g.plan.disk_tokens[1] > 0 for g in second), [g.plan for g in second]
    for d in range(len(engine.shards)):
        hkv.check_invariants(engine.layout, engine.shard_cache(d))


@pytest.mark.slow  # ~100 s of compiling on a cold cache; `make test` keeps the README's mesh example
def test_mesh_restores_from_a_shared_disk_tier(model, reference, tmp_path):
    tier = DiskTier(str(tmp_path / "store"))
    engine = hkv.MeshEngine(model, CONF, mesh=mesh_of(4, 2), disk=tier, **OPTS)
    assert [g.tokens for g in engine.generate(PROMPTS, NEW)] == reference["greedy"]
    check_disk_restore(engine, reference)
    tier.close()


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(8, 1), (2, 4), (1, 8)])
def test_other_mesh_shapes_give_the_same_tokens(model, reference, shape, tmp_path):
    tier = DiskTier(str(tmp_path / "store"))
    engine = hkv.MeshEngine(model, CONF, mesh=mesh_of(*shape), disk=tier, **OPTS)
    run_and_check(engine, reference)
    check_disk_restore(engine, reference)
    tier.close()


@pytest.fixture(scope="module")
def saved_mesh(model, reference, tmp_path_factory):
    """A mesh engine that served the first turns, saved: (engine, its first turns, the checkpoint, the
    saved cache's host copy)."""
    engine = hkv.Engine(model, CONF, mesh=mesh_of(4, 2), **OPTS)
    first = engine.generate(PROMPTS, NEW)
    assert [g.tokens for g in first] == reference["greedy"]
    path = tmp_path_factory.mktemp("mesh-ckpt") / "ck"
    engine.save(path)
    return engine, first, path, jax.device_get(engine.cache)


def test_a_restored_mesh_engine_restores_each_prefix_on_its_shard(model, reference, saved_mesh):
    """`hkv.Engine.restore(path, model, mesh=)`: the stacked cache comes back bit for bit, placed as
    before; each shard's prefix manager knows its records; the second turns are routed to the shard
    that served the first and restore their prefixes there, with the single-device engine's tokens."""
    engine, first, path, saved = saved_mesh
    restored = hkv.Engine.restore(path, model, mesh=mesh_of(4, 2))
    assert isinstance(restored, hkv.MeshEngine) and len(restored.shards) == 4
    assert restored.layout.config == engine.layout.config and restored.routing == "prefix"
    was, now = engine.cache_shardings(), restored.cache_shardings()
    for k, x in jax.tree_util.tree_leaves_with_path(restored.cache):
        name = jax.tree_util.keystr(k)
        assert now[name] == was[name] or not x.size, name  # (zero-size leaves carry no bytes to place)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.cache), saved)
    assert [e.prefix_manager.recorded for e in restored.shards] == [True] * 4
    second = restored.generate(reference["turn2"], 4)
    assert [g.tokens for g in second] == reference["second"]
    for a, b, p in zip(first, second, reference["turn2"], strict=True):
        assert b.plan.shard == a.plan.shard, (a.plan, b.plan)
        assert b.plan.restored_tokens >= (len(p) - 4) // BT * BT - BT, b.plan
    for d in range(4):
        hkv.check_invariants(restored.layout, restored.shard_cache(d))


def test_a_mesh_checkpoint_restores_onto_as_many_data_shards_only(model, saved_mesh, tmp_path):
    """Another model-axis size is fine (a shard's cache is replicated within it); another data-shard
    count, a mesh without the data axis, no mesh, or a single-device checkpoint is a named error."""
    _, _, path, saved = saved_mesh
    narrow = hkv.MeshEngine.restore(path, model, mesh=mesh_of(4, 1))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(narrow.cache), saved)
    with pytest.raises(hkv.EngineCheckpointError, match=r"with 4 data shards, but this mesh's data axis 'data' has 2"):
        hkv.Engine.restore(path, model, mesh=mesh_of(2, 2))
    with pytest.raises(hkv.EngineCheckpointError, match=r"lacks"):
        hkv.MeshEngine.restore(path, model, mesh=Mesh(np.array(jax.devices()[:4]), ("rows",)))
    with pytest.raises(hkv.EngineCheckpointError, match=r"is a MeshEngine's checkpoint \(4 data shards"):
        hkv.Engine.restore(path, model)  # no mesh: a single-device engine cannot hold four shards
    single = tmp_path / "single"
    hkv.Engine(model, CONF, **OPTS).save(single)
    with pytest.raises(hkv.EngineCheckpointError, match=r"single-device engine's checkpoint, not a MeshEngine's"):
        hkv.MeshEngine.restore(single, model, mesh=mesh_of(4, 2))


def test_a_mesh_engine_saves_only_between_calls_as_an_engine_does(saved_mesh, tmp_path):
    engine = saved_mesh[0]
    handle = engine.submit(PROMPTS[1] + [9], 24)  # more tokens than a step decodes (decode_steps=8)
    with pytest.raises(hkv.EngineCheckpointError, match=r"1 request\(s\) submitted and not finished on data shard"):
        engine.save(tmp_path / "queued")
    engine.step()
    with pytest.raises(hkv.EngineCheckpointError, match=r"sequence\(s\) are running on data shard"):
        engine.save(tmp_path / "running")
    engine.run_until_idle()
    assert len(handle.result().tokens) == 24
    assert not (tmp_path / "queued").exists() and not (tmp_path / "running").exists()
    with pytest.raises(hkv.EngineCheckpointError, match=r"save the MeshEngine itself"):
        engine.shards[0].save(tmp_path / "one shard")
    with engine._drive_lock, pytest.raises(hkv.EngineBusyError):
        engine.save(tmp_path / "busy")
    engine.shards[2].restore_choice = "longest"  # a checkpoint holds one set of settings for every shard
    with pytest.raises(hkv.EngineCheckpointError, match=r"data shard 2 has restore_choice='longest' but shard 0"):
        engine.save(tmp_path / "mixed")
    engine.shards[2].restore_choice = engine.shards[0].restore_choice
    engine.save(tmp_path / "idle")  # between calls: saved
    assert hkv.engine.checkpoint.read_metadata(tmp_path / "idle")["mesh"]["data_shards"] == 4


def test_mesh_submit_streams_and_an_interrupt_leaves_every_shard_usable(mesh_engine, reference):
    handles = [mesh_engine.submit(p, NEW) for p in PROMPTS]
    assert mesh_engine.pending == len(PROMPTS)
    mesh_engine.run_until_idle()
    assert [h.result().tokens for h in handles] == reference["greedy"]
    assert [list(h) for h in handles] == reference["greedy"]  # the stream replays what was produced

    calls = []
    decode_all = mesh_engine._decode_all

    def interrupted():
        calls.append(1)
        if len(calls) == 1:  # mid-generation: every shard has requests admitted and decoding
            raise KeyboardInterrupt
        decode_all()

    mesh_engine._decode_all = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            mesh_engine.generate(PROMPTS, NEW)
    finally:
        del mesh_engine._decode_all
    assert mesh_engine.stats()["active_slots"] == 0 and mesh_engine.pending == 0
    for d in range(4):
        hkv.check_invariants(mesh_engine.layout, mesh_engine.shard_cache(d))
    assert [g.tokens for g in mesh_engine.generate(PROMPTS, NEW)] == reference["greedy"]


def test_mesh_submit_choices_and_chat(mesh_engine):
    """A mesh's `submit_choices` gives the choices `generate` gives (one shard, the later choices
    restoring the first's prefill there), and `chat` renders and stops as `Engine.chat` does."""
    prompt, s = list(range(3, 43)), hkv.SamplingParams(n=2, temperature=1.0, seed=5)
    want = mesh_engine.generate([prompt], 4, sampling=s)
    handles = mesh_engine.submit_choices(prompt, 4, sampling=s)
    mesh_engine.run_until_idle()
    got = [h.result() for h in handles]
    assert [g.tokens for g in got] == [g.tokens for g in want] and len({g.plan.shard for g in got}) == 1
    template = tiny_chat_template()
    msgs = [{"role": "user", "content": "the fox"}]
    (reply,) = mesh_engine.chat(msgs, 4, template=template)
    ids = template.encode(mesh_engine.shards[0].tokenizer, msgs)
    eos = mesh_engine.shards[0].tokenizer.eos_token_ids
    assert reply.tokens == mesh_engine.generate([ids], 4, stop_token_ids=eos)[0].tokens


def test_mesh_generate_text_equals_the_single_device_engine(model, mesh_engine):
    """`generate_text` on a mesh: texts routed to shards, stop strings cut each text as on one device."""
    one = hkv.Engine(model, CONF, tokenizer=tiny_tokenizer(CFG.vocab_size), **OPTS)
    texts = ["the quick brown fox", "jumps over", "a lazy dog and then some more words to read"]
    kw = dict(stop_token_ids=(), stop=["e"])
    want = one.generate_text(texts, NEW, **kw)
    got = mesh_engine.generate_text(texts, NEW, **kw)
    assert [(g.tokens, g.text, g.finish_reason) for g in got] == [(g.tokens, g.text, g.finish_reason) for g in want]
    assert {g.plan.shard for g in got} <= set(range(4)) and None not in {g.plan.shard for g in got}
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        hkv.MeshEngine(model, CONF, mesh=mesh_of(4, 2), **OPTS).generate_text(texts, 1)


def test_a_second_driving_thread_gets_engine_busy(mesh_engine):
    with mesh_engine._drive_lock:
        with pytest.raises(hkv.EngineBusyError):
            mesh_engine.generate(PROMPTS[:1], 1)
        with pytest.raises(hkv.EngineBusyError):
            mesh_engine.step()


def test_a_closed_mesh_engine_refuses_every_call_by_name(model):
    """`close()` retires every shard; the mesh's own calls then raise `EngineClosedError` (they took
    the shards' locks without asking whether the shards were closed)."""
    engine = hkv.Engine(model, CONF, mesh=mesh_of(4, 2), **OPTS)
    engine.close()
    for call in (lambda: engine.generate(PROMPTS[:1], 1), engine.step, engine.run_until_idle):
        with pytest.raises(hkv.EngineClosedError):
            call()


def test_the_shared_programs_key_holds_no_model():
    """Mesh engines of two models of one structure key their shared programs (`sharded_steps`) by an
    equal weight split, and that key keeps neither model alive once its engine is gone (the model's
    `tensor_parallel_dim` / `expert_parallel_dim` were bound methods: each model its own key, and
    the newest kept alive by the cache)."""
    import gc
    import weakref

    from hkv.engine.sharded import sharded_steps

    cfg = tiny_config(n_routed_experts=8)  # one expert per device of the (4, 2) mesh
    a, b = init(cfg, seed=5), init(cfg, seed=6)
    mesh = mesh_of(4, 2)
    ea = hkv.Engine(a, CONF, mesh=mesh, expert_axes=("data", "model"), **OPTS)
    eb = hkv.Engine(b, CONF, mesh=mesh, expert_axes=("data", "model"), **OPTS)
    assert ea.weight_split == eb.weight_split
    sharded_steps(nnx.split(a)[0], None, ea.layout, mesh, "data", ea.weight_split)
    gone = weakref.ref(a)
    ea.close()
    del ea, a
    gc.collect()
    assert gone() is None
    eb.close()


@pytest.mark.slow  # compiles a (4, 2) mesh engine's prefill and decode of its own
def test_mesh_decode_reads_its_read_bound_with_the_same_tokens(model, reference):
    """read_buckets=(64,): the 40- and 33-token prompts prefill and decode reading 64 tokens' entries,
    on every shard at once (decode[8@64]), with the single-device engine's tokens; the warm-up lists
    the decode of every read size, and runs it through a shard's view of the mesh steps."""
    engine = hkv.Engine(model, CONF, mesh=mesh_of(4, 2), read_buckets=(64,), **OPTS)
    picked = [PROMPTS[0], PROMPTS[2]]
    assert [g.tokens for g in engine.generate(picked, NEW)] == [reference["greedy"][0], reference["greedy"][2]]
    assert {n for n in engine.compilations if n.startswith("decode")} == {"decode[8@64]"}
    names = [n for _, _, n in engine.shards[0].compile_plan.model_steps(logits=False, stop_ids=1)]
    assert {n for n in names if n.startswith("decode")} == {"decode[8@64]", "decode[8]"}
    plan = engine.shards[0].compile_plan
    plan.timed(engine.shards[0].steps.decode, *plan.idle_decode_args(1, False, 64), name="decode[8@64]")
    assert engine.compilations["decode[8@64]"] == 1  # the program generate built, through the shard view


def test_balance_routing_ignores_cached_prefixes_and_spreads_by_load(model):
    engine = hkv.MeshEngine(model, CONF, mesh=mesh_of(4, 2), route="balance", **OPTS)
    first = [g.plan.shard for g in engine.generate(PROMPTS, 1)]
    assert sorted(first) == [0, 1, 2, 3]
    assert engine.cached_blocks(PROMPTS[0])[first[0]] == (len(PROMPTS[0]) - 1) // BT  # cached, not routed by
    with pytest.raises(ValueError, match="route='nearest' must be 'prefix' or 'balance'"):
        hkv.MeshEngine(model, CONF, mesh=mesh_of(4, 2), route="nearest", **OPTS)


def test_readme_mesh_example_runs_and_routes_the_second_turn_to_its_prefix(capsys):
    readme = (pathlib.Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme.split("### One engine over a mesh", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)  # the README's own example
    first, second = scope["first"], scope["second"]
    assert second[0].plan.shard == first[0].plan.shard and second[0].plan.restored_tokens == 32
    assert first[0].plan.shard != first[1].plan.shard
    assert capsys.readouterr().out.strip()


@pytest.mark.slow  # compiles a (8, 1) mesh engine of its own
def test_a_data_parallel_mesh_gives_the_same_logit_bits_as_one_device(model):
    """The numerical contract over a data-parallel mesh (docs/numerics.md): with no model axis, every
    shard runs the single-device programs on its own requests, so each token's logits are the same
    bits as the single-device engine's (a model axis adds partial sums across devices: tokens only)."""
    one = hkv.Engine(model, CONF, **OPTS).generate(PROMPTS, NEW, return_logits=True)
    mesh = hkv.MeshEngine(model, CONF, mesh=mesh_of(8, 1), **OPTS).generate(PROMPTS, NEW, return_logits=True)
    for i, (a, b) in enumerate(zip(one, mesh, strict=True)):
        assert a.tokens == b.tokens, i
        np.testing.assert_array_equal(np.asarray(b.logits), np.asarray(a.logits), err_msg=f"prompt {i}")


# ---------------------------------------------------- experts split over the data axis too (DP attention + EP)
EP_CFG = tiny_config(n_routed_experts=8)  # 8 experts: one per device on every 8-device mesh
RETAIN = RetentionPolicy(every_n_blocks=4)  # snapshots every 4 blocks: a hit at 7 rebuilds its window
EP_CONF = hkv.CacheConfig(slots=8, max_context=160, page_size=8, prefix_records=128)  # 16 records a shard at (8, 1)


@pytest.fixture(scope="module")
def ep_model():
    return init(EP_CFG, seed=3)


@pytest.fixture(scope="module")
def ep_reference(ep_model):
    """The single-device engine's tokens for the 8-expert model: greedy, seeded, a second turn, and
    a prompt that restores 7 blocks and rebuilds their window (`restore_window`)."""
    e = hkv.Engine(ep_model, EP_CONF, retention=RETAIN, **OPTS)
    greedy = [g.tokens for g in e.generate(PROMPTS, NEW)]
    seeded = [g.tokens for g in e.generate(PROMPTS, NEW, sampling=SEEDED)]
    turn2 = [p + g + [5, 6, 7] for p, g in zip(PROMPTS, greedy, strict=True)]
    second = [g.tokens for g in e.generate(turn2, 4)]
    base = _rng.integers(0, EP_CFG.vocab_size, 8 * BT + 5).tolist()
    rebuilt = base[: 7 * BT + 3] + [(t + 1) % EP_CFG.vocab_size for t in base[7 * BT + 3 : 7 * BT + 9]]
    e.generate([base], 2)
    (g,) = e.generate([rebuilt], 4)
    assert g.plan.window_recomputed is not None, g.plan
    return {"greedy": greedy, "seeded": seeded, "turn2": turn2, "second": second, "base": base,
            "rebuilt": rebuilt, "rebuilt_tokens": g.tokens}  # fmt: skip


@pytest.mark.slow  # ~1 min of compiling per mesh on a cold cache
@pytest.mark.parametrize("shape", [(4, 2), (8, 1), (2, 4)], ids=str)
def test_experts_split_over_data_and_model_keep_every_token(ep_model, ep_reference, shape):
    """`expert_axes=("data", "model")`: attention data-parallel, each device holding 8 / (D x M) of the
    experts; the tokens (greedy, seeded, a second turn restored on its shard, a window rebuilt by
    `restore_window`) are the single-device engine's, one program per bucket."""
    mesh = mesh_of(*shape)
    engine = hkv.MeshEngine(ep_model, EP_CONF, mesh=mesh, expert_axes=("data", "model"), retention=RETAIN, **OPTS)
    leaves = dict(nnx.to_flat_state(engine._weights))
    stacks = [v.value for k, v in leaves.items() if k[-1] in ("w_gate", "w_up", "w_down")]
    assert len(stacks) == 3 * EP_CFG.num_hidden_layers
    for w in stacks:  # one expert per device, every device a different one
        shards = w.addressable_shards
        assert len(shards) == 8 and all(s.data.shape[-3] == 1 for s in shards), w.sharding
        assert len({s.index[-3].start for s in shards}) == 8, w.sharding
    run_and_check(engine, ep_reference)
    engine.generate([ep_reference["base"]], 2)
    (g,) = engine.generate([ep_reference["rebuilt"]], 4)
    assert g.tokens == ep_reference["rebuilt_tokens"]
    assert g.plan.window_recomputed is not None, g.plan
    for d in range(len(engine.shards)):
        hkv.check_invariants(engine.layout, engine.shard_cache(d))


def test_expert_axes_are_checked_by_name(model, ep_model):
    """A bad `expert_axes` is refused before anything compiles: the data axis after another, an axis
    the mesh lacks, a split the experts do not divide (4 experts over 8 devices), a model without
    routed experts."""
    with pytest.raises(ValueError, match=r"data_axis='data', if present, first"):
        hkv.MeshEngine(ep_model, CONF, mesh=mesh_of(4, 2), expert_axes=("model", "data"), **OPTS)
    with pytest.raises(ValueError, match=r"expert_axes=\('data', 'expert'\) must be distinct axes of the mesh"):
        hkv.MeshEngine(ep_model, CONF, mesh=mesh_of(4, 2), expert_axes=("data", "expert"), **OPTS)
    with pytest.raises(ValueError, match=r"split the experts 8 ways, which does not divide the 4 experts of"):
        hkv.MeshEngine(model, CONF, mesh=mesh_of(4, 2), expert_axes=("data", "model"), **OPTS)
    from models.gemma3 import init as gemma_init
    from models.gemma3 import tiny_config as gemma_tiny

    with pytest.raises(ValueError, match=r"needs a model that names its routed experts"):
        hkv.MeshEngine(gemma_init(gemma_tiny(), seed=0), CONF, mesh=mesh_of(4, 2), expert_axes=("data",), **OPTS)
    # a good one: the experts' specs name both axes, and a checkpoint says the setting was not saved
    engine = hkv.MeshEngine(ep_model, CONF, mesh=mesh_of(4, 2), expert_axes=("data", "model"), **OPTS)
    specs = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(engine.weight_shardings)}
    g, j, _ = ep_model.layers.locate(1)
    layer = f"['layers']['groups'][{g}][{j}]"
    assert specs[layer + "['ffn']['w_down'].value"] == PartitionSpec(("data", "model"), None, None)
    assert specs[layer + "['attn']['wq_b'].value"] == PartitionSpec("model", None)  # heads: as without
    assert (
        engine.unsaved_settings()["expert_axes"]
        and not hkv.MeshEngine(ep_model, CONF, mesh=mesh_of(4, 2), **OPTS).unsaved_settings()["expert_axes"]
    )


@pytest.mark.slow  # compiles a (4, 2) EP engine's programs
def test_a_saved_ep_engine_restores_with_its_expert_axes_and_warns_without(ep_model, ep_reference, tmp_path):
    """`expert_axes` is a runtime setting a checkpoint does not hold: restored with it again, the second
    turns restore their prefixes with the single-device engine's tokens and the experts split over every
    device; restored without it, the warning names it."""
    axes = ("data", "model")
    engine = hkv.MeshEngine(ep_model, EP_CONF, mesh=mesh_of(4, 2), expert_axes=axes, retention=RETAIN, **OPTS)
    assert [g.tokens for g in engine.generate(PROMPTS, NEW)] == ep_reference["greedy"]
    engine.save(tmp_path / "ck")
    restored = hkv.Engine.restore(tmp_path / "ck", ep_model, mesh=mesh_of(4, 2), expert_axes=axes)
    assert restored.weight_split.expert_axes == axes
    second = restored.generate(ep_reference["turn2"], 4)
    assert [g.tokens for g in second] == ep_reference["second"]
    assert all(g.plan.restored_tokens > 0 for g in second), [g.plan for g in second]
    with pytest.warns(UserWarning, match=r"expert_axes"):
        plain = hkv.Engine.restore(tmp_path / "ck", ep_model, mesh=mesh_of(4, 2))
    assert plain.weight_split.expert_axes == ()


def _window_rebuild(model, reference, **kw):
    """A (4, 2) mesh engine that rebuilds a window (`restore_window`): the call's shard, program and
    arguments, the stacked cache before it, and the engine."""
    import dataclasses

    engine = hkv.MeshEngine(model, EP_CONF, mesh=mesh_of(4, 2), retention=RETAIN, **kw, **OPTS)
    calls = []
    for e in engine.shards:
        hooks = e.prefix_manager.hooks

        def tx(fn, *args, hooks=hooks, e=e):
            if fn is e.prefix_manager.steps.restore_window:
                calls.append((e.shard, fn, args, jax.device_get(engine.cache)))
            return hooks.tx(fn, *args)

        e.prefix_manager.hooks = dataclasses.replace(hooks, tx=tx)
    engine.generate([reference["base"]], 2)
    (g,) = engine.generate([reference["rebuilt"]], 4)
    assert g.tokens == reference["rebuilt_tokens"] and g.plan.window_recomputed is not None
    ((shard, fn, args, before),) = calls
    return shard, fn, args, before, engine


@pytest.mark.slow  # compiles two (4, 2) engines' programs
def test_an_ep_window_rebuild_keeps_no_second_copy_of_the_pools(ep_model, ep_reference):
    """The window rebuild under `expert_axes` runs on every shard (its MoE exchanges tokens), and the
    shards that do not rebuild write nothing: their caches are bit for bit what they were, and no
    shard keeps its old cache beside the new one. (The first version selected between the two over
    every leaf, and XLA kept a copy of the pools: its program needed more than a shard's pools of
    scratch beyond the model-axis engine's `lax.cond` program.)"""
    shard, fn, args, before, engine = _window_rebuild(ep_model, ep_reference, expert_axes=("data", "model"))
    after = jax.device_get(engine.cache)
    flat_before = dict(jax.tree_util.tree_leaves_with_path(before))
    for path, a in jax.tree_util.tree_leaves_with_path(after):
        name = jax.tree_util.keystr(path)
        if "counters" not in name:
            for d in set(range(4)) - {shard}:
                np.testing.assert_array_equal(np.asarray(a)[d], np.asarray(flat_before[path])[d], err_msg=name)
    temps = fn.lower(engine.layout, engine.cache, *args).compile().memory_analysis().temp_size_in_bytes
    _, plain_fn, plain_args, _, plain = _window_rebuild(ep_model, ep_reference)
    plain_temps = plain_fn.lower(plain.layout, plain.cache, *plain_args).compile().memory_analysis().temp_size_in_bytes
    pools = sum(x.nbytes for x in jax.tree.leaves(engine.cache.groups)) // 4  # one shard's pages and pools
    # (tiny model, 2026-12-07: the select's program 2.05 MB, this one 1.77 MB, the `lax.cond` one 1.53 MB,
    # one shard's pools 0.40 MB)
    assert temps < plain_temps + pools, (temps, plain_temps, pools)
