"""`hkv.MeshEngine` on CPU devices: cache bytes per device against the mesh shape, and the prefix hit
rate of a multi-turn chat trace with prefix-aware routing against random assignment.

    python benchmarks/sharding.py [--devices 8] [--users 8] [--turns 4] [--records 64]

Bytes per device: for meshes (D, M) with D * M = --devices, the bytes of one device's piece of every
cache leaf and of every weight (read from the placed arrays' shards, not computed), for the tiny
DeepSeek-V4 and a config whose capacity is fixed for the whole mesh (slots, pools and prefix records
split over D data shards; the cache is replicated over M, the heads / experts split over M).

Hit rate: `--users` users, each with a private prompt; `--turns` rounds, each user's next prompt is
their previous prompt + the reply + a new message. The same trace runs on
  - one engine with the whole capacity ("1 shard, 4x memory"),
  - a (4, 2) mesh with prefix routing (`MeshEngine.route`),
  - the same mesh with each request sent to a random shard (seeded; `engine.shards[d].generate`).
Hit rate = tokens restored / tokens a perfect cache could restore (the previous prompt + reply,
whole blocks). Tokens must be equal in all three (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    n = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), None)
    if n is None and "--devices" in sys.argv:
        n = sys.argv[sys.argv.index("--devices") + 1]
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n or 8}"

import _machine  # benchmarks/_machine.py
import jax
import numpy as np
from jax.sharding import Mesh

import hkv
from models.deepseek_v4 import init, tiny_config

BT = 16


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def device_bytes(tree, device) -> int:
    """Bytes of `tree`'s pieces that live on `device`."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            if s.device == device:
                total += s.data.nbytes
    return total


def bytes_table(model, config: hkv.CacheConfig, devices: int) -> list[str]:
    rows = ["| mesh (data, model) | cache bytes / device | weights bytes / device | cache bytes, whole mesh |",
            "|---|---|---|---|"]  # fmt: skip
    d = 1
    while d <= devices:
        m = devices // d
        mesh = Mesh(np.array(jax.devices()[:devices]).reshape(d, m), ("data", "model"))
        e = hkv.MeshEngine(model, config, mesh=mesh, block_tokens=BT, prefill_chunk=32)
        dev = mesh.devices[0, 0]
        cache = device_bytes(e.cache, dev)
        weights = device_bytes(e._weights, dev)
        whole = sum(leaf.nbytes for leaf in jax.tree.leaves(e.cache))
        rows.append(f"| ({d}, {m}) | {cache:,} | {weights:,} | {whole:,} |")
        say(f"bytes: mesh ({d}, {m}) done")
        d *= 2
    return rows


def trace(users: int, turns: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    firsts = [rng.integers(0, vocab, int(rng.integers(40, 72))).tolist() for _ in range(users)]
    messages = [[rng.integers(0, vocab, int(rng.integers(8, 24))).tolist() for _ in range(users)] for _ in range(turns)]
    return firsts, messages


def run_trace(generate, firsts, messages, reply: int):
    """Rounds of one request per user; returns (tokens per request, restored tokens, reusable tokens)."""
    prompts = list(firsts)
    outs, restored, reusable = [], 0, 0
    for t in range(len(messages) + 1):
        for u in range(len(prompts)):
            (g,) = generate(u, prompts[u], reply)
            outs.append(g.tokens)
            if t:
                restored += g.plan.restored_tokens
                reusable += (len(prompts[u]) - len(messages[t - 1][u]) - 1) // BT * BT
            if t < len(messages):
                prompts[u] = prompts[u] + g.tokens + messages[t][u]
    return outs, restored, reusable


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reply", type=int, default=4)
    ap.add_argument("--records", type=int, default=64, help="prefix records of the whole mesh (a multiple of 4)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(
        f"machine: {_machine.cores()}-core {platform.machine()}, jax {jax.__version__}, {len(jax.devices())} "
        f"{jax.default_backend()} devices; hkv at {_machine.hkv_revision()}\n"
    )
    cfg = tiny_config()
    model = init(cfg, seed=3)
    config = hkv.CacheConfig(slots=8, max_context=256, page_size=8, prefix_records=args.records)
    print(f"## Bytes per device (tiny DeepSeek-V4, {config})\n")
    print("\n".join(bytes_table(model, config, args.devices)) + "\n")

    firsts, messages = trace(args.users, args.turns, cfg.vocab_size, args.seed)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(args.seed + 1)
    runs = {}
    single = hkv.Engine(model, config, block_tokens=BT, prefill_chunk=32)
    routed = hkv.MeshEngine(model, config, mesh=mesh, block_tokens=BT, prefill_chunk=32)
    randomly = hkv.MeshEngine(model, config, mesh=mesh, block_tokens=BT, prefill_chunk=32)
    assign = {}
    for name, gen in (
        ("1 shard, 4x memory", lambda u, p, n: single.generate([p], n)),
        ("4 shards, prefix routing", lambda u, p, n: routed.generate([p], n)),
        ("4 shards, random",
         lambda u, p, n: randomly.shards[assign.setdefault((u, len(p)), int(rng.integers(4)))].generate([p], n)),
    ):  # fmt: skip
        t0 = time.perf_counter()
        runs[name] = run_trace(gen, firsts, messages, args.reply)
        say(f"{name}: {time.perf_counter() - t0:.1f}s")
    print(f"## Hit rate: {args.users} users x {args.turns + 1} turns, prefix_records={args.records} in all\n")
    print("| engine | restored tokens | reusable tokens | hit rate |\n|---|---|---|---|")
    base = runs["1 shard, 4x memory"][0]
    ok = True
    rates = {}
    for name, (outs, restored, reusable) in runs.items():
        rates[name] = 100.0 * restored / max(reusable, 1)
        print(f"| {name} | {restored:,} | {reusable:,} | {rates[name]:.1f}% |")
        ok &= outs == base
    gap = rates["1 shard, 4x memory"] - rates["4 shards, prefix routing"]
    print(f"\nrouting vs one shard with 4x the memory: {gap:+.1f} points (target: within 5)")
    print(f"routing vs random: {rates['4 shards, prefix routing'] - rates['4 shards, random']:+.1f} points")
    print(f"tokens equal in all three: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
