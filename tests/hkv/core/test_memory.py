"""Memory accounting for both model families: hkv's allocation vs the architectural minimum vs a uniform
full-KV cache, as `benchmarks/memory.py` prints it (no arrays are allocated)."""

from __future__ import annotations

import importlib.util
import pathlib

import hkv
from hkv.core.memory import allocated_bytes

SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "memory.py"
MIB = 2**20


def _script():
    spec = importlib.util.spec_from_file_location("memory_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gemma3_27b_minimum_is_the_hand_computed_kv_of_its_layers():
    _, spec = _script().gemma3()
    n = 131_072
    row = 2 * 16 * 128 * 2  # K and V of 16 heads x 128, bf16
    assert [l.window for l in spec.layers].count(None) == 10 and len(spec.layers) == 62
    want = (52 * 1023 + 10 * n) * row  # sliding layers keep window - 1 rows, full layers every row
    assert hkv.architectural_minimum(spec, n) == {"SWA": want, "COMPRESSED": 0, "INDEXER": 0, "TAIL": 0, "total": want}
    assert hkv.uniform_full_kv_bytes(spec, n, page_size=64) == 62 * n * row
    layout = hkv.CacheLayout(spec, hkv.CacheConfig(slots=1, max_context=n, page_size=64, prefix_records=0))
    alloc = allocated_bytes(layout)["total"]
    # full layers' pages exactly; sliding layers: old + new window pages mapped during a step
    assert alloc == (10 * n + 52 * 2 * (1024 // 64 + 1) * 64) * row
    assert alloc / want < 1.05


def test_script_prints_both_families(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["memory.py", "--contexts", "4096"])
    _script().main()
    out = capsys.readouterr().out
    assert "DeepSeek-V4-Flash: 43 layers" in out and "Gemma-3-27B: 62 layers (52 sliding, window 1024; 10 full)" in out
    assert out.count("hkv allocation / architectural minimum") == 2


# ------------------------------------------------------------------ memory-budget sizing (issue 13 item 2)
import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hkv.core.memory import allocated_total, auto_snapshots  # noqa: E402
from models.deepseek_v4 import init, tiny_config  # noqa: E402
from models.stateless import greedy_stateless  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return init(tiny_config(), 0)


def _spec(model, bt=16):
    return model.cache_spec(block_tokens=bt)


def test_memory_bytes_fills_the_budget_after_the_running_slots(tiny):
    spec = _spec(tiny)
    base = hkv.CacheLayout(spec, hkv.CacheConfig(slots=2, max_context=512, prefix_records=0))
    floor = allocated_total(base)
    for budget in (floor, floor + 200_000, 3 * floor, 10_000_000):
        layout = hkv.CacheLayout(spec, hkv.CacheConfig(slots=2, max_context=512, memory_bytes=budget))
        cfg, b = layout.config, layout.budget
        assert allocated_total(layout) == b.total <= budget
        assert b.requested == budget and b.cached_blocks == cfg.prefix_records
        assert b.running + b.prefix_pages + b.prefix_index + b.other == b.total
        for g in range(len(layout.groups)):  # the running slots always fit
            assert layout.pool_pages(g) >= base.pool_pages(g) == layout.reserved_pages(g)
        assert cfg.tail_snapshots == auto_snapshots(cfg.prefix_records, 2) and cfg.memory_bytes is None
        # the largest count that fits: one more cached block would not
        more = dataclasses.replace(cfg, prefix_records=cfg.prefix_records + 1, memory_bytes=None)
        more = dataclasses.replace(
            more,
            pool_pages=tuple(
                layout.reserved_pages(g) + layout.cached_block_pages(g, cfg.prefix_records + 1)
                for g in range(len(layout.groups))
            ),
            tail_snapshots=auto_snapshots(cfg.prefix_records + 1, 2),
        )
        assert allocated_total(hkv.CacheLayout(spec, more)) > budget
    assert (
        hkv.CacheLayout(spec, hkv.CacheConfig(slots=2, max_context=512, memory_bytes=floor)).config.prefix_records == 0
    )


def test_memory_bytes_below_the_reservation_or_mixed_with_explicit_sizes_is_refused(tiny):
    spec = _spec(tiny)
    floor = allocated_total(hkv.CacheLayout(spec, hkv.CacheConfig(slots=2, max_context=512, prefix_records=0)))
    with pytest.raises(
        ValueError, match=rf"memory_bytes={floor - 1:,} is below the {floor:,} bytes that 2 running slots"
    ):
        hkv.CacheLayout(spec, hkv.CacheConfig(slots=2, max_context=512, memory_bytes=floor - 1))
    with pytest.raises(ValueError, match="leave pool_pages None"):
        hkv.CacheConfig(memory_bytes=10**6, pool_pages=(4, 4, 4, 4))
    with pytest.raises(ValueError, match="leave prefix_records None"):
        hkv.CacheConfig(memory_bytes=10**6, prefix_records=8)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match=r"memory_bytes=.* must be a positive integer"):
            hkv.CacheConfig(memory_bytes=bad)


def test_prefix_cache_is_on_by_default_with_room_beside_the_running_slots(tiny):
    spec = _spec(tiny)
    on = hkv.CacheLayout(spec, hkv.CacheConfig(slots=2, max_context=512))
    off = hkv.CacheLayout(spec, hkv.CacheConfig(slots=2, max_context=512, prefix_records=0))
    assert on.config.prefix_records == 2 * 512 // 16  # as many cached tokens as the slots hold
    assert off.config.prefix_records == 0 and off.config.tail_snapshots == 0
    for g in range(len(on.groups)):
        assert off.pool_pages(g) == off.reserved_pages(g)
        assert on.pool_pages(g) == off.pool_pages(g) + on.cached_block_pages(g, on.config.prefix_records)
    assert off.budget.prefix_pages == 0 and on.budget.prefix_pages > 0


def test_defaults_restore_a_repeated_prompt_and_report_the_split(tiny):
    """Default engine settings but max_context: a second prompt sharing 95% of the first restores at
    least 90% of the shared tokens, with the tokens of an engine without a prefix cache. (Before the
    budget sizing the prefix cache was off by default and restored nothing; with records but the
    default pools it restored 0 tokens too: the cached blocks had no pages.) The tokens are the stateless
    forward's (an engine without a prefix cache, a layout of its own, cost ~20 s of compiling)."""
    rng = np.random.default_rng(5)
    n = 224
    cold = rng.integers(0, tiny.vocab_size, n).tolist()
    shared = int(0.95 * n)
    warm = cold[:shared] + rng.integers(0, tiny.vocab_size, n - shared).tolist()
    engine = hkv.Engine(tiny, hkv.CacheConfig(max_context=256))
    first = engine.generate([cold], 4)[0]
    second = engine.generate([warm], 4)[0]
    assert second.plan.restored_tokens >= 0.9 * shared, second.plan
    assert [first.tokens, second.tokens] == greedy_stateless(tiny, [cold, warm], 4)[0]
    report = engine.memory_report()
    split = report["split"]
    assert split["prefix_records"] == engine.layout.config.prefix_records == 4 * 256 // 16
    assert split["running"] + split["prefix_pages"] + split["prefix_index"] + split["other"] == split["total"]
    assert split["total"] == sum(leaf.nbytes for leaf in jax.tree.leaves(engine.cache))
    plain = hkv.CacheLayout(engine.layout.spec, hkv.CacheConfig(max_context=256, prefix_records=0))
    assert plain.budget.prefix_pages == 0  # memory_report's split is the layout's budget


def test_a_chunk_off_the_block_grid_leaves_the_default_prefix_cache_off_with_a_warning(tiny):
    with pytest.warns(
        UserWarning, match=r"prefill_chunk=24 is not a multiple of block_tokens=16: the prefix cache is off"
    ):
        engine = hkv.Engine(tiny, hkv.CacheConfig(slots=1, max_context=64), prefill_chunk=24)
    assert not engine.prefix_enabled and engine.layout.config.prefix_records == 0
    with pytest.raises(ValueError, match=r"prefill_chunk=24 must be a multiple of block_tokens=16"):
        hkv.Engine(tiny, hkv.CacheConfig(slots=1, max_context=64, memory_bytes=10**7), prefill_chunk=24)


def test_the_chunk_and_disk_checks_read_the_resolved_prefix_cache(tiny, tmp_path):
    """A memory budget that leaves no room for records turns the prefix cache off: an off-grid chunk is
    then fine (it was refused on the unresolved config), and a disk tier is refused by name."""
    floor = allocated_total(hkv.CacheLayout(_spec(tiny), hkv.CacheConfig(slots=1, max_context=64, prefix_records=0)))
    config = hkv.CacheConfig(slots=1, max_context=64, memory_bytes=floor)
    engine = hkv.Engine(tiny, config, prefill_chunk=24)
    assert not engine.prefix_enabled and engine.layout.config.prefix_records == 0
    with pytest.raises(ValueError, match=rf"the disk tier .* memory_bytes={floor:,} leaves 0 records"):
        hkv.Engine(tiny, config, disk=hkv.DiskTier(str(tmp_path / "d")))
    with pytest.raises(ValueError, match=r"the disk tier .*prefix_records=0 leaves 0 records"):
        hkv.Engine(
            tiny, hkv.CacheConfig(slots=1, max_context=64, prefix_records=0), disk=hkv.DiskTier(str(tmp_path / "e"))
        )
