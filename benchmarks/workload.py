"""Prefix reuse on realistic workloads, submitted concurrently under memory pressure, against the
offline optimum (Belady's policy on the same trace with the same budget).

    python benchmarks/workload.py                        # tiny DeepSeek-V4, chat + agent, 4 budgets
    python benchmarks/workload.py --model small          # the side-by-side small DeepSeek-V4 (slower)
    python benchmarks/workload.py --workloads chat --budgets 1.0

Workloads (each a list of sessions; a round submits every active session's next prompt together in one
`Engine.generate` call, so the engine admits and prefills them side by side):

* `chat`: `--users` users, the first `--shared-users` starting with one shared system prompt, the others
  with a private one; the first prompt is the system prompt + a first message; each later prompt is the
  previous prompt + the model's reply (`--reply-tokens`, greedy) + a new message. `--turns` turns each.
* `agent`: `--agents` agents over `--tools` long tool prompts (agent a uses tool prompt a % tools), each
  with its own task; then `--steps` short turns: previous prompt + the model's reply (a tool call,
  `--call-tokens`) + an observation (uniform in [obs/2, 3*obs/2] tokens).

Accounting, in blocks of `--block-tokens` (the prefix cache's unit; the minimum cacheable prefix):

* reusable: per request, the longest block-aligned prefix of its prompt that a sequence the engine
  computed in an earlier round holds (a prompt + its reply, minus the last reply token, which is never
  fed), at most prompt_len - 1 tokens. What an unbounded cache could restore.
* working set W: the distinct blocks of every computed sequence (shared prefixes counted once).
* budget f: the engine's cache holds `ceil(f x W)` cached blocks (`prefix_records`, pool pages for their
  rows, and the TAIL snapshot slots the default sizing gives them — what `CacheConfig(memory_bytes=...)`
  resolves to for that many blocks); its bytes beyond the running slots are printed.
* Belady: the same trace replayed on a cache of the same number of blocks that, after each round,
  keeps the blocks whose next use (the first later request whose reusable prefix holds them) comes
  soonest — Belady's furthest-next-use eviction with bypass; ties keep the shallower block, so the
  kept set is prefix-closed. A request restores the longest prefix of its reusable blocks held at its
  round's start. It ignores what restoring costs beyond the block rows (window and TAIL snapshots,
  copy-on-write pages), so it bounds every policy from above.

Each budget runs on its own engine (`warmup()` first; compilation inside the workload is reported).
Every run's greedy tokens must equal those of an engine without a prefix cache on the same trace
(the script exits with status 1 otherwise). TTFT is the engine's own (`stats()["ttft_seconds"]`:
admission to first logits); throughput counts prompt + generated tokens over the workload's wall time.
Goals (issue 47): >= 95% of the reusable tokens restored when the working set fits (budget 1.0), and
within 5 points of Belady under pressure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import platform
import sys
import time

import _machine  # benchmarks/_machine.py (the script's folder is on sys.path)
import jax
import numpy as np

import hkv
from hkv.core.memory import auto_snapshots
from models import deepseek_v4

# These figures are of the steady state: every decoded token from the decode step (its warm-up builds it),
# never through the prefill step while the decode step builds (`hkv.Engine.decode_while_building`).
hkv.Engine.decode_while_building = False

# The side-by-side small DeepSeek-V4 (`benchmarks/e2e.py`'s dimensions; rope dims 32, as hkv requires them <= the
# indexer head dim), random hkv weights.
SMALL = dict(
    vocab_size=4096, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=8, num_attention_heads=8,
    head_dim=64, q_lora_rank=128, qk_rope_head_dim=32, num_experts_per_tok=2, n_routed_experts=8,
    layer_types=("sliding_attention",) + ("compressed_sparse_attention", "heavily_compressed_attention") * 3
    + ("compressed_sparse_attention",),
    mlp_layer_types=("hash_moe",) + ("moe",) * 7, compress_rate_csa=4, compress_rate_hca=128, hc_mult=2,
    sliding_window=128, o_groups=2, o_lora_rank=64, index_n_heads=16, index_head_dim=32, index_topk=128,
    max_position_embeddings=65536,
)  # fmt: skip


# ------------------------------------------------------------------------------------ workloads
@dataclasses.dataclass(frozen=True)
class Session:
    """One conversation: its first prompt and the text added after each reply (one per later turn)."""

    first: tuple[int, ...]
    later: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class Workload:
    """Sessions driven in rounds: round r submits every session's turn r together."""

    name: str
    sessions: tuple[Session, ...]
    reply_tokens: int

    @property
    def rounds(self) -> int:
        return 1 + max(len(s.later) for s in self.sessions)


