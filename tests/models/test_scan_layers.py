"""Decoder layers under `jax.lax.scan` (models.deepseek_v4.layer_scan) compute what the Python loop computes.

The stateless forward is bitwise equal. The cached step is equal up to float32 rounding: XLA may
order a reduction differently inside a loop body than in straight-line code (seen: the 16-row pooling
sum of an HCA compressor, a few ulp), so logits are compared to 1e-5 and greedy picks must match;
the cache's bookkeeping (lengths, page tables, counters) must be identical.
"""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hkv.core import transitions as tr
from hkv.core.layers import LayerRun, plan_layer_runs
from hkv.core.layout import CacheConfig, CacheLayout
from hkv.core.state import init_cache
from models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, tiny_config
from models.deepseek_v4.layer_scan import layer_runs
from models.deepseek_v4.model import init

# layer 0 unrolled (sliding, hash routing), then (CSA, HCA) x 2 under one scan of period 2
REPEATING = tiny_config(num_hidden_layers=5, layer_types=(SLIDING, CSA, HCA, CSA, HCA),
                        mlp_layer_types=(HASH_MOE, MOE, MOE, MOE, MOE))  # fmt: skip
# nothing repeats: every layer unrolled
IRREGULAR = tiny_config(num_hidden_layers=3, layer_types=(SLIDING, CSA, HCA), mlp_layer_types=(HASH_MOE, MOE, MOE))


# ------------------------------------------------------------------------------ the plan
@pytest.mark.parametrize(
    "keys, want",
    [
        ("abcd", [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1)]),
        ("aaaa", [(0, 1, 4)]),
        ("xababab", [(0, 1, 1), (1, 2, 3)]),
        ("aaabcbcbc", [(0, 1, 3), (3, 2, 3)]),
        ("abcabcab", [(0, 1, 1), (1, 1, 1), (2, 3, 2)]),  # ties: the earliest layers stay unrolled
    ],
)
def test_plan_covers_every_layer_and_scans_what_repeats(keys, want):
    runs = plan_layer_runs(list(keys))
    assert [(r.start, r.period, r.count) for r in runs] == want
    assert [i for r in runs for i in range(r.start, r.stop)] == list(range(len(keys)))


def test_deepseek_v4_pattern_at_43_layers_traces_three_layer_bodies():
    cfg = tiny_config(num_hidden_layers=43, layer_types=(), mlp_layer_types=())
    keys = list(zip(cfg.layer_types, cfg.mlp_layer_types, strict=True))
    assert plan_layer_runs(keys) == (LayerRun(0, 1, 3), LayerRun(3, 2, 20))


def test_model_runs_follow_the_layer_structure():
    model = init(REPEATING, 0)
    spec = model.cache_spec()
    assert model.layers.runs == (LayerRun(0, 1, 1), LayerRun(1, 2, 2))
    assert layer_runs(model, True, spec) == ((None, LayerRun(0, 1, 1)), (1, LayerRun(1, 2, 2)))
    assert layer_runs(model, False, spec) == tuple((None, LayerRun(i, 1, 1)) for i in range(5))
    assert all(r.count == 1 for _, r in layer_runs(init(IRREGULAR, 0), True))


# ------------------------------------------------------------------------------ stateless
@pytest.mark.parametrize("cfg", [REPEATING, IRREGULAR], ids=["repeating", "irregular"])
def test_stateless_forward_scanned_equals_unrolled(cfg):
    model = init(cfg, 1)
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 37)), jnp.int32)
    fwd = jax.jit(lambda s, t, scan: nnx.merge(graphdef, s)(t, scan_layers=scan), static_argnums=2)
    np.testing.assert_array_equal(np.asarray(fwd(state, tokens, True)), np.asarray(fwd(state, tokens, False)))


# --------------------------------------------------------------------------------- cached
def _run_cached(model, scan: bool, chunks):
    """Run `chunks` [(tokens int32[2, C], n_valid int32[2])] as consecutive steps of slots 0 and 1.
    Returns (cache, [float32[2, C, vocab] logits per step])."""
    layout = CacheLayout(model.cache_spec(), CacheConfig(slots=3, max_context=64, page_size=4, prefix_records=0))
    graphdef, weights = nnx.split(model)

    @jax.jit
    def step(cache, weights, toks, slots, n_valid):
        return nnx.merge(graphdef, weights).cached_step(layout, cache, toks, slots, n_valid, scan_layers=scan)

    cache = init_cache(layout)
    for _ in range(2):
        cache, _, _ = tr.claim_slot(layout, cache)
    slots = jnp.array([0, 1], jnp.int32)
    logits = []
    for toks, n_valid in chunks:
        cache, lg, st = step(cache, weights, toks, slots, jnp.asarray(n_valid, jnp.int32))
        assert int(st) == 0
        logits.append(np.asarray(lg))
    return cache, logits


