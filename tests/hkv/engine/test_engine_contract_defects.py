"""Regression tests for the defects listed with the numerical contract (issue "Same tokens every time"):
each failed before its fix."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hkv
import hkv.testing
from hkv.engine.checkpoint import EngineCheckpointError
from models import deepseek_v4, toy
from models.stateless import greedy_stateless

TOY = toy.ToyConfig()
CONF = hkv.CacheConfig(slots=2, max_context=96, page_size=16, prefix_records=16)


@pytest.fixture(scope="module")
def model():
    return toy.init(TOY, seed=3)


@pytest.fixture(scope="module")
def engine(model):
    return hkv.Engine(model, CONF)


def test_n_valid_outside_the_chunk_is_a_bad_request_and_changes_nothing(model):
    """`n_valid` > chunk width (a 32-wide chunk, n_valid 40) or < 0 returned OK and moved the slot's
    length; now BAD_REQUEST, the cache unchanged, and the next valid step continues exactly."""
    layout = hkv.CacheLayout(model.cache_spec(), CONF)
    cache = hkv.init_cache(layout)
    cache, slot, _ = hkv.transitions.claim_slot(layout, cache)
    graphdef, weights = nnx.split(model)

    @hkv.numerics.jit
    def step(weights, cache, tokens, n_valid):
        m = nnx.merge(graphdef, weights)
        return hkv.step_and_sample(m, layout, cache, tokens, jnp.asarray([slot]), n_valid)

    prompt = np.random.default_rng(0).integers(0, TOY.vocab_size, 32)
    tokens = jnp.asarray(prompt[None], jnp.int32)
    for bad in (40, -1):
        cache, tok, _, status = step(weights, cache, tokens, jnp.asarray([bad]))
        assert int(status) == hkv.Status.BAD_REQUEST and int(tok[0]) == 0
        assert int(cache.lengths[slot]) == 0
    cache, tok, _, status = step(weights, cache, tokens, jnp.asarray([20]))
    assert int(status) == hkv.Status.OK and int(cache.lengths[slot]) == 20
    ref = np.asarray(nnx.merge(graphdef, weights)(jnp.asarray(prompt[None, :20])))[0, -1].argmax()
    assert int(tok[0]) == int(ref)


def test_deepseek_v4_stateless_forward_takes_prompts_shorter_than_a_window():
    """`forward_fn(model)(tokens)` raised for T < the CSA ratio (no compressed entry yet)."""
    model = deepseek_v4.init(deepseek_v4.tiny_config(), seed=0)
    fwd = deepseek_v4.forward_fn(model)
    full = np.asarray(fwd(jnp.asarray([[5, 7, 9, 11, 13]])))
    for t in (1, 2, 3):
        np.testing.assert_array_equal(np.asarray(fwd(jnp.asarray([[5, 7, 9, 11, 13][:t]]))), full[:, :t])
    toks, _ = greedy_stateless(model, [[5]], 2)
    # the layout and options of tests/hkv/engine/test_generation.py's engines: their compiled steps are
    # shared through the suite's compilation cache (a layout of its own cost ~25 s of compiling)
    config = hkv.CacheConfig(slots=2, max_context=160, page_size=8, prefix_records=32)
    engine = hkv.Engine(model, config, prefill_chunk=16, decode_steps=4, block_tokens=16)
    assert engine.generate([[5]], 2)[0].tokens == toks[0]


def test_a_plan_that_restored_its_whole_hash_hit_names_no_reason(engine, model):
    """`plan.reason` read `no_hash_match` when every hashed block was restored and the prompt simply went
    on past the cached chain."""
    rng = np.random.default_rng(4)
    first = rng.integers(0, TOY.vocab_size, 40).tolist()
    engine.generate([first], 2)
    longer = first[:32] + rng.integers(0, TOY.vocab_size, 40).tolist()
    (g,) = engine.generate([longer], 2)
    assert g.plan.hash_hit_tokens == 32 and g.plan.restored_tokens == 32
    assert g.plan.reason is None and g.plan.first_failed_stage is None
    (miss,) = engine.generate([rng.integers(0, TOY.vocab_size, 40).tolist()], 2)
    assert miss.plan.reason == hkv.Reason.NO_HASH_MATCH  # nothing matched: still a miss with its reason


def test_a_closed_engine_refuses_every_call(model):
    e = hkv.Engine(model, CONF)
    e.generate([[1, 2, 3]], 1)
    e.close()
    e.close()  # idempotent
    for call in (
        lambda: e.generate([[1, 2, 3]], 1),
        lambda: e.submit([1, 2, 3], 1),
        lambda: e.step(),
        lambda: e.warmup(),
        lambda: e.evict_prefixes(),
    ):
        with pytest.raises(hkv.EngineClosedError, match="closed"):
            call()


def test_save_refuses_queued_requests_and_unwritable_paths_by_name(engine, model, tmp_path):
    h = engine.submit([1, 2, 3, 4], 2)
    with pytest.raises(EngineCheckpointError, match="1 request"):
        engine.save(tmp_path / "ck")
    engine.run_until_idle()
    assert h.done
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(EngineCheckpointError, match="cannot save an engine checkpoint at") as err:
        engine.save(blocker / "ck")
    assert ".tmp-" not in str(err.value)  # the user's path, not an internal temporary name
    with pytest.raises(TypeError, match=r"flax\.nnx model"):
        hkv.Engine.restore(tmp_path / "ck", object())


def test_restore_keeps_the_settings_a_checkpoint_can_hold_and_names_the_others(model, tmp_path):
    e = hkv.Engine(model, CONF, decode_steps=3, restore_choice="longest", prefill_buckets=(16,),
                   kernel_options={"kernel_backend": "reference"})  # fmt: skip
    e.generate([[1, 2, 3, 4, 5]], 2)
    e.save(tmp_path / "ck")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = hkv.Engine.restore(tmp_path / "ck", model)
    assert (r.decode_steps, r.restore_choice, r.prefill_widths) == (3, "longest", (16, 32))
    assert any("kernel_options" in str(w.message) for w in caught), [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hkv.Engine.restore(tmp_path / "ck", model, kernel_options={"kernel_backend": "reference"})
    assert not [w for w in caught if "cannot hold" in str(w.message)]


def test_mesh_engine_saves_and_restores_and_a_mesh_checkpoint_needs_a_mesh(model, tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    m = hkv.MeshEngine(model, hkv.CacheConfig(slots=2, max_context=64, page_size=16, prefix_records=8), mesh=mesh)
    m.save(tmp_path / "ck")
    r = hkv.Engine.restore(tmp_path / "ck", model, mesh=mesh)
    assert isinstance(r, hkv.MeshEngine) and r.layout.config == m.layout.config
    with pytest.raises(EngineCheckpointError, match=r"is a MeshEngine's checkpoint"):
        hkv.Engine.restore(tmp_path / "ck", model)


@pytest.mark.parametrize(
    "config,message",
    [
        (hkv.CacheConfig(slots=2, max_context=40, page_size=256), "page_size=256 must be <= max_context=40"),
        (hkv.CacheConfig(slots=2, max_context=256, prefix_records=10**9), "past int32"),
        (hkv.CacheConfig(memory_bytes=1 << 38), "more than the device"),
    ],
)
def test_configurations_that_cannot_run_are_refused_when_the_engine_is_built(model, config, message):
    with pytest.raises(ValueError, match=message):
        hkv.Engine(model, config)


def test_check_invariants_names_a_cache_of_another_layout(model):
    a = hkv.CacheLayout(model.cache_spec(), CONF)
    b = hkv.CacheLayout(model.cache_spec(), hkv.CacheConfig(slots=3, max_context=96, page_size=16, prefix_records=16))
    with pytest.raises(ValueError, match="another spec or config"):
        hkv.check_invariants(a, hkv.init_cache(b))


def test_a_cache_dtype_unlike_the_activations_is_refused_by_name():
    """A model whose CacheSpec says bfloat16 but whose activations are float32 generated twice, then failed
    inside the decode kernel; check_model reported only a logit difference. Now the first call names it."""

    class Mismatched(toy.ToyModel):
        def cache_spec(self, block_tokens: int = 16, model_id: str = "toy") -> hkv.CacheSpec:
            spec = super().cache_spec(block_tokens, model_id)
            return hkv.CacheSpec(spec.layers, dtype="bfloat16", block_tokens=spec.block_tokens, model_id=model_id)

    m = Mismatched(TOY, nnx.Rngs(0))
    with pytest.raises(ValueError, match="K/V rows are float32 but the cache stores bfloat16"):
        hkv.Engine(m, CONF).generate([[1, 2, 3]], 1)
    with pytest.raises(AssertionError, match="K/V rows are float32 but the cache stores bfloat16"):
        hkv.testing.check_model(m, chunk_sizes=(16,), new_tokens=1)
