"""benchmarks/roofline.py measures what it says: a product's GFLOP/s from its own timing, and a floor
that is each kind of the prefill's FLOPs at the throughput of its own shapes (issue 45, item 6)."""

from __future__ import annotations

from models.deepseek_v4 import init, tiny_config
from models.deepseek_v4.flops import prefill_flops, weight_products

from . import benchmark_script


def test_the_floor_is_each_kinds_flops_at_its_shapes_throughput(monkeypatch):
    rf = benchmark_script.load(monkeypatch, "roofline")
    rate = rf.measure(2, 8, 16, 32, repeats=1)
    assert (rate.batch, rate.rows, rate.k, rate.n) == (2, 8, 16, 32) and rate.gflops > 0
    model = init(tiny_config(), seed=0)
    flops = prefill_flops(model, 64)
    floor, detail = rf.floor_seconds(model, flops, chunk=32, repeats=1)
    assert floor == detail["weights"] + detail["attention"] + detail["indexer"] > 0
    assert detail["attention"] == flops.attention / (detail["attention_rate"].gflops * 1e9)
    assert detail["indexer"] == flops.indexer / (detail["indexer_rate"].gflops * 1e9)
    # one measured shape per distinct (rows, in, out): a chunk's rows, a routed expert's share of them
    shapes = {(r.rows, r.k, r.n) for r in detail["weight_rates"]}
    products = [p for p in weight_products(model) if p.rows_per_token]
    wanted = {(max(1, round(32 * p.rows_per_token)), p.k_in, p.n_out) for p in products}
    assert shapes == wanted and any(rows == 32 * 2 // 4 for rows, _, _ in shapes)  # top-2 of 4 experts
    assert rf.init(rf.tiny_config(**rf.SMALL)).cfg.n_routed_experts == 8  # e2e.py's model