def _assert_same(model, chunks):
    cache_s, scanned = _run_cached(model, True, chunks)
    cache_u, unrolled = _run_cached(model, False, chunks)
    for s, u in zip(scanned, unrolled, strict=True):
        np.testing.assert_allclose(s, u, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(s.argmax(-1), u.argmax(-1))
    for a, b in zip(jax.tree.leaves(cache_s), jax.tree.leaves(cache_u), strict=True):
        if jnp.issubdtype(a.dtype, jnp.floating):  # pools and tails (overlap gates hold -inf)
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
        else:  # lengths, page tables, refcounts, counters, the state table
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cached_prefill_scanned_equals_unrolled():
    """Two chunks of 16 (row 1's second chunk ends mid compression window): CSA and HCA entries sealed."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, REPEATING.vocab_size, (2, 32)), jnp.int32)
    _assert_same(init(REPEATING, 2), [(tokens[:, :16], [16, 16]), (tokens[:, 16:], [16, 11])])


def test_cached_decode_scanned_equals_unrolled():
    """18 decode steps from an empty cache (row 1 idle on odd steps): the Pallas-path ops (jnp reference
    on CPU) with the traced pool index; CSA entries sealed every 4 tokens, one HCA entry at 16."""
    tokens = np.random.default_rng(2).integers(0, REPEATING.vocab_size, (2, 18))
    chunks = [(jnp.asarray(tokens[:, d : d + 1], jnp.int32), [1, 1 - d % 2]) for d in range(18)]
    _assert_same(init(REPEATING, 3), chunks)


def _stacked_leaves(model) -> list:
    """The weights of `model.layers`' stacked runs (leading axis = repetition)."""
    runs = model.layers.runs
    return [x for g, r in enumerate(runs) if r.count > 1 for x in jax.tree.leaves(nnx.state(model.layers.groups[g]))]


def test_repeating_layers_are_held_stacked_and_a_scan_takes_them_uncopied():
    """The model holds each repeating run's weights stacked (built once), so a jitted step passes them
    to the scan as they are: no per-call stacking copy of the weights (a real checkpoint scans too)."""
    model = init(REPEATING, 0)
    stacked = _stacked_leaves(model)
    assert stacked and all(x.shape[0] == 2 for x in stacked)  # (CSA, HCA) x 2
    graphdef, state = nnx.split(model)
    leaves = jax.tree.leaves(state)
    tokens = jnp.zeros((1, 8), jnp.int32)
    rebuild = lambda w: nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), w))
    # the stateless forward: the stacked leaves are the scan's operands themselves
    jaxpr = jax.make_jaxpr(lambda *w: rebuild(w)(tokens))(*leaves).jaxpr
    scanned = [v for e in jaxpr.eqns if e.primitive.name == "scan" for v in e.invars]
    by_id = {id(x): v for x, v in zip(leaves, jaxpr.invars, strict=True)}
    assert all(any(by_id[id(x)] is v for v in scanned) for x in stacked)
    # both forwards and the cached step: nothing anywhere builds an array of a stacked weight's shape
    shapes = {(tuple(x.shape), x.dtype) for x in stacked}
    for fn in (lambda *w: rebuild(w)(tokens), lambda *w: _cached_logits(rebuild(w))):
        built = [e for e in _eqns(jax.make_jaxpr(fn)(*leaves).jaxpr) if e.primitive.name in ("stack", "concatenate")]
        assert not [e for e in built if (tuple(e.outvars[0].aval.shape), e.outvars[0].aval.dtype) in shapes]


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in its equations (scan bodies, cond branches)."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def _cached_logits(model):
    layout = CacheLayout(model.cache_spec(), CacheConfig(slots=1, max_context=32, page_size=4, prefix_records=0))
    cache, _, _ = tr.claim_slot(layout, init_cache(layout))
    one = jnp.ones((1,), jnp.int32)
    return model.cached_step(layout, cache, jnp.zeros((1, 4), jnp.int32), one * 0, one * 4)[1]


