"""The decode loop a GPU runs (`hkv.core.decode.COUNTED_LOOP_PLATFORMS`): `steps` iterations whose count
XLA knows, so that no iteration's condition is read back to the host (issue 46), instead of a while
loop that stops when every row is done. Forced onto this CPU, it gives the early-stopping loop's
outputs and cache bit for bit: rows that finished, hit a stop id, or every row after a failed step,
idle through the remaining iterations and write nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hkv
from hkv.core import decode
from hkv.core.layout import Status
from models.deepseek_v4 import init, tiny_config

CFG = tiny_config()
HOT = hkv.SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def model():
    return init(CFG, seed=5)


def _run(model, monkeypatch, platforms, *, max_context, steps, budget, stop=(), sampling=None):
    monkeypatch.setattr(decode, "COUNTED_LOOP_PLATFORMS", platforms)
    layout = hkv.CacheLayout(
        model.cache_spec(block_tokens=8), hkv.CacheConfig(slots=2, max_context=max_context, page_size=4)
    )
    cache = hkv.init_cache(layout)
    slots = []
    for _ in range(2):
        cache, slot, _ = hkv.transitions.claim_slot(layout, cache)
        slots.append(int(slot))

    def loop(cache):  # traced anew for each setting (the platforms are read at trace time)
        return hkv.decode_loop(model, layout, cache, jnp.asarray([3, 17]), jnp.asarray(slots), steps=steps,
                               budget=jnp.asarray(budget), stop_token_ids=stop, sampling=sampling)  # fmt: skip

    compiled = jax.jit(loop).lower(cache).compile()
    cache, tokens, n_new, status = compiled(cache)
    return jax.tree.map(np.asarray, (cache, tokens, n_new, status)), compiled.as_text()


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "case",
    [
        dict(max_context=64, steps=8, budget=[8, 3]),  # row 1 finishes after 3 tokens, row 0 runs on
        dict(max_context=64, steps=8, budget=[2, 0]),  # every row done after 2 of 8 iterations
        dict(max_context=64, steps=6, budget=[6, 6], sampling=HOT),
        dict(max_context=16, steps=20, budget=[20, 20]),  # CONTEXT_CAP mid-loop: the rest idles
    ],
    ids=["one-row-done-early", "all-done-early", "sampled", "fails-mid-loop"],
)
def test_the_counted_loop_is_the_early_stopping_loop_bit_for_bit(model, monkeypatch, case):
    early, _ = _run(model, monkeypatch, (), **case)
    counted, text = _run(model, monkeypatch, ("cpu",), **case)
    _same(counted, early)
    assert "known_trip_count" in text  # XLA knows how often the loop runs
    if case["max_context"] == 16:
        assert int(early[3]) == Status.CONTEXT_CAP


def test_a_stop_id_ends_its_row_in_both_loops(model, monkeypatch):
    free, _ = _run(model, monkeypatch, (), max_context=64, steps=8, budget=[8, 8])
    stop = int(free[1][0, 2])  # row 0's third token
    early, _ = _run(model, monkeypatch, (), max_context=64, steps=8, budget=[8, 8], stop=(stop,))
    counted, _ = _run(model, monkeypatch, ("cpu",), max_context=64, steps=8, budget=[8, 8], stop=(stop,))
    _same(counted, early)
    assert int(early[2][0]) == 3


def test_shards_in_lockstep_iterate_together_and_each_keeps_its_own_loops_bits(model, monkeypatch):
    """Traced per data shard for a model whose step exchanges data across the shards (`lockstep_axes`:
    DeepSeek-V4 with its experts split over the data axis), the loop runs while any shard has rows to
    decode: shard 0 is done after 2 tokens, shard 1 runs 8 iterations, and each shard's tokens, counts,
    status and cache are its own early-stopping loop's bit for bit (a finished shard idles)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    budgets = [[2, 0], [8, 3]]
    wants = [_run(model, monkeypatch, (), max_context=64, steps=8, budget=b)[0] for b in budgets]
    layout = hkv.CacheLayout(model.cache_spec(block_tokens=8), hkv.CacheConfig(slots=2, max_context=64, page_size=4))
    cache = hkv.init_cache(layout)
    for _ in range(2):
        cache, _, _ = hkv.transitions.claim_slot(layout, cache)
    monkeypatch.setattr(type(model), "lockstep_axes", lambda self: ("data",))

    def per_shard(cache, budget):
        out = hkv.decode_loop(
            model, layout, cache, jnp.asarray([3, 17]), jnp.asarray([0, 1]), steps=8, budget=budget[0]
        )
        return jax.tree.map(lambda x: x[None], out)

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"),
                               axis_names={"data"}, check_vma=False))  # fmt: skip
    text = fn.lower(cache, jnp.asarray(budgets)).compile().as_text()
    got = jax.tree.map(np.asarray, fn(cache, jnp.asarray(budgets)))
    assert "all-reduce" in text  # the loop's condition asks every shard
    for d in range(2):
        _same(jax.tree.map(lambda x, d=d: x[d], got), wants[d])
    assert [int(n) for n in got[2][0]] == [2, 0] and [int(n) for n in got[2][1]] == [8, 3]
