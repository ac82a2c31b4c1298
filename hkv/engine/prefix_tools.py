"""Prefix reuse for a decode loop you write yourself (what `Engine` does, as public pieces).

    q = hkv.PrefixQuery.of(prompt, layout)                       # host: chained block keys
    cache, slot, _ = hkv.transitions.claim_slot(layout, cache)
    cache, dplan = hkv.restore_prefix(layout, cache, slot, *q.args)   # jittable: lookup+validate+claim
    plan = q.plan(dplan)                                          # host `RestorePlan`: what came back
    # run prompt[plan.restored_tokens:] with hkv.step_and_sample, then hkv.decode_loop ...
    cache, last = hkv.record_prefix(layout, cache, slot, prompt + new_tokens[:-1])   # cache the blocks
    cache, _ = hkv.transitions.release_slot(layout, cache, slot)

`restore_prefix` is `hkv.core.prefix.restore`: it validates every candidate block in four stages
(hash, lifecycle, ABI, intersection) and claims only what passes, so a restored prefix is exact or
absent, never wrong; the `RestorePlan` says how far each stage got and why it stopped. `record_prefix`
records every full block of the slot's tokens not yet recorded, keeping an SWA + TAIL snapshot at the
last boundary when the slot's length ends exactly there. `evict_cached` frees cached objects (see
`hkv.core.prefix.evict`); `Engine` chooses what to evict with `hkv.core.policy.eviction_order`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..core import prefix as px
from ..core.layout import CacheLayout, Status
from ..core.plan import DevicePlan, RestorePlan
from ..core.state import HybridCache
from . import block_keys
from .block_keys import key_words

restore_prefix = px.restore
evict_cached = px.evict

_record_many = jax.jit(px.record_many, static_argnums=0, donate_argnums=1)
RECORD_BATCH = 128  # most block boundaries one `record_many` transition records (a restore from disk: hundreds)


@dataclasses.dataclass(frozen=True)
class PrefixQuery:
    """The lookup arguments of one prompt (host arrays).

    Attributes:
      keys: uint32[NB, 4] chained block keys (NB = max_context // block_tokens; rows past the
        prompt's full blocks are zero).
      tokens: int32[NB, block_tokens] each block's ids (stage 1 compares them: a key collision
        cannot restore another prompt's blocks).
      n_blocks: blocks a restore may use: (len(prompt) - 1) // block_tokens, so at least one token
        is left to compute the next token's logits from.
      prompt_tokens: len(prompt).
      block_tokens: the layout's block size.
    """

    keys: np.ndarray
    tokens: np.ndarray
    n_blocks: int
    prompt_tokens: int
    block_tokens: int

    @classmethod
    def of(cls, prompt: Sequence[int], layout: CacheLayout, salt: bytes = b"") -> PrefixQuery:
        """Keys of `prompt`'s full blocks for `layout` (salt: as `Engine(cache_salt=...)`)."""
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt must be a non-empty 1-D sequence of token ids; got shape {ids.shape}")
        bt = layout.spec.block_tokens
        nb = layout.config.max_context // bt
        if ids.size > layout.config.max_context:
            raise ValueError(f"prompt of {ids.size} tokens exceeds max_context={layout.config.max_context}")
        keys = np.zeros((nb, 4), np.uint32)
        toks = np.zeros((nb, bt), np.int32)
        for i, k in enumerate(block_keys.chain_keys(ids.tolist(), bt, extra=bytes(salt))):
            keys[i], toks[i] = key_words(k), ids[i * bt : (i + 1) * bt]
        return cls(keys, toks, (ids.size - 1) // bt, int(ids.size), bt)

    @property
    def args(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, tokens, n_blocks) — the arguments `restore_prefix` takes after the slot."""
        return self.keys, self.tokens, np.int32(self.n_blocks)

    def plan(self, device_plan: DevicePlan) -> RestorePlan:
        """The host `RestorePlan` of a `restore_prefix` result (one device-to-host transfer)."""
        return RestorePlan.from_device(device_plan.host(), self.block_tokens, self.prompt_tokens)


def _index(name: str, value, lo: int, hi: int) -> int:
    """`value` (an int, a numpy integer or a concrete integer jax scalar) as an int in [lo, hi), else
    ValueError naming it and the range."""
    a = np.asarray(value)
    if a.shape != () or a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer) or not lo <= int(a) < hi:
        raise ValueError(f"{name}={value!r} must be an integer in [{lo}, {hi})")
    return int(a)


def record_prefix(
    layout: CacheLayout,
    cache: HybridCache,
    slot: int,
    tokens: Sequence[int],
    *,
    parent: int = -1,
    start_block: int = 0,
    retain_snapshot: bool = True,
    salt: bytes = b"",
) -> tuple[HybridCache, int]:
    """Record the full blocks of `tokens` (the slot's tokens in the cache, oldest first) from block
    `start_block` on, as the chain after record `parent` (-1: from the root). Host function (it runs
    jitted `record_many` transitions; the cache is donated).

    Args:
      layout, cache: the cache; `slot` holds `tokens` (its length is len(tokens)).
      tokens: every token the slot has written.
      parent: the record of block start_block - 1 (-1 when start_block is 0); `RestorePlan` of the
        slot's restore gives it as the chain's end.
      retain_snapshot: keep the SWA + TAIL snapshot at the last boundary if the slot ends exactly on
        it (a later request can then restore the whole prefix).
      salt: as in `PrefixQuery.of`.

    Returns:
      (cache, the last record of the chain): -1 if nothing was recorded. A block refused for lack of
      record slots or pages ends the chain there (evict with `evict_cached` and call again from it).
    Raises:
      ValueError: `slot` not an integer in [0, layout.slots), `parent` not in [-1, prefix_records),
        `start_block` not in [0, len(tokens) // block_tokens], or a token that is not an integer
        (nothing is recorded then).
    """
    bt = layout.spec.block_tokens
    slot = _index("slot", slot, 0, layout.slots)
    parent = _index("parent", parent, -1, layout.config.prefix_records)
    for i, t in enumerate(tokens):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"tokens[{i}]={t!r} must be an integer token id")
    ids = [int(t) for t in tokens]
    start_block = _index("start_block", start_block, 0, len(ids) // bt + 1)
    keys = block_keys.chain_keys(ids, bt, extra=bytes(salt))
    todo = list(range(start_block, len(keys)))
    last = parent
    slot = jnp.int32(slot)
    for i in range(0, len(todo), RECORD_BATCH):
        batch = todo[i : i + RECORD_BATCH]
        args = pack_records(
            [
                (keys[b], ids[b * bt : (b + 1) * bt], (b + 1) * bt, retain_snapshot and (b + 1) * bt == len(ids))
                for b in batch
            ],
            bt,
        )
        cache, recs, statuses, done = _record_many(layout, cache, slot, args[0], jnp.int32(last), *args[1:])
        recs, statuses, done = jax.device_get((recs, statuses, done))
        ok = [
            int(r) for r, s in zip(recs[: int(done)], statuses[: int(done)], strict=True) if s == Status.OK and r >= 0
        ]
        if ok:
            last = ok[-1]
        if int(done) < len(batch):
            break
    return cache, last


def pack_records(
    blocks: Sequence[tuple[bytes, Sequence[int], int, bool]], block_tokens: int
) -> tuple[jnp.ndarray, ...]:
    """The batched block arguments of one `record_many` transition (engine and `record_prefix` alike).

    Args:
      blocks: 1 to RECORD_BATCH consecutive blocks of one chain, oldest first, each (chained key,
        its block_tokens token ids, the slot length at its end, keep its SWA + TAIL snapshot).
      block_tokens: the layout's block size.

    Returns:
      (keys uint32[k, 4], tokens int32[k, block_tokens], retain bool[k], lengths int32[k], valid bool[k]),
      padded to k = RECORD_BATCH rows (one compilation; the transition's loop stops at the first
      padding row); valid marks the real rows.
    """
    if not 1 <= len(blocks) <= RECORD_BATCH:
        raise ValueError(f"{len(blocks)} blocks; one transition records 1 to {RECORD_BATCH}")
    k = RECORD_BATCH
    keys = np.zeros((k, 4), np.uint32)
    toks = np.zeros((k, block_tokens), np.int32)
    lengths = np.zeros((k,), np.int32)
    retain = np.zeros((k,), bool)
    for j, (key, ids, length, keep) in enumerate(blocks):
        keys[j], toks[j], lengths[j], retain[j] = key_words(key), ids, length, keep
    # host arrays: the jitted record step takes them as they are (`jnp.asarray` of a host array
    # builds a small program per shape in a fresh process, on the request's path)
    return keys, toks, retain, lengths, np.arange(k) < len(blocks)