def test_layer_views_read_and_write_the_stacked_weights():
    """`model.layers[i]` of a stacked run reads layer i's slice (equal to its checkpoint tensor), writes
    its `.value` back into the stack (the state the next `nnx.split` passes on holds it, the other
    repetition keeps its weights), refuses a wrong shape or an unsafe dtype, and runs the layer."""
    from models.deepseek_v4.layer_scan import LayerView
    from models.deepseek_v4.model import random_tensors

    model = init(REPEATING, 0)
    tensors = random_tensors(REPEATING, 0)
    assert len(model.layers) == 5 and len(list(model.layers)) == 5
    assert not isinstance(model.layers[0], LayerView) and isinstance(model.layers[3], LayerView)
    for i in range(5):
        np.testing.assert_array_equal(
            np.asarray(model.layers[i].attn.wq_a.value), tensors[f"layers.{i}.attn.wq_a.weight"]
        )
    assert model.layers[-1].attn.compressor.ratio == model.layers[2].attn.compressor.ratio  # static attributes
    with pytest.raises(IndexError, match="5"):
        model.layers[5]
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, REPEATING.vocab_size, (1, 12)), jnp.int32)
    w = model.layers[3].ffn.w_down
    w.value = w.value * 2.0
    ref = init(REPEATING, 0)
    np.testing.assert_array_equal(
        np.asarray(model.layers[3].ffn.w_down.value), 2.0 * np.asarray(ref.layers[3].ffn.w_down.value)
    )
    np.testing.assert_array_equal(
        np.asarray(model.layers[1].ffn.w_down.value), np.asarray(ref.layers[1].ffn.w_down.value)
    )
    g, j, r = model.layers.locate(3)  # what the next nnx.split (an Engine, a jitted step) passes on
    held = nnx.split(model)[1]["layers"]["groups"][g][j]["ffn"]["w_down"]
    np.testing.assert_array_equal(np.asarray(held.get_value()[r]), np.asarray(w.value))
    with pytest.raises(ValueError, match="shape"):
        w.value = w.value[:1]
    with pytest.raises(ValueError, match="unsafe cast"):
        w.value = jnp.ones(w.shape, jnp.complex64)
    with pytest.raises(AttributeError, match="value"):
        model.layers[3].eps = 0.5
    # the rest of the Variable API: [...], get_value / set_value, jnp.asarray, an indexed write
    v = model.layers[3].attn.wq_a
    np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(v.get_value()))
    np.testing.assert_array_equal(np.asarray(jnp.asarray(v)), np.asarray(v.value))
    v[0, :3] = jnp.zeros(3)
    assert float(jnp.abs(model.layers[3].attn.wq_a.value[0, :3]).max()) == 0.0
    assert float(jnp.abs(model.layers[1].attn.wq_a.value[0, :3]).max()) > 0.0  # the other repetition
    v.set_value(ref.layers[3].attn.wq_a.value)
    np.testing.assert_array_equal(np.asarray(v.value), np.asarray(ref.layers[3].attn.wq_a.value))
    # a sequence: slices, numpy integer indices
    assert [type(x).__name__ for x in model.layers[0:3]] == ["DecoderLayer", "LayerView", "LayerView"]
    assert model.layers[np.int64(3)] == model.layers[3] != model.layers[1]
    # copies and methods act on the layer's own weights, never on the whole stack
    copied = copy.deepcopy(model.layers[3])
    assert not isinstance(copied, LayerView) and copied.attn.wq_a.value.shape == v.shape
    with pytest.raises(TypeError, match="pickle the model"):
        pickle.dumps(model.layers[3])
    # NNX and JAX refuse a view by name (nnx.split returned a state whose one leaf was the view itself,
    # nnx.state raised IndexError); its module() is what they take
    for refuse in (nnx.split, nnx.state, jax.tree.leaves):
        with pytest.raises(TypeError, match=r"not a module or a pytree: pass `view.module\(\)`"):
            refuse(model.layers[3])
    np.testing.assert_array_equal(
        np.asarray(nnx.state(model.layers[3].module())["attn"]["wq_a"].get_value()), np.asarray(v.value)
    )
    x = jnp.asarray(
        np.random.default_rng(6).normal(size=(1, 12, REPEATING.hc_mult, REPEATING.hidden_size)), jnp.float32
    )
    np.testing.assert_array_equal(
        np.asarray(model.layers[3].ffn_block(x, tokens)), np.asarray(model.layers.module(3).ffn_block(x, tokens))
    )
    streams = model.embed_streams(tokens)
    positions = jnp.arange(12, dtype=jnp.int32)[None]
    args = (tokens, positions, model.rope_tables(positions), model.freqs)
    np.testing.assert_array_equal(
        np.asarray(model.layers[3](streams, *args)), np.asarray(model.layers.module(3)(streams, *args))
    )


