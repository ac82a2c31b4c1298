"""A window rebuild cannot restore a full-attention layer (issue 11 #10, issue 12 #5).

`prefix.restore(recompute=R)` claims only COMPRESSED / INDEXER rows and leaves the SWA window to be
rebuilt by re-running [L - R, L). A full-attention layer (window=None) needs every row before L, and
the rebuild claims none of its rows: the rebuilt cache read zeros for rows before L - R (a
hand-written Gemma-style model restored with max |logit error| 1.32 and status OK). The
route is now refused for such specs, at trace time in the core and by the engine's choice.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hkv.core import prefix as px
from hkv.core import transitions as tr
from hkv.core.layout import CacheConfig, CacheLayout, Status
from hkv.core.policy import receptive_field, window_rebuild_tokens
from hkv.core.reasons import Reason
from tests.hkv.core.chains import record_chain
from tests.hkv.core.test_state_machine import Harness, deepseek_like_spec, gemma_like_spec

BT = 8


def _recorded_chain(spec, blocks=3, *, retain=False, tail_snapshots=None):
    """A slot filled with blocks * BT tokens, every boundary recorded (without a snapshot unless
    `retain` and a snapshot slot is free), then released; a fresh slot claimed. Returns (layout,
    cache, fresh slot, keys, tokens)."""
    config = CacheConfig(slots=2, max_context=48, page_size=4, prefix_records=8, tail_snapshots=tail_snapshots)
    layout = CacheLayout(spec, config)
    h = Harness(layout)
    s = h.claim()
    assert h.append([(s, blocks * BT)]) == Status.OK
    cache, keys, toks, _ = record_chain(layout, h.cache, s, blocks, retain=retain)
    cache, _ = tr.release_slot(layout, cache, jnp.int32(s))
    cache, slot, st = tr.claim_slot(layout, cache)
    assert int(st) == Status.OK
    return layout, cache, slot, jnp.asarray(keys), jnp.asarray(toks)


def test_window_rebuild_is_refused_for_a_spec_with_full_attention_layers():
    spec = gemma_like_spec()  # window-6 layers alternating with full-attention layers
    assert receptive_field(spec) == 10 and window_rebuild_tokens(spec) == 0
    layout, cache, slot, keys, toks = _recorded_chain(spec)
    with pytest.raises(ValueError, match="full-attention"):
        px.restore(layout, cache, slot, keys, toks, jnp.int32(3), recompute=receptive_field(spec))
    # without a snapshot the plain route restores nothing (swa_missing), never a partial full layer
    _, plan = px.restore(layout, cache, slot, keys, toks, jnp.int32(3))
    v = plan.host()
    assert v.hash_blocks == 3 and v.byte_blocks == 0 and v.reason == Reason.SWA_MISSING.code


@pytest.mark.parametrize("retain", [False, True])
def test_a_layout_without_snapshot_slots_records_and_rebuilds_windows(retain):
    """CacheConfig(tail_snapshots=0) is accepted, so recording must work without snapshot slots
    (it failed to trace: argmax of the empty free-slot mask, then a read of the empty snapshot
    pool): the records keep the compressed entries and a restore rebuilds the window."""
    spec = deepseek_like_spec()
    layout, cache, slot, keys, toks = _recorded_chain(spec, blocks=4, retain=retain, tail_snapshots=0)
    assert layout.tail_snapshots == 0
    assert not np.asarray(cache.prefix.swa_held).any() and (np.asarray(cache.prefix.tail_slot) == -1).all()
    _, plan = px.restore(layout, cache, slot, keys, toks, jnp.int32(4))
    assert plan.host().byte_blocks == 0  # nothing restores as it is: no record holds a window
    _, plan = px.restore(layout, cache, slot, keys, toks, jnp.int32(4), recompute=window_rebuild_tokens(spec))
    v = plan.host()
    assert v.status == Status.OK and v.byte_blocks == 4


def test_window_rebuild_still_serves_specs_whose_layers_all_have_windows():
    spec = deepseek_like_spec()
    r = window_rebuild_tokens(spec)
    assert r == receptive_field(spec) > 0
    layout, cache, slot, keys, toks = _recorded_chain(spec, blocks=4)
    _, plan = px.restore(layout, cache, slot, keys, toks, jnp.int32(4), recompute=r)
    v = plan.host()
    assert v.status == Status.OK and v.byte_blocks == 4
