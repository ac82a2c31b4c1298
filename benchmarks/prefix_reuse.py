"""Prefix reuse on a multi-turn chat workload under memory pressure: warm vs cold time-to-first-token,
hash-hit vs complete-restoration rates, rejections and evictions per kind.

    python benchmarks/prefix_reuse.py [--users 6 --shared-users 4 --target-context 8192 ...]

Workload: `--users` users; the first `--shared-users` start with the same system prompt, the others
with a private one (all `--system-tokens` long). A user's first prompt is the system prompt plus a
`--first-tokens` message; each later prompt is the previous prompt + the model's reply
(`--reply-tokens`, greedy) + a new message (uniform in [message/2, 3*message/2] tokens). Users take
turns in rounds (a new random order each round) until their prompt reaches `--target-context`;
that turn is their last. One request per `Engine.generate` call.

Memory pressure: on top of the pages the live slots need, the COMPRESSED / INDEXER pools and the
prefix index hold `--history-capacity` x (every user's final history, counting the page each restore
copies on write), and the SWA pool and TAIL snapshot slots hold `--snapshot-slots` snapshots (the
retention policy asks for one at every chunk end). Below 1 (default 0.75) the cache cannot hold every
user's history at once and must evict records; the snapshots are always short.

Reusable tokens of a prompt: what a perfect (unbounded) cache could restore — the longest common
prefix with any token sequence the engine computed before (a previous prompt + its reply, minus the
last reply token, which is never fed), at most prompt_len - 1, rounded down to whole blocks.

Cold TTFT: the same prompts (each user's last, >= target tokens) on an engine without a prefix cache,
whose generated tokens must equal the warm engine's ("exact"). Warm TTFT: those last turns on the
prefix-cached engine. TTFT is the engine's own (`stats()["ttft_seconds"]`: admission to first logits).

Disk tier (`--disk DIR`, or `--disk auto` for a fresh temporary directory deleted at the end; default
none): the warm engine gets `hkv.DiskTier(DIR)`, so the chains whose snapshots the eviction policy
drops from device memory are written to disk (write-behind) and a later hit restores them from there
after verification. Reported: tokens restored from disk (plans' `disk_tokens`, engine counters),
blocks offloaded (`stats()["disk_blocks_offloaded"]`) and the tier's `stats()` (segments, stored
bytes, I/O counters). The warm-up also runs one disk restore (write_through, evict everything,
restore) so its first compilation is not timed; other row buckets of `swap_in` still compile on
first use inside the workload.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import platform
import shutil
import statistics
import tempfile
import time

import _machine  # benchmarks/_machine.py (the script's folder is on sys.path)
import jax
import numpy as np

import hkv
from hkv.core.layout import CacheLayout
from models.deepseek_v4 import init, tiny_config

# These figures are of the steady state: every decoded token from the decode step (its warm-up builds it),
# never through the prefill step while the decode step builds (`hkv.Engine.decode_while_building`).
hkv.Engine.decode_while_building = False


def _say(msg: str) -> None:
    print(msg, flush=True)


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n


def plan_workload(args, rng) -> list[dict]:
    """Per user: system prompt, first message and the later messages, drawn up front (the replies
    are the model's, so only their length is known here)."""
    shared = rng.integers(0, args.vocab, args.system_tokens).tolist()
    users = []
    for u in range(args.users):
        system = shared if u < args.shared_users else rng.integers(0, args.vocab, args.system_tokens).tolist()
        first = rng.integers(0, args.vocab, args.first_tokens).tolist()
        length, messages = len(system) + len(first), []
        while length < args.target_context:
            n = int(rng.integers(args.message_tokens // 2, 3 * args.message_tokens // 2 + 1))
            messages.append(rng.integers(0, args.vocab, n).tolist())
            length += args.reply_tokens + n
        users.append({"system": system, "first": first, "messages": messages, "final_prompt": length})
    return users


def size_cache(args, spec, users) -> tuple[hkv.CacheConfig, int]:
    """Pools = the live slots' pages + `history_capacity` x every user's final history (COMPRESSED /
    INDEXER rows, with the copy-on-write pages restores add) + `snapshot_slots` SWA windows."""
    bt, ps = args.block_tokens, args.page_size
    max_context = -(-(max(u["final_prompt"] for u in users) + args.reply_tokens) // bt) * bt
    fed = [u["final_prompt"] + args.reply_tokens - 1 for u in users]  # tokens a user's last turn writes
    n_shared = min(args.shared_users, args.users)
    shared_blocks = (args.system_tokens // bt) * max(n_shared - 1, 0)
    blocks = sum(f // bt for f in fed) - shared_blocks  # distinct block boundaries of all histories
    base = CacheLayout(spec, hkv.CacheConfig(slots=args.slots, max_context=max_context, page_size=ps, prefix_records=0))
    pools = []
    for g, grp in enumerate(base.groups):
        if grp.kind == hkv.ObjectKind.SWA:  # the pages one boundary's window spans
            per = -(-(grp.keep or 1) // ps) + (1 if bt % ps or (grp.keep or 1) > ps else 0)
            extra = args.snapshot_slots * per
        else:
            rows = lambda t, unit=grp.unit: -(-(t // unit) // ps)
            need = sum(rows(f) for f in fed) - max(n_shared - 1, 0) * ((args.system_tokens // grp.unit) // ps)
            if (bt // grp.unit) % ps:
                # a restore at a boundary inside a page copies that page (copy-on-write), and the chain
                # before and after the boundary keep one copy each: up to one extra page per turn
                need += sum(len(u["messages"]) for u in users)
            extra = args.history_capacity * need
        pools.append(base.pool_pages(g) + int(np.ceil(extra)))
    records = int(np.ceil(args.history_capacity * blocks)) + args.spare_records
    snaps = args.snapshot_slots
    return hkv.CacheConfig(
        slots=args.slots,
        max_context=max_context,
        page_size=ps,
        pool_pages=tuple(pools),
        prefix_records=records,
        tail_snapshots=snaps,
    ), blocks


def counters_delta(after: dict, before: dict) -> dict:
    out = {}
    for k in ("lookups", "hash_hit_tokens", "restored_tokens", "disk_restored_tokens", "lookups_ending_in_hash_miss"):
        out[k] = after[k] - before[k]
    out["evictions"] = {k: after["evictions"][k] - before["evictions"].get(k, 0) for k in after["evictions"]}
    rej = {}
    for stage, reasons in after["rejections"].items():
        for r, n in reasons.items():
            d = n - before["rejections"].get(stage, {}).get(r, 0)
            if d:
                rej.setdefault(stage, {})[r] = d
    out["rejections"] = rej
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--shared-users", type=int, default=4, help="users that share one system prompt")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--first-tokens", type=int, default=2048, help="each user's first message")
    ap.add_argument("--message-tokens", type=int, default=256, help="mean length of later messages")
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--target-context", type=int, default=8192, help="a user's last turn has a prompt >= this")
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument(
        "--history-capacity",
        type=float,
        default=0.75,
        help="COMPRESSED/INDEXER pools and prefix records: this share of every user's final history",
    )
    ap.add_argument(
        "--snapshot-slots", type=int, default=None, help="SWA + TAIL snapshots the cache can hold (default: 2 per user)"
    )
    ap.add_argument("--spare-records", type=int, default=8, help="records added for the warm-up's blocks")
    ap.add_argument("--retention-every", type=int, default=1, help="RetentionPolicy.every_n_blocks")
    ap.add_argument("--branch-points-only", action="store_true")
    ap.add_argument("--cold-samples", type=int, default=2, help="users whose last prompt also runs cold")
    ap.add_argument(
        "--cold-on-prefix-engine",
        action="store_true",
        help="also time an unrelated target-length prompt on the prefix-cached engine",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="one line per turn")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument(
        "--disk",
        metavar="DIR",
        help="give the warm engine an hkv.DiskTier in DIR ('auto': a fresh "
        "temporary directory, deleted at the end); default: no disk tier",
    )
    args = ap.parse_args()
    if args.snapshot_slots is None:
        args.snapshot_slots = 2 * args.users

    t_start = time.perf_counter()
    cores, rev = _machine.cores(), _machine.hkv_revision()
    _say(
        f"date {datetime.date.today().isoformat()}; machine: {cores}-core {platform.machine()} "
        f"{jax.default_backend().upper()}, jax {jax.__version__}, numpy {np.__version__}; hkv at {rev}"
    )
    rng = np.random.default_rng(args.seed)
    cfg = tiny_config(max_position_embeddings=2 * args.target_context + 4096)
    args.vocab = cfg.vocab_size
    model = init(cfg, seed=0)
    spec = model.cache_spec(block_tokens=args.block_tokens, model_id="tiny-seed0")
    users = plan_workload(args, rng)
    config, blocks = size_cache(args, spec, users)
    retention = hkv.RetentionPolicy(every_n_blocks=args.retention_every, branch_points_only=args.branch_points_only)
    turns_total = sum(1 + len(u["messages"]) for u in users)
    _say(
        f"model: tiny DeepSeek-V4 (layers {list(cfg.layer_types)}, window {cfg.sliding_window}, CSA m="
        f"{cfg.compress_rate_csa}, HCA m={cfg.compress_rate_hca}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}),"
        f" float32, random weights seed 0"
    )
    _say(
        f"workload: {args.users} users ({args.shared_users} share a {args.system_tokens}-token system prompt), "
        f"first message {args.first_tokens}, later messages ~{args.message_tokens} (x0.5-1.5), reply "
        f"{args.reply_tokens}; {turns_total} turns; last prompts {min(u['final_prompt'] for u in users)}-"
        f"{max(u['final_prompt'] for u in users)} tokens"
    )
    groups = [
        f"{g.kind.name}{'' if g.kind == hkv.ObjectKind.SWA else f'/m={g.unit}'}"
        for g in CacheLayout(spec, config).groups
    ]
    _say(f"cache: {config}")
    _say(
        f"  pools per group {dict(zip(groups, config.pool_pages, strict=True))}; block_tokens {args.block_tokens}, "
        f"prefill_chunk {args.prefill_chunk}, {retention}"
    )
    _say(
        f"  pressure: the histories reach {blocks} block boundaries; pools and records hold "
        f"{args.history_capacity:.2f} of them; {args.snapshot_slots} SWA+TAIL snapshots (the retention policy "
        f"asks for one at every chunk end)"
    )

    evict_calls = [0]

    def progress(msg: str) -> None:
        if msg.startswith("evicted"):
            evict_calls[0] += 1

    disk = None
    if args.disk:
        disk_dir = args.disk
        if disk_dir == "auto":
            disk_dir = tempfile.mkdtemp(prefix="hkv-prefix-reuse-")
            atexit.register(shutil.rmtree, disk_dir, True)
        disk = hkv.DiskTier(disk_dir)
        _say(f"disk tier: {disk_dir}{' (temporary, deleted at the end)' if args.disk == 'auto' else ''}")
    engine = hkv.Engine(
        model,
        config,
        block_tokens=args.block_tokens,
        prefill_chunk=args.prefill_chunk,
        model_id="tiny-seed0",
        retention=retention,
        progress=progress,
        disk=disk,
    )
    # ---- warm-up: compile prefill, decode, record, restore, evict and the window-recompute restore
    # (a hit whose snapshot was evicted) before timing; the engine has no public way to do this
    t0 = time.perf_counter()
    wp = rng.integers(0, args.vocab, 2 * args.block_tokens + 3).tolist()
    g = engine.generate([wp], 2)[0]
    every = jax.numpy.ones((config.prefix_records,), bool)
    engine.cache = engine.steps.evict(engine.layout, engine.cache, every, every, ~every)  # drop the snapshots
    g2 = engine.generate([wp + g.tokens + [1]], 2)[0]
    if g2.plan.window_recomputed is None:
        _say(f"  (warm-up did not exercise the window recompute: {g2.plan})")
    if disk is not None:  # compile one disk restore too: offload a fresh chain, drop it from device, hit it
        wd = rng.integers(0, args.vocab, 2 * args.block_tokens + 3).tolist()
        gd = engine.generate([wd], 2)[0]  # its last boundary keeps a snapshot (request end)
        engine.write_through()
        engine.flush_disk()
        engine.cache = engine.steps.evict(engine.layout, engine.cache, every, every, every)
        g3 = engine.generate([wd + gd.tokens + [1]], 2)[0]
        if g3.plan.disk_tokens is None:
            _say(f"  (warm-up did not exercise a disk restore: {g3.plan})")
        engine.flush_disk()
    before = engine.prefix_stats()
    before_stats = engine.stats()
    disk_before = dict(disk.counters) if disk is not None else {}
    _say(f"warm-up (compilation) {time.perf_counter() - t0:.1f} s")

    # ---- the chat workload
    history = [None] * args.users  # current prompt of each user
    next_msg = [0] * args.users
    computed: list[np.ndarray] = []  # every token sequence the engine has written into a slot
    fed = [0] * args.users  # tokens each user's history has written so far
    sys_blocks = args.system_tokens // args.block_tokens
    capacity_blocks = int(np.ceil(args.history_capacity * blocks))
    turns = []
    order_rng = np.random.default_rng(args.seed + 1)
    t_work = time.perf_counter()
    rnd = 0
    while any(next_msg[u] <= len(users[u]["messages"]) for u in range(args.users)):
        rnd += 1
        active = [u for u in range(args.users) if next_msg[u] <= len(users[u]["messages"])]
        ttfts_round = []
        for u in order_rng.permutation(active).tolist():
            usr = users[u]
            prompt = usr["system"] + usr["first"] if history[u] is None else history[u]
            arr = np.asarray(prompt)
            best = max((lcp(arr, c) for c in computed), default=0)
            reusable = (min(best, len(prompt) - 1) // args.block_tokens) * args.block_tokens
            started_shared = sum(1 for v in range(min(args.shared_users, args.users)) if fed[v])
            held = sum(f // args.block_tokens for f in fed) - max(started_shared - 1, 0) * sys_blocks
            t = time.perf_counter()
            evict_calls[0] = 0
            gen = engine.generate([prompt], args.reply_tokens)[0]
            wall = time.perf_counter() - t
            ttft = engine.stats()["ttft_seconds"][-1]
            p = gen.plan
            last = next_msg[u] == len(usr["messages"])
            turns.append(
                {
                    "round": rnd,
                    "user": u,
                    "prompt": len(prompt),
                    "reusable": reusable,
                    "hash_hit": p.hash_hit_tokens,
                    "restored": p.restored_tokens,
                    "disk": p.disk_tokens[1] - p.disk_tokens[0] if p.disk_tokens else 0,
                    "stage": p.first_failed_stage,
                    "reason": p.reason,
                    "ttft": ttft,
                    "wall": wall,
                    "window": p.window_recomputed is not None,
                    "evict_calls": evict_calls[0],
                    "over_capacity": held > capacity_blocks,
                    "last": last,
                    "tokens": gen.tokens,
                    "prompt_ids": prompt if last else None,
                }
            )
            ttfts_round.append(ttft)
            if args.verbose:
                _say(
                    f"  r{rnd:>2} user {u} prompt {len(prompt):>5} reusable {reusable:>5} hash-hit "
                    f"{p.hash_hit_tokens:>5} restored {p.restored_tokens:>5}"
                    f"{f' ({p.disk_tokens[1] - p.disk_tokens[0]} from disk)' if p.disk_tokens else ''} "
                    f"{(p.first_failed_stage or '-') + ':' + (p.reason or '-'):<24}"
                    f"{' +window' if p.window_recomputed else '        '} ttft {ttft * 1e3:7.1f} ms; "
                    f"{evict_calls[0]} evictions, pages used "
                    f"{[int((np.asarray(g.refcount) > 0).sum()) for g in engine.cache.groups]}"
                )
            computed.append(np.asarray(prompt + gen.tokens[:-1]))
            fed[u] = len(prompt) + len(gen.tokens) - 1
            if not last:
                history[u] = prompt + gen.tokens + usr["messages"][next_msg[u]]
            next_msg[u] += 1
        done = turns[-len(active) :]
        from_disk = f" ({sum(x['disk'] for x in done)} from disk)" if disk is not None else ""
        _say(
            f"round {rnd:>2}: {len(active)} turns, prompts {min(x['prompt'] for x in done)}-"
            f"{max(x['prompt'] for x in done)}, restored {sum(x['restored'] for x in done)}/"
            f"{sum(x['reusable'] for x in done)} reusable tokens"
            f"{from_disk}, median TTFT "
            f"{statistics.median(ttfts_round) * 1e3:.0f} ms  [{time.perf_counter() - t_start:.0f} s]"
        )
    work_s = time.perf_counter() - t_work
    if disk is not None:
        engine.flush_disk()  # pending write-behind segments, so the tier's figures are final
    after = engine.prefix_stats()
    delta = counters_delta(after, before)

    # ---- cold: the last prompts of a few users on an engine without a prefix cache
    cold_engine = hkv.Engine(
        model,
        hkv.CacheConfig(slots=1, max_context=config.max_context, page_size=args.page_size, prefix_records=0),
        block_tokens=args.block_tokens,
        prefill_chunk=args.prefill_chunk,
        model_id="tiny-seed0",
    )
    cold_engine.generate([wp], 2)  # compile
    lasts = [x for x in turns if x["last"]]
    cold, exact = [], []
    for x in lasts[: args.cold_samples]:
        g = cold_engine.generate([x["prompt_ids"]], args.reply_tokens)[0]
        cold.append({"user": x["user"], "prompt": x["prompt"], "ttft": cold_engine.stats()["ttft_seconds"][-1]})
        exact.append(g.tokens == x["tokens"])
        _say(
            f"cold: user {x['user']} last prompt ({x['prompt']} tokens) without prefix cache: TTFT "
            f"{cold[-1]['ttft']:.2f} s; tokens {'exact' if exact[-1] else 'DIFFER'} vs the warm engine's"
        )
    cold_prefix = None
    if args.cold_on_prefix_engine:
        q = rng.integers(0, args.vocab, lasts[0]["prompt"]).tolist()
        engine.generate([q], 1)
        cold_prefix = engine.stats()["ttft_seconds"][-1]
        _say(
            f"cold on the prefix-cached engine (unrelated {len(q)}-token prompt; records, snapshots and "
            f"evictions included): TTFT {cold_prefix:.2f} s"
        )

    # ---- report
    reusable = sum(x["reusable"] for x in turns)
    hh = sum(x["hash_hit"] for x in turns)
    hh_capped = sum(min(x["hash_hit"], x["reusable"]) for x in turns)
    restored = sum(x["restored"] for x in turns)
    prompt_tokens = sum(x["prompt"] for x in turns)
    _say("")
    _say(
        f"== {len(turns)} turns in {work_s:.0f} s; {prompt_tokens} prompt tokens, {reusable} reusable "
        f"({reusable / prompt_tokens:.1%})"
    )
    _say(f"hash-hit tokens        {hh:>8}  = {hh_capped / reusable:6.1%} of reusable")
    _say(
        f"restored tokens        {restored:>8}  = {restored / reusable:6.1%} of reusable   [target >= 95%: "
        f"{'met' if restored >= 0.95 * reusable else 'NOT met'}]"
    )
    _say(
        f"complete-restoration rate (restored / hash-hit tokens): {restored / hh:.1%}"
        if hh
        else "complete-restoration rate: no hash hits"
    )
    disk_report = None
    if disk is not None:
        dst = engine.stats()
        dtier = disk.stats()
        dcount = {k: v - disk_before.get(k, 0) for k, v in dtier["counters"].items()}
        from_disk = sum(x["disk"] for x in turns)
        disk_report = {
            "restored_tokens_plans": from_disk,
            "turns": sum(1 for x in turns if x["disk"]),
            "disk_restores": dst["disk_restores"] - before_stats["disk_restores"],
            "disk_restored_tokens": dst["disk_restored_tokens"] - before_stats["disk_restored_tokens"],
            "prefix_disk_restored_tokens": delta["disk_restored_tokens"],
            "blocks_offloaded": dst["disk_blocks_offloaded"] - before_stats["disk_blocks_offloaded"],
            "segments": dtier["segments"],
            "stored_bytes": dtier["stored_bytes"],
            "counters": dcount,
            "records_on_disk": after["occupancy"]["records_on_disk"],
        }
        _say(
            f"  from disk: {from_disk} restored tokens ({from_disk / reusable:.1%} of reusable) in "
            f"{disk_report['turns']} turns; engine stats: disk_restores {disk_report['disk_restores']}, "
            f"disk_restored_tokens {disk_report['disk_restored_tokens']} (stats()['prefix']: "
            f"{disk_report['prefix_disk_restored_tokens']}); from device: {restored - from_disk} "
            f"({(restored - from_disk) / reusable:.1%} of reusable)"
        )
        _say(
            f"  disk tier: {disk_report['blocks_offloaded']} blocks offloaded (stats()['disk_blocks_offloaded']); "
            f"store holds {dtier['segments']} segments, {dtier['stored_bytes'] / 2**20:.1f} MiB "
            f"(warm-up included); {after['occupancy']['records_on_disk']} index entries marked on disk"
        )
        _say(f"  disk tier counters over the workload: {json.dumps(dcount)}")
    wr = [x for x in turns if x["window"]]
    _say(
        f"  {len(wr)} turns restored by rebuilding a missing SWA window + TAIL ({engine.window_recompute_tokens} "
        f"tokens re-run each); {sum(x['hash_hit'] > x['restored'] for x in turns)} turns restored less than "
        f"their hash hit"
    )
    st = engine.stats()
    eng_req = st["prompts"] - before_stats["prompts"]
    _say(
        f"engine counters (stats()['prefix']) over the workload: {delta['lookups']} lookups for {eng_req} "
        f"requests, hash_hit_tokens {delta['hash_hit_tokens']} (plans: {hh}), restored_tokens "
        f"{delta['restored_tokens']} (plans: {restored}), window_recomputes "
        f"{st['window_recomputes'] - before_stats['window_recomputes']}"
    )
    full = sum(x["restored"] >= x["reusable"] for x in turns if x["reusable"])
    zero = sum(x["restored"] == 0 for x in turns if x["reusable"])
    n_re = sum(1 for x in turns if x["reusable"])
    _say(f"turns with reusable tokens: {n_re}; fully restored {full}, partly {n_re - full - zero}, nothing {zero}")
    lost: dict[str, list[int]] = {}
    for x in turns:
        miss = x["reusable"] - min(x["restored"], x["reusable"])
        if miss <= 0:
            continue
        if x["hash_hit"] < x["reusable"] and x["restored"] == x["hash_hit"]:
            why = "hash:no_hash_match (record evicted or overwritten)"
        else:
            why = f"{x['stage']}:{x['reason']}"
        acc = lost.setdefault(why, [0, 0])
        acc[0] += 1
        acc[1] += miss
    for why, (n, tok) in sorted(lost.items(), key=lambda kv: -kv[1][1]):
        _say(f"  lost {tok:>7} reusable tokens in {n:>3} turns: {why}")
    over = [x for x in turns if x["over_capacity"]]
    if over:
        under = [x for x in turns if not x["over_capacity"]]
        ru, rr = sum(x["reusable"] for x in under), sum(min(x["restored"], x["reusable"]) for x in under)
        ou, orr = sum(x["reusable"] for x in over), sum(min(x["restored"], x["reusable"]) for x in over)
        _say(
            f"  capacity: from round {over[0]['round']} on, the users' histories together exceed what the pools "
            f"and records hold ({capacity_blocks} blocks); restored before: {rr}/{ru} = {rr / max(ru, 1):.1%}, "
            f"after: {orr}/{ou} = {orr / max(ou, 1):.1%} ({len(over)} turns)"
        )
    _say(f"rejections per stage and reason (engine counters): {json.dumps(delta['rejections'])}")
    _say(f"evictions per kind: {json.dumps(delta['evictions'])}")
    ev = [x for x in turns if x["evict_calls"]]
    if ev:
        worst = max(ev, key=lambda x: x["evict_calls"])
        _say(
            f"  eviction passes: {sum(x['evict_calls'] for x in turns)} in {len(ev)} turns (first in round "
            f"{ev[0]['round']}); most in one turn: {worst['evict_calls']} (round {worst['round']}, TTFT "
            f"{worst['ttft']:.2f} s)"
        )
    _say(f"occupancy at the end: {json.dumps(after['occupancy'])}")
    used = [int((np.asarray(g.refcount) > 0).sum()) for g in engine.cache.groups]
    pools = dict(zip(groups, config.pool_pages, strict=True))
    _say(f"pages in use at the end per group: {dict(zip(groups, used, strict=True))} of {pools}")
    excerpt = [
        ln
        for ln in engine.metrics_text().splitlines()
        if ln.startswith(("hkv_prefix_lookups", "hkv_prefix_hash_hit", "hkv_prefix_restored", "hkv_evictions"))
    ]
    _say("metrics_text() excerpt (whole run, warm-up included): " + "; ".join(excerpt))
    warm = [x["ttft"] for x in lasts]
    warm_med = statistics.median(warm)
    cold_med = statistics.median([c["ttft"] for c in cold]) if cold else float("nan")
    _say(
        f"TTFT cold (no prefix cache) at {min(c['prompt'] for c in cold)}-{max(c['prompt'] for c in cold)} tokens: "
        f"median {cold_med:.3f} s over {len(cold)}"
        if cold
        else "TTFT cold: not measured"
    )
    _say(
        f"TTFT warm (each user's last turn, {min(x['prompt'] for x in lasts)}-{max(x['prompt'] for x in lasts)} "
        f"tokens): median {warm_med * 1e3:.1f} ms, min {min(warm) * 1e3:.1f}, max {max(warm) * 1e3:.1f} over "
        f"{len(warm)}; restored {sum(x['restored'] for x in lasts)}/{sum(x['reusable'] for x in lasts)} of their "
        f"reusable tokens"
    )
    _say(
        f"warm/cold TTFT speed-up: {cold_med / warm_med:.1f}x   [target >= 10x: "
        f"{'met' if cold_med >= 10 * warm_med else 'NOT met'}]"
    )
    _say(
        f"correctness: {'exact' if exact and all(exact) else 'MISMATCH'} (warm tokens == cold tokens for "
        f"{len(exact)} last turns)"
    )
    if disk is not None:
        disk.close()
    _say(f"total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "config": str(config),
                    "turns": [{k: v for k, v in x.items() if k not in ("tokens", "prompt_ids")} for x in turns],
                    "delta": delta,
                    "occupancy": after["occupancy"],
                    "cold": cold,
                    "cold_prefix": cold_prefix,
                    "exact": exact,
                    "disk": disk_report,
                },
                f,
                indent=1,
            )
    if exact and not all(exact):
        raise SystemExit("warm and cold generations differ")


if __name__ == "__main__":
    main()