# ---------------------------------------------------------------------------------- Gemma 3
def test_gemma3_holds_its_sliding_layers_stacked_and_scans_them_like_the_loop():
    """Gemma 3 uses the same `LayerStack`: 5 sliding layers stacked, the full layer alone; the scanned
    stateless forward and cached steps equal the loop (to float32 rounding, same greedy picks)."""
    from models import gemma3
    from models.layer_stack import LayerView

    model = gemma3.init(gemma3.tiny_config(), 0)
    assert model.layers.runs == (LayerRun(0, 1, 5), LayerRun(5, 1, 1))
    assert isinstance(model.layers[3], LayerView) and model.layers[3].layer_type == gemma3.SLIDING
    assert model.layers[5].layer_type == gemma3.FULL
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 512, (2, 40)), jnp.int32)
    fwd = jax.jit(lambda s, t, scan: nnx.merge(graphdef, s)(t, scan_layers=scan), static_argnums=2)
    scanned, unrolled = np.asarray(fwd(state, tokens, True)), np.asarray(fwd(state, tokens, False))
    np.testing.assert_allclose(scanned, unrolled, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(scanned.argmax(-1), unrolled.argmax(-1))
    _assert_same(model, [(tokens[:, :16], [16, 16]), (tokens[:, 16:32], [16, 9]), (tokens[:, 32:33], [1, 1])])


def test_gemma3_27b_pattern_traces_seven_layer_bodies():
    """62 layers, (5 sliding : 1 full) x 10 then 2 sliding: a scan over the first 2 sliding layers, then one
    of period 6 (sliding x 3, full, sliding x 2) x 10: 7 layer bodies traced instead of 62."""
    from models import gemma3

    cfg = gemma3.gemma3_27b_config()
    assert plan_layer_runs(list(cfg.layer_types)) == (LayerRun(0, 1, 2), LayerRun(2, 6, 10))


# ------------------------------------------------------------------------- stacked or not
def test_stack_by_default_stacks_deep_models_and_small_layers_only():
    from models.layer_stack import STACK_DEPTH, STACK_SMALL_BYTES, stack_by_default

    assert stack_by_default(STACK_DEPTH + 1, 10 * STACK_SMALL_BYTES)  # deep: compile time
    assert stack_by_default(8, STACK_SMALL_BYTES - 1)  # small layers: nothing to copy
    assert not stack_by_default(8, 4 * STACK_SMALL_BYTES)  # shallow, large layers: one module each


def test_an_unstacked_model_holds_one_module_per_layer_and_computes_as_the_stacked_one(monkeypatch):
    """`STACK_LAYERS = False` (or large shallow layers by default): no run is stacked, layer i is a
    plain module, and the stateless forward and cached steps agree with the stacked model's."""
    from models import gemma3
    from models import layer_stack as ls

    stacked = gemma3.init(gemma3.tiny_config(), 0)
    monkeypatch.setattr(ls, "STACK_LAYERS", False)
    flat = gemma3.init(gemma3.tiny_config(), 0)
    assert flat.layers.runs == tuple(LayerRun(i, 1, 1) for i in range(6))
    assert not isinstance(flat.layers[3], ls.LayerView)
    np.testing.assert_array_equal(
        np.asarray(flat.layers[3].attn.qkv_proj.value), np.asarray(stacked.layers[3].attn.qkv_proj.value)
    )
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 512, (2, 40)), jnp.int32)
    a, b = np.asarray(jax.jit(lambda t: stacked(t))(tokens)), np.asarray(jax.jit(lambda t: flat(t))(tokens))
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
    chunks = [(tokens[:, :16], [16, 16]), (tokens[:, 16:32], [16, 9]), (tokens[:, 32:33], [1, 1])]
    for s, u in zip(_run_cached(stacked, True, chunks)[1], _run_cached(flat, True, chunks)[1], strict=True):
        np.testing.assert_allclose(s, u, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(s.argmax(-1), u.argmax(-1))
