"""benchmarks/workload.py: the offline optimum it reports (Belady on blocks, checked against an exhaustive
search), the reusable-token accounting (fast), and the whole benchmark in a tiny configuration (slow)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from . import benchmark_script


@pytest.fixture
def wl(monkeypatch):
    """benchmarks/workload.py as a module."""
    return benchmark_script.load(monkeypatch, "workload")


def trace(wl, requests):
    """A TraceBlocks from (round, lookup chain, written chain) with string block names."""
    enc = lambda names: tuple(n.encode() for n in names)
    rounds = tuple(r for r, _, _ in requests)
    return wl.TraceBlocks(rounds, tuple(enc(l) for _, l, _ in requests), tuple(enc(w) for _, _, w in requests), 16)


def test_block_keys_depend_on_the_whole_prefix(wl):
    a = wl.block_keys((1,) * 16 + (2,) * 16 + (3,) * 5, 16)
    b = wl.block_keys((9,) * 16 + (2,) * 16, 16)
    assert len(a) == 2 and len(b) == 2  # whole blocks only
    assert a[1] != b[1]  # the same block after another prefix is another block
    assert wl.block_keys((1,) * 16 + (2,) * 16, 16) == a


def test_reusable_counts_only_earlier_rounds(wl):
    t = trace(
        wl,
        [
            (0, [], ["s0", "s1", "a"]),
            (0, ["s0", "s1"], ["s0", "s1", "b"]),  # same round as the first: nothing reusable yet
            (1, ["s0", "s1", "a", "x"], ["s0", "s1", "a", "x"]),
            (2, ["s0", "s1", "c"], ["s0", "s1", "c"]),
        ],
    )
    assert t.reusable_blocks() == [0, 0, 3, 2]
    assert t.working_set == 6


def test_belady_keeps_the_soonest_used_and_shallower_blocks(wl):
    t = trace(
        wl,
        [
            (0, [], ["p0", "p1", "p2"]),
            (0, [], ["q0", "q1"]),
            (1, ["p0", "p1", "p2"], ["p0", "p1", "p2", "p3"]),
            (2, ["q0", "q1"], ["q0", "q1"]),
        ],
    )
    assert wl.belady(t, 0) == [0, 0, 0, 0]
    assert wl.belady(t, 3) == [0, 0, 3, 0]  # p's next use comes first; q is gone by round 2
    assert wl.belady(t, 5) == [0, 0, 3, 2]
    # a tie on next use keeps the shallower block: capacity 2 restores p0 p1, not p1 p2 (worth nothing)
    assert wl.belady(t, 2) == [0, 0, 2, 0]
    with pytest.raises(ValueError, match="capacity=-1"):
        wl.belady(t, -1)


def exhaustive(t, capacity: int) -> int:
    """The most blocks any policy restores: every kept set of at most `capacity` blocks after every round."""
    rounds = sorted(set(t.rounds))

    def best(ri: int, held: frozenset) -> int:
        if ri == len(rounds):
            return 0
        idx = [i for i, r in enumerate(t.rounds) if r == rounds[ri]]
        hits = sum(_prefix(t.lookup[i], held) for i in idx)
        cands = sorted(held | {k for i in idx for k in t.writes[i]})
        return hits + max(
            best(ri + 1, frozenset(keep))
            for n in range(min(capacity, len(cands)) + 1)
            for keep in itertools.combinations(cands, n)
        )

    return best(0, frozenset())


def _prefix(chain, held) -> int:
    n = 0
    while n < len(chain) and chain[n] in held:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(12))
def test_belady_equals_the_exhaustive_optimum_on_small_traces(wl, seed):
    rng = np.random.default_rng(seed)
    stems = [[f"{s}{d}" for d in range(3)] for s in "abc"]  # three chains of depth 3 to branch from
    requests = []
    for r in range(3):
        for _ in range(2):
            stem = stems[int(rng.integers(0, 3))]
            look = stem[: int(rng.integers(0, 4))]
            own = f"n{r}{len(requests)}"
            requests.append((r, look, look + [own] if rng.random() < 0.5 else stem))
    t = trace(wl, requests)
    for cap in range(0, 5):
        assert sum(wl.belady(t, cap)) == exhaustive(t, cap), (seed, cap)


@pytest.mark.slow
def test_workload_benchmark_runs_exactly(wl, tmp_path):
    """The whole benchmark, tiny: every budget's tokens equal the engine without a prefix cache, and with
    the working set held the engine restores what Belady does within 5 points."""
    out = tmp_path / "w.json"
    argv = "--workloads chat --budgets 0.5,1.0 --users 3 --shared-users 2 --system-tokens 64 --first-tokens 32"
    argv += f" --message-tokens 32 --reply-tokens 4 --turns 3 --prefill-chunk 64 --json {out}"
    assert wl.main(argv.split()) == 0
    rows = json.loads(out.read_text())["results"]["chat"]
    assert [r["budget"] for r in rows] == ["none (cold)", "0.50", "1.00"]
    assert all(r["tokens_equal_cold"] for r in rows[1:])
    assert rows[2]["belady_pct"] == 100.0
    assert rows[2]["restored_pct"] >= 95.0