def _draw(rng, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(0, vocab, n))


def _around(rng, mean: int) -> int:
    return int(rng.integers(max(1, mean // 2), 3 * mean // 2 + 1))


def chat_workload(args, vocab: int, rng) -> Workload:
    """Multi-user chat: shared or private system prompt + first message, then messages of ~`message_tokens`."""
    shared = _draw(rng, vocab, args.system_tokens)
    sessions = []
    for u in range(args.users):
        system = shared if u < args.shared_users else _draw(rng, vocab, args.system_tokens)
        later = tuple(_draw(rng, vocab, _around(rng, args.message_tokens)) for _ in range(args.turns - 1))
        sessions.append(Session(system + _draw(rng, vocab, args.first_tokens), later))
    return Workload("chat", tuple(sessions), args.reply_tokens)


def agent_workload(args, vocab: int, rng) -> Workload:
    """Agentic: long shared tool prompts, a task per agent, many short observation turns."""
    tools = [_draw(rng, vocab, args.tool_tokens) for _ in range(args.tools)]
    sessions = []
    for a in range(args.agents):
        later = tuple(_draw(rng, vocab, _around(rng, args.observation_tokens)) for _ in range(args.steps - 1))
        sessions.append(Session(tools[a % args.tools] + _draw(rng, vocab, args.task_tokens), later))
    return Workload("agent", tuple(sessions), args.call_tokens)


# ------------------------------------------------------------------------------------ the trace
@dataclasses.dataclass(frozen=True)
class Request:
    """One request as it ran: its round, session, prompt and generated tokens, and what the engine restored."""

    round: int
    session: int
    prompt: tuple[int, ...]
    reply: tuple[int, ...]
    restored: int
    reason: str | None = None  # the plan's reason (why it stopped where it did), None when it restored all it hashed

    @property
    def computed(self) -> tuple[int, ...]:
        """Every token the engine fed for it (the last reply token is never fed)."""
        return self.prompt + self.reply[:-1]


def block_keys(tokens: tuple[int, ...], block: int) -> list[bytes]:
    """Key of every whole block of `tokens`: a digest of the whole prefix up to that block's end."""
    keys, h = [], hashlib.blake2b(digest_size=16)
    for i in range(len(tokens) // block):
        h.update(np.asarray(tokens[i * block : (i + 1) * block], np.int64).tobytes())
        keys.append(h.copy().digest())
    return keys


@dataclasses.dataclass(frozen=True)
class TraceBlocks:
    """A trace in blocks: per request its reusable-prefix candidates (`lookup`) and what it writes (`writes`)."""

    rounds: tuple[int, ...]
    lookup: tuple[tuple[bytes, ...], ...]  # keys of the blocks of prompt[: len - 1]
    writes: tuple[tuple[bytes, ...], ...]  # keys of the blocks of the computed sequence
    block: int

    @classmethod
    def of(cls, requests: list[Request], block: int) -> TraceBlocks:
        return cls(
            tuple(r.round for r in requests),
            tuple(tuple(block_keys(r.prompt[: len(r.prompt) - 1], block)) for r in requests),
            tuple(tuple(block_keys(r.computed, block)) for r in requests),
            block,
        )

    @property
    def working_set(self) -> int:
        """Distinct blocks written by the whole trace."""
        return len({k for w in self.writes for k in w})

    def reusable_blocks(self) -> list[int]:
        """Per request: the longest prefix of its lookup chain written in an earlier round."""
        seen: set[bytes] = set()
        out = []
        for r in sorted(set(self.rounds)):
            idx = [i for i, x in enumerate(self.rounds) if x == r]
            out_r = {i: _held_prefix(self.lookup[i], seen) for i in idx}
            out.extend(out_r[i] for i in idx)
            seen.update(k for i in idx for k in self.writes[i])
        return out


def _held_prefix(chain, held) -> int:
    n = 0
    while n < len(chain) and chain[n] in held:
        n += 1
    return n


def belady(trace: TraceBlocks, capacity: int) -> list[int]:
    """Blocks each request restores on a `capacity`-block cache run by Belady's policy (with bypass).

    After each round, of the blocks held or just written, the cache keeps the `capacity` whose next use
    (index of the first later request whose lookup chain holds the block) is soonest; never-used-again
    blocks are dropped; ties keep the shallower block (depth = its index in the chain), which keeps the
    set prefix-closed since a block's prefix is used whenever the block is. Requests of one round see
    the cache as it stood when the round began.

    Args:
      trace: the trace in blocks (requests in submission order, rounds non-decreasing).
      capacity: blocks the cache holds (>= 0).
    Returns:
      per request, the blocks restored (the held prefix of its lookup chain).
    """
    if capacity < 0:
        raise ValueError(f"capacity={capacity} must be >= 0 blocks")
    uses: dict[bytes, list[int]] = {}
    for i, chain in enumerate(trace.lookup):
        for k in chain:
            uses.setdefault(k, []).append(i)
    depth = {k: d for chain in trace.writes for d, k in enumerate(chain)}
    held: set[bytes] = set()
    out = [0] * len(trace.lookup)
    rounds = sorted(set(trace.rounds))
    for r in rounds:
        idx = [i for i, x in enumerate(trace.rounds) if x == r]
        for i in idx:
            out[i] = _held_prefix(trace.lookup[i], held)
        after = max(idx)
        candidates = held | {k for i in idx for k in trace.writes[i]}

        def next_use(k: bytes, after: int = after) -> float:
            later = [j for j in uses.get(k, ()) if j > after]
            return later[0] if later else math.inf

        ranked = sorted((next_use(k), depth[k], k) for k in candidates)
        held = {k for nu, _, k in ranked[:capacity] if nu != math.inf}
    return out


# ------------------------------------------------------------------------------------ running it
@dataclasses.dataclass
class Run:
    """One engine on one workload: the requests as run, and the engine's figures."""

    label: str
    requests: list[Request]
    ttfts: list[float]
    wall: float
    compiled: float
    evictions: dict
    prefix_bytes: int
    records: int


def drive(engine: hkv.Engine, workload: Workload, label: str) -> Run:
    """Every round's prompts submitted together (`generate`); the histories grow with the replies."""
    history = [list(s.first) for s in workload.sessions]
    requests: list[Request] = []
    before = engine.stats()
    t0 = time.perf_counter()
    for r in range(workload.rounds):
        active = [s for s, sess in enumerate(workload.sessions) if r <= len(sess.later)]
        if r:
            for s in active:
                history[s] += workload.sessions[s].later[r - 1]
        gens = engine.generate([history[s] for s in active], workload.reply_tokens)
        for s, g in zip(active, gens, strict=True):
            restored = 0 if g.plan is None else int(g.plan.restored_tokens)
            reason = None if g.plan is None or g.plan.reason is None else str(g.plan.reason.value)
            requests.append(Request(r, s, tuple(history[s]), tuple(g.tokens), restored, reason))
            history[s] += list(g.tokens)
    wall = time.perf_counter() - t0
    after = engine.stats()
    n = len(requests)
    ev = (after.get("prefix") or {}).get("evictions", {})
    budget = engine.layout.budget
    return Run(
        label,
        requests,
        list(after["ttft_seconds"][-n:]),
        wall,
        after["compile_seconds"] - before["compile_seconds"],
        dict(ev),
        budget.prefix_pages + budget.prefix_index,
        engine.layout.config.prefix_records,
    )


def make_engine(model, workload: Workload, args, records: int) -> hkv.Engine:
    """An engine for `workload`: a slot per session, `records` cached blocks sized as the defaults do."""
    reply = workload.reply_tokens
    longest = max(len(s.first) + sum(map(len, s.later)) + len(s.later) * reply for s in workload.sessions)
    max_context = -(-(longest + workload.reply_tokens) // args.block_tokens) * args.block_tokens
    slots = len(workload.sessions)
    config = hkv.CacheConfig(
        slots=slots, max_context=max_context, prefix_records=records, tail_snapshots=auto_snapshots(records, slots)
    )
    engine = hkv.Engine(
        model, config, block_tokens=args.block_tokens, prefill_chunk=args.prefill_chunk, model_id=args.model
    )
    engine.warmup()
    return engine


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def report_row(run: Run, reusable: list[int], opt: list[int] | None, block: int, budget: str) -> dict:
    """One line of the table (tokens, not blocks, for restored / reusable)."""
    reuse = sum(reusable) * block
    restored = sum(min(r.restored, u * block) for r, u in zip(run.requests, reusable, strict=True))
    over = sum(max(0, r.restored - u * block) for r, u in zip(run.requests, reusable, strict=True))
    tokens = sum(len(r.prompt) + len(r.reply) for r in run.requests)
    row = {
        "budget": budget,
        "records": run.records,
        "prefix_mib": run.prefix_bytes / 2**20,
        "reusable": reuse,
        "restored": restored,
        "restored_pct": 100 * restored / reuse if reuse else float("nan"),
        "belady_pct": (100 * sum(opt) * block / reuse if reuse else float("nan")) if opt is not None else None,
        "beyond_reusable": over,
        "ttft_p50_ms": 1e3 * percentile(run.ttfts, 50),
        "ttft_p99_ms": 1e3 * percentile(run.ttfts, 99),
        "tokens_per_s": tokens / run.wall,
        "wall_s": run.wall,
        "compiled_s": run.compiled,
        "evictions": run.evictions,
    }
    return row


def same_tokens(run: Run, reference: Run) -> bool:
    return [r.reply for r in run.requests] == [r.reply for r in reference.requests]


def run_workload(model, workload: Workload, args) -> tuple[list[dict], bool]:
    """The engine without a prefix cache (its run fixes the trace: greedy replies are the same on every
    engine), then one run per budget, each checked token for token against it."""
    n = len(workload.sessions)
    say(f"\n== {workload.name}: {n} sessions x {workload.rounds} rounds, reply {workload.reply_tokens}")
    cold = drive(make_engine(model, workload, args, 0), workload, "cold")
    trace = TraceBlocks.of(cold.requests, args.block_tokens)
    w = trace.working_set
    reusable = trace.reusable_blocks()
    say(
        f"   trace: {len(cold.requests)} requests, {sum(len(r.prompt) for r in cold.requests)} prompt tokens, working "
        f"set {w} blocks of {args.block_tokens}, reusable {sum(reusable) * args.block_tokens} tokens"
    )
    rows, exact = [report_row(cold, reusable, None, args.block_tokens, "none (cold)")], True
    for f in args.budgets:
        cap = math.ceil(f * w)
        run = drive(make_engine(model, workload, args, cap), workload, f"{f:.2f}")
        ok = same_tokens(run, cold)
        exact &= ok
        row = report_row(run, reusable, belady(trace, cap), args.block_tokens, f"{f:.2f}")
        row["tokens_equal_cold"] = ok
        rows.append(row)
        log(f"   budget {f:.2f}: {row['restored_pct']:.1f}% restored (Belady {row['belady_pct']:.1f}%), exact {ok}")
        sys.stdout.flush()
    print_table(workload.name, rows)
    return rows, exact


def print_table(name: str, rows: list[dict]) -> None:
    say(
        f"\n| {name} budget (x W) | cached blocks | prefix MiB | restored / reusable | Belady | gap (points) "
        f"| TTFT p50 / p99 ms | tokens/s | evictions (records, snapshots) | tokens = cold |"
    )
    say("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bel = "-" if r["belady_pct"] is None else f"{r['belady_pct']:.1f}%"
        gap = "-" if r["belady_pct"] is None else f"{r['belady_pct'] - r['restored_pct']:.1f}"
        rest = "-" if r["budget"].startswith("none") else f"{r['restored_pct']:.1f}%"
        ev = r["evictions"]
        evs = f"{ev.get('records', 0)}, {ev.get('swa_snapshots', 0)}" if ev else "-"
        eq = {True: "yes", False: "**NO**"}.get(r.get("tokens_equal_cold"), "-")
        say(
            f"| {r['budget']} | {r['records']} | {r['prefix_mib']:.1f} | {rest} | {bel} | {gap} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['tokens_per_s']:.0f} | {evs} | {eq} |"
        )


def say(msg: str = "") -> None:
    print(msg, flush=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_model(name: str):
    if name == "tiny":
        return deepseek_v4.init(deepseek_v4.tiny_config(max_position_embeddings=16384), seed=0)
    return deepseek_v4.init(deepseek_v4.DeepseekV4Config(**SMALL), seed=0)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--workloads", default="chat,agent", help="comma-separated: chat, agent")
    ap.add_argument("--budgets", default="0.25,0.5,0.75,1.0", help="cache sizes as shares of the working set")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--shared-users", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--first-tokens", type=int, default=256)
    ap.add_argument("--message-tokens", type=int, default=128)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--tools", type=int, default=2)
    ap.add_argument("--tool-tokens", type=int, default=1024)
    ap.add_argument("--task-tokens", type=int, default=64)
    ap.add_argument("--observation-tokens", type=int, default=32)
    ap.add_argument("--call-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    args.budgets = [float(b) for b in args.budgets.split(",") if b]
    if any(not b > 0 for b in args.budgets):
        ap.error(f"--budgets {args.budgets} must be positive shares of the working set")
    args.workloads = [w for w in args.workloads.split(",") if w]
    if bad := [w for w in args.workloads if w not in ("chat", "agent")]:
        ap.error(f"--workloads {bad}: choose from chat, agent")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    say(
        f"date {datetime.date.today().isoformat()}; machine: {_machine.cores()}-core {platform.machine()} "
        f"{jax.default_backend().upper()}, jax {jax.__version__}; hkv at {_machine.hkv_revision()}"
    )
    say(f"command: python benchmarks/workload.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    model = build_model(args.model)
    cfg = model.cfg
    say(
        f"model: {args.model} DeepSeek-V4 ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, window "
        f"{cfg.sliding_window}, CSA m={cfg.compress_rate_csa} / HCA m={cfg.compress_rate_hca}), float32 random "
        f"weights; block {args.block_tokens}, prefill chunk {args.prefill_chunk}, default retention"
    )
    rng = np.random.default_rng(args.seed)
    makers = {"chat": chat_workload, "agent": agent_workload}
    results, exact = {}, True
    for name in args.workloads:
        rows, ok = run_workload(model, makers[name](args, cfg.vocab_size, rng), args)
        results[name], exact = rows, exact and ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1, default=str)
    if not exact:
        say("\nFAIL: a run's tokens differ from the engine without a prefix cache")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
