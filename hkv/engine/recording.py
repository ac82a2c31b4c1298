"""The prefix manager's recording side, as plain pieces: admission control's memory of the chains
(`AdmissionMemory`), the boundaries a step crossed (`crossed`) and whether each keeps its snapshot
(`retains`), and the plan of a prefill step's interior snapshots (`wanted_snapshots`,
`interior_snapshots`).

Admission control (`hkv.core.policy`) lets a request that caches its own new blocks evict only chains
last used before its own previous use. That previous use is the prefix clock of the record its restore
ended at; or, for a request that restored nothing but whose content was refused a record slot before
(a conversation that comes back restores nothing: what it got cached holds no snapshot), the clock of
that refusal.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np

from ..core.layers import InteriorSnapshots
from ..core.policy import RetentionPolicy
from . import block_keys
from .block_keys import ROOT
from .requests import LiveRequest


class AdmissionMemory:
    """Prefix clocks admission control compares with (one engine's cache).

    Args:
      prefix_records: the cache's record capacity; at most max(64, 4 x it) refused chains are kept,
        the oldest go first.
    """

    def __init__(self, prefix_records: int):
        self.stamps: dict[int, int] = {}  # record -> prefix clock when it was last recorded
        # first block key of a chain refused a record slot -> prefix clock at the refusal
        self.refused: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.bound = max(64, 4 * prefix_records)

    def forget(self) -> None:
        """The device cache was replaced: its records and clock are gone."""
        self.stamps = {}
        self.refused.clear()

    def previous_use(self, seq: LiveRequest) -> int | None:
        """The prefix clock of seq's own previous use: that of the record its restore ended at
        (`seq.prev_use`); for a sequence that restored nothing, that of a refusal of its first block.
        None: neither (it may displace only never-reused chains).

        A refusal stands in only where nothing was restored: a conversation whose cached blocks hold no
        snapshot comes back empty-handed and would otherwise never be admitted. Letting it also move
        a restoring sequence's clock forward gave every user refused under pressure the right to evict
        the others' idle tails, which then missed and were refused in turn (`benchmarks/prefix_reuse.py`
        device only: 93.6% -> 88.0% restored, 130 -> 913 records evicted)."""
        if seq.prev_use is not None:
            return seq.prev_use
        return self.refused.get(seq.keys[0]) if seq.keys else None

    def refuse(self, seq: LiveRequest, clock: int) -> None:
        """Note that seq's chain was refused a record slot at prefix clock `clock`."""
        if not seq.keys:
            return
        self.refused[seq.keys[0]] = clock
        self.refused.move_to_end(seq.keys[0])
        while len(self.refused) > self.bound:
            self.refused.popitem(last=False)


def retains(retention: RetentionPolicy, block_tokens: int, seq: LiveRequest, n: int) -> bool:
    """Whether `retention` keeps the snapshot at seq's boundary after block n (its request's end, a
    branch point where a hit stopped short of its hash hit, or the policy's stride)."""
    final = len(seq.prompt) + seq.max_new - 1  # tokens this request will have written in the end
    at = n * block_tokens
    plan = seq.plan
    branch = plan is not None and plan.hash_hit_tokens == at and plan.restored_tokens < at
    return retention.retain(n, request_end=(n == final // block_tokens), branch_point=branch)


def crossed(
    seq: LiveRequest, block_tokens: int, salt: bytes, retain: Callable[[LiveRequest, int], bool]
) -> list[tuple[int, bool]]:
    """(block number, whether to keep its snapshot at the current length) of each boundary seq crossed
    since its last record, extending `seq.keys` with their chained keys (`salt`: the cache salt)."""
    bt, ids = block_tokens, seq.prompt + seq.tokens
    todo = []
    for n in range(len(seq.keys) + 1, seq.fed // bt + 1):
        seq.keys.append(block_keys.next_key(seq.keys[-1] if seq.keys else ROOT, ids[(n - 1) * bt : n * bt], salt))
        todo.append((n, n * bt == seq.fed and retain(seq, n)))
    return todo


def wanted_snapshots(
    rows: list[LiveRequest], ends: list[int], block_tokens: int, retain: Callable[[LiveRequest, int], bool]
) -> list[tuple]:
    """The block boundaries inside a prefill step that keep a snapshot, in the order they get slots
    (those that end a step first, then the later ones): (_, _, row j, column, block number n) for
    each boundary n * block_tokens in (seq.fed, ends[j]] of a row still recording with retain(seq, n)."""
    bt, wanted = block_tokens, []
    for j, seq in enumerate(rows):
        if seq.record_stopped:
            continue
        for col, n in enumerate(range(seq.fed // bt + 1, ends[j] // bt + 1)):
            if retain(seq, n):
                wanted.append((n * bt != ends[j], -n, j, col, n))
    return sorted(wanted)


def interior_snapshots(
    rows: list[LiveRequest], wanted: list[tuple], free: np.ndarray, b: int, c: int, block_tokens: int
) -> InteriorSnapshots:
    """The `InteriorSnapshots` [b, c // block_tokens + 1] of a step: the `wanted_snapshots` in order,
    each given the next free snapshot slot of `free` while they last. Sets each row's `staged`."""
    k = c // block_tokens + 1
    at, slot = np.full((b, k), -1, np.int32), np.full((b, k), -1, np.int32)
    for seq in rows:
        seq.staged = {}
    for (_, _, j, col, n), t in zip(wanted, free, strict=False):
        at[j, col], slot[j, col] = n * block_tokens, t
        rows[j].staged[n] = int(t)
    return InteriorSnapshots(at, slot)


__all__ = ["AdmissionMemory", "crossed", "interior_snapshots", "retains", "wanted_snapshots"]
