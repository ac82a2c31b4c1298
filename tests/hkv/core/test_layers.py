"""The model-facing API refuses bad input by name, at trace time (nothing runs, nothing is half-written)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import hkv

COMP = hkv.CompressorSpec(ratio=4, entry_dim=8, proj_width=8, overlap=False)
SPEC = hkv.CacheSpec(
    (
        hkv.LayerSpec.attention(8, 2, window=4),  # GQA, separate K and V: rows of 2 * 2 * 8
        hkv.LayerSpec.attention(8, 1, window=None),  # full attention
        hkv.LayerSpec.attention(8, 1, window=4, shared_kv=True, compressor=COMP),
    )
)
LAYOUT = hkv.CacheLayout(SPEC, hkv.CacheConfig(slots=2, max_context=32, page_size=4, prefix_records=0))


def trace(body):
    """Trace one prefill step of 3 tokens whose forward is `body(cache, step)`."""

    def run(cache):
        def forward(cache, step):
            out = body(cache, step)
            return (out if isinstance(out, hkv.HybridCache) else cache), jnp.zeros((2, 3, 5))

        return hkv.run_step(LAYOUT, cache, jnp.zeros((2, 3), jnp.int32), jnp.arange(2), jnp.full((2,), 3), forward)

    return jax.eval_shape(run, hkv.init_cache(LAYOUT))


def test_layer_spec_shapes():
    gqa, full, comp = SPEC.layers
    assert (gqa.kv_dim, gqa.head_dim, gqa.num_kv_heads, gqa.shared_kv) == (32, 8, 2, False)
    assert (full.window, comp.kv_dim, comp.shared_kv) == (None, 8, True)
    with pytest.raises(ValueError, match=r"kv_dim=12 must be a multiple of 8"):
        hkv.LayerSpec(12, 4, num_kv_heads=4, shared_kv=False)
    with pytest.raises(ValueError, match=r"num_kv_heads=0 must be an integer >= 1"):
        hkv.LayerSpec(8, 4, num_kv_heads=0)


def test_a_compressed_layer_without_a_window_is_refused():
    # Regression: accepted by the spec and the prefill path, then failed deep in the decode kernel's trace
    # ("window=None must be a static Python int").
    with pytest.raises(ValueError, match="a layer with a compressor needs a window"):
        hkv.LayerSpec.attention(8, 1, window=None, shared_kv=True, compressor=COMP)


@pytest.mark.parametrize(
    "body, match",
    [
        (lambda c, s: hkv.LayerCache(s, 3), r"layer=3 must be in \[0, 3\)"),
        (lambda c, s: hkv.LayerCache(s, 0).write_kv(c, jnp.zeros((2, 3, 1, 8))), r"k.shape=\(2, 3, 1, 8\) must be"),
        (lambda c, s: hkv.LayerCache(s, 0).write_kv(c, jnp.zeros((2, 3, 2, 8))), r"v.shape=None must equal"),
        (lambda c, s: hkv.LayerCache(s, 2).write_kv(c, jnp.zeros((2, 3, 1, 8)), jnp.ones((2, 3, 1, 8))), "pass v=None"),
        (lambda c, s: hkv.LayerCache(s, 0).attend(c, jnp.zeros((2, 3, 3, 8)), None), r"multiple of num_kv_heads=2"),
        (
            lambda c, s: hkv.LayerCache(s, 1).attend(c, jnp.zeros((2, 3, 2, 8)), None, compressed=True),
            "compressed attention needs a compressor",
        ),
        (
            lambda c, s: hkv.LayerCache(s, 1).attend(c, jnp.zeros((2, 3, 2, 8)), None, softcap=-1.0),
            r"softcap=-1.0 must be None or > 0",
        ),
        (lambda c, s: hkv.LayerCache(s, 0).index_topk(c, None, None, 2), "layer 0 has no indexer"),
        (
            lambda c, s: hkv.LayerCache(s, 2).compress(c, jnp.zeros((2, 3, 8)), jnp.zeros((2, 3, 8)), None, which="x"),
            "which='x' must be 'compressor' or 'indexer'",
        ),
        (
            lambda c, s: hkv.LayerCache(s, 2).compress(c, jnp.zeros((2, 3, 6)), jnp.zeros((2, 3, 6)), None),
            r"must be \[B, C, 8\]",
        ),
    ],
)
def test_bad_calls_are_named_errors(body, match):
    with pytest.raises(ValueError, match=match):
        trace(body)


def test_engine_refuses_a_model_without_the_protocol():
    with pytest.raises(TypeError, match=r"lacks \['vocab_size', 'cache_spec', 'cached_step', '__call__'\]"):
        hkv.Engine(object(), hkv.CacheConfig())


def test_the_pooling_runs_only_on_steps_that_close_a_window():
    # Regression (performance): the model's compress_fn ran on every decode step although a row closes
    # a window on 1 step in `ratio`; the pooling was ~10% of a tiny DeepSeek-V4 decode step on CPU.
    calls = []

    def fn(kv, gate, first_token, *_):
        jax.debug.callback(lambda first: calls.append(first.tolist()), first_token)
        return kv.reshape(kv.shape[0], -1, COMP.ratio, 8).sum(axis=2)

    @jax.jit
    def step(cache, tokens, n_valid):
        def forward(cache, st):
            view = hkv.LayerCache(st, 2)
            x = jnp.ones(st.tokens.shape + (8,)) * st.tokens[..., None]
            return view.compress(cache, x, x, fn), jnp.zeros(st.tokens.shape + (5,))

        return hkv.run_step(LAYOUT, cache, tokens, jnp.arange(2), n_valid, forward)[0]

    cache = hkv.init_cache(LAYOUT)
    for _ in range(2):
        cache, _, _ = hkv.transitions.claim_slot(LAYOUT, cache)
    # row 1 starts one step late: the rows close their windows on different steps
    for i in range(9):
        cache = step(cache, jnp.full((2, 1), i + 1, jnp.int32), jnp.array([1, int(i > 0)], jnp.int32))
    jax.effects_barrier()
    assert [int(n) for n in cache.lengths] == [9, 8]
    # row 0 closes windows at its tokens 4 and 8 (steps 3, 7), row 1 at its token 4 (step 4) and 8 (step 8)
    assert len(calls) == 4, calls
    assert int(cache.counters["entries_sealed"]) == 4
