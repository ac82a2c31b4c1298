"""Serving on loopback: a bounded load of streamed multi-turn chats through the OpenAI-compatible
server (`hkv serve`), and the same requests sent straight to the engine, to show what HTTP costs.

    python benchmarks/serving.py                        # 64 users x 4 turns = 256 requests, 64 concurrent, 2 rounds
                                                        # (~8 min on 2 shared cores)
    python benchmarks/serving.py --quick                # 16 users x 3 turns, 16 concurrent, 1 round (~1-2 min)
    python benchmarks/serving.py --model tiny-gemma3 --json /tmp/serving.json
    python benchmarks/serving.py --server thread        # the server in this process (uvicorn in a thread)

Workload (seeded: `--seed`): `--users` conversations of `--turns` turns each. Every conversation
starts with one of `--system-prompts` long system prompts (`--system-words` random words from a
fixed list: ~350 tokens at the default with the tiny models' tokenizer), so conversations share it;
each turn appends the previous reply and a new user message (`--user-words` words), so a turn's
prompt extends the previous turn's. `--max-tokens` new tokens per turn, greedy (`--temperature 0`,
or seeded sampling: request seed = `--seed` + 1000 x user + turn), `ignore_eos` so every reply has
exactly `--max-tokens` tokens. Closed loop: at most `--concurrency` requests in flight; the ready
turns wait in one FIFO queue (all users' first turns, in user order, then each user's next turn
queued behind the others when its reply completes).

Phases: `--rounds` rounds of one HTTP and one direct phase of the whole workload, alternating
which goes first (HTTP, direct, direct, HTTP, ...), so that a machine whose speed drifts during the
run (a shared one) affects both alike; every phase starts from an empty prefix cache. Figures are
pooled per mode (percentiles over every request of its phases, throughput over their summed
makespans); with more than one round the per-round ratios are printed too.

HTTP: `python -m hkv serve MODEL` as a subprocess on 127.0.0.1 (a free port), started for each HTTP
phase, the engine settings below passed as flags (`--server thread` runs `create_app` under uvicorn
in a thread of this process instead, over the direct phases' engine with its prefixes evicted: the
load generator then shares this process's GIL with the server); it compiles its steps
(`Engine.warmup()`) before it listens, so the engine's compilation is not in the figures. The load
generator is the official `openai.AsyncOpenAI` client (one event loop, `--concurrency` workers,
no retries, `--request-timeout`), each request `stream=True` with
`stream_options={"include_usage": True}`. The server is stopped (SIGTERM, then killed after a
timeout) at the end, also when the run fails.

Direct: the same requests (`hkv.serve.params.chat_job` turns each request body into the prompt ids
and `hkv.SamplingParams` the server would run) submitted to an `hkv.Engine` built with the same
model weights and settings (one engine built and `warmup()`ed in this process, its prefixes
evicted before each phase; with `--server thread` the server's), with the same concurrency bound
and FIFO queue. One thread does everything: submits ready turns (`Engine.submit`), calls
`engine.step()`, and after each step reads each request's new `TokenOutput`s without waiting
(`RequestHandle.outputs(start)`, as the server's driver does; `events()` waits for the next one).
This is the engine's API at its cheapest (no thread hand-off, no serialization), so the HTTP /
direct ratios are what the whole serving layer costs: HTTP, SSE and JSON, the server's asyncio
loop and driver thread, the client, and (with `--server process`) a second process on the same
cores. Each phase starts with two untimed warm-up requests (the HTTP path's first use; two prompts
that share no block with each other or any turn, so the second one's prefix lookup runs and
neither is ever reused: the engine's admission control keeps reused chains from sequences that
restored nothing, and an idle warm-up chain must not hold the record slots), then waits for
background work to end (the step store's background compiles, `hkv.engine.compiled.wait_for_store`,
and the server process's CPU use) -- a first run after a source change compiles every step again
to store it, which would otherwise run during the timed phase.

Per request: TTFT = request sent (the client call / `Engine.submit`) -> first content chunk (a
streamed delta with non-empty text; direct: the first step after which the request's new
`TokenOutput`s carry text, so a token whose text is held back, e.g. half a UTF-8 character, waits
as it does in the stream); inter-token latency (ITL) = the gaps between a request's content
chunks (tokens that arrive together, one engine dispatch's `--decode-steps` tokens, make one
chunk); latency = sent -> last chunk. Overall: p50 / p99 of TTFT, ITL (every gap of every
request pooled) and latency; throughput = generated tokens / makespan (first request sent -> last
one done) and requests/s; errors (a failed or incomplete request, a wrong token count, a missing
usage chunk: must be 0, else the script exits 1); prefix hit rate = cached prompt tokens / prompt
tokens (HTTP: `usage.prompt_tokens_details.cached_tokens`; direct: `Generation.plan.restored_tokens`),
beside the engine's own prefix figures (`/metrics` `hkv_prefix_hash_hit_tokens_total` and
`hkv_prefix_restored_tokens_total`; direct: `engine.stats()["prefix"]`, with the validation
rejections by stage and reason), and a bound: the reusable tokens, each prompt's longest common
prefix (never its last token) with the prompt + reply tokens of a request sent before it -- no
prefix cache restores more. Under this load TTFT is mostly queueing (more requests in flight than
slots), so the HTTP / direct TTFT ratio also reflects the order requests reach the engine; what
HTTP adds to a request's TTFT is read better from the server's own TTFT
(`hkv_time_to_first_token_seconds`: submission to the engine -> first token at the server's
driver) against the client's: the difference of their means. CPU milliseconds per generated token
(the server process and this one) say what serving costs the machine.

Checks: the replies of every phase are equal (greedy or seeded: they must be), and the usage's
cached tokens sum to the engine's restored tokens (a failed check exits 1, as errors do). Programs
JAX compiles while timed are listed (`jax_log_compiles`; the server's stderr with `--server
process`); after `warmup()` there should be none (at `9481cf0` the first prefix record, restore,
eviction and window rebuild of each process built a few small eager programs on the request's
path: `tests/hkv/engine/test_warmup_gaps.py`).

Absolute times depend on the machine and its load (printed); the ratios are measured in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import _machine  # benchmarks/_machine.py (the script's folder is on sys.path)
import jax
import numpy as np
import openai

import hkv
from hkv.engine.compiled import wait_for_store
from hkv.serve.loading import TINY_MODELS, load_model
from hkv.serve.params import Job, ServedModel, chat_job
from hkv.serve.protocol import ApiError, ChatCompletionRequest

try:  # the HTTP client the openai package depends on (httpx, or its successor httpx2)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT = 900.0  # seconds for the server to load, compile (a cold cache) and answer /health
STOP_TIMEOUT = 300.0  # seconds SIGTERM may take (drain, close the engine, store its compiled steps) before a kill
WARM_PROMPTS = (  # each phase's untimed requests: ~45 tokens each (3 blocks), different from the first block on
    "Alpha: the quick brown fox jumps over the lazy dog.",
    "Omega: a slow red cat sleeps under a tall green tree.",
)
COMPILING = re.compile(r"^Compiling (\S+) with global shapes and types \((.{0,80})", re.M)  # (jax_log_compiles)


def compiled_name(m: re.Match) -> str:
    """'jit(name)' and the start of its argument types, from a `jax_log_compiles` line."""
    return f"{m.group(1)}({m.group(2).replace('ShapedArray', '')[:40]}...)"


WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word but "
    "not what all were we when your can said there use an each which she do how their if will up other about out "
    "many then them these so some her would make like him into time has look two more write go see number no way "
    "could people my than first water been call who oil its now find long down day did get come made may part"
)
WORDS = WORD_TEXT.split()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr, flush=True)


def say(msg: str = "") -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------ workload
@dataclasses.dataclass(frozen=True)
class Workload:
    """The conversations: `systems[i]` the shared system prompts, `users[u] = (system index, [user
    message of each turn])`."""

    systems: list[str]
    users: list[tuple[int, list[str]]]

    @property
    def requests(self) -> int:
        return sum(len(turns) for _, turns in self.users)


def make_workload(seed: int, users: int, turns: int, system_prompts: int, system_words: int, user_words: int):
    """A seeded workload: user u talks under system prompt u % system_prompts."""
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
    systems = [f"You are assistant {i}. {words(system_words)}" for i in range(system_prompts)]
    convs = [(u % system_prompts, [f"{words(user_words)}?" for _ in range(turns)]) for u in range(users)]
    return Workload(systems, convs)


def messages(wl: Workload, user: int, replies: list[str]) -> list[dict[str, str]]:
    """The messages of user `user`'s next turn: system, then every earlier turn and its reply."""
    system, turns = wl.users[user]
    out = [{"role": "system", "content": wl.systems[system]}]
    for k, reply in enumerate(replies):
        out += [{"role": "user", "content": turns[k]}, {"role": "assistant", "content": reply}]
    return [*out, {"role": "user", "content": turns[len(replies)]}]


@dataclasses.dataclass
class Record:
    """One request's measurements (times from time.perf_counter)."""

    user: int
    turn: int
    prompt_ids: list[int]
    sent: float = 0.0
    chunks: list[float] = dataclasses.field(default_factory=list)  # arrival of each content chunk
    text: str = ""
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reusable_tokens: int = 0
    gen_ids: list[int] | None = None  # the generated token ids (direct; HTTP: taken from direct's equal reply)
    finish_reason: str | None = None
    error: str | None = None


def reusable(records: list[Record]) -> None:
    """Set each record's `reusable_tokens`: the most a prefix cache could have restored of its prompt,
    its longest common prefix (never its last token) with the prompt + generated tokens of a request
    sent before it (`gen_ids`; where unknown, the prompt alone). Prefixes are kept as polynomial
    hashes of every prefix length."""
    seen: set[int] = set()
    mod, base = (1 << 61) - 1, 1_000_003

    def prefixes(ids: list[int]):
        h = 0
        for t in ids:
            h = (h * base + t + 1) % mod
            yield h

    for r in sorted(records, key=lambda r: r.sent):
        n = 0
        for h in prefixes(r.prompt_ids[:-1]):
            if h not in seen:
                break
            n += 1
        r.reusable_tokens = n
        seen.update(prefixes(r.prompt_ids + (r.gen_ids or [])))


class Queue:
    """The closed loop's FIFO of ready turns: every user's first turn, then each user's next turn
    behind the others once its reply completed. Shared by both phases, so they send the same requests."""

    def __init__(self, wl: Workload, args, served: ServedModel):
        self.wl, self.args, self.served = wl, args, served
        self.ready = collections.deque(range(len(wl.users)))
        self.replies: list[list[str]] = [[] for _ in wl.users]
        self.records: list[Record] = []
        self.left = wl.requests

    def body(self, user: int) -> dict[str, Any]:
        """The next turn's request body (what the HTTP client sends)."""
        turn = len(self.replies[user])
        body = {
            "model": self.served.name,
            "messages": messages(self.wl, user, self.replies[user]),
            "max_tokens": self.args.max_tokens,
            "temperature": self.args.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.args.temperature > 0:
            body["seed"] = self.args.seed + 1000 * user + turn
        return body

    def take(self) -> tuple[Record, dict[str, Any], Job | None] | None:
        """The next ready turn as (its record, its body, the engine's job), None when none is ready.
        A body the server would refuse (e.g. longer than the context) has no job and its record an
        error: it is not sent, and counts as failed."""
        if not self.ready:
            return None
        user = self.ready.popleft()
        body = self.body(user)
        rec = Record(user, len(self.replies[user]), [])
        self.records.append(rec)
        try:
            job = chat_job(ChatCompletionRequest(**body), self.served)
        except ApiError as e:
            rec.error, job = f"not sent: the server would refuse it: {e}", None
        else:
            rec.prompt_ids = job.prompts[0]
        return rec, body, job

    def done(self, rec: Record) -> None:
        """A turn ended: queue the user's next turn (a failed turn ends the conversation)."""
        turns = len(self.wl.users[rec.user][1])
        self.left -= 1
        if rec.error is not None:
            self.left -= turns - rec.turn - 1
            return
        self.replies[rec.user].append(rec.text)
        if rec.turn + 1 < turns:
            self.ready.append(rec.user)


# ------------------------------------------------------------------------------------ figures
def pct(xs, q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


ROW_FIELDS = [
    "user",
    "turn",
    "sent_s",
    "ttft_s",
    "latency_s",
    "chunks",
    "prompt_tokens",
    "cached_tokens",
    "reusable_tokens",
    "error",
]


def row(r: Record, t0: float) -> list:
    """A request's figures for the JSON output (`ROW_FIELDS`; times in seconds, sent from the phase's start)."""
    first, last = (r.chunks[0], r.chunks[-1]) if r.chunks else (np.nan, np.nan)
    return [r.user, r.turn, r.sent - t0, first - r.sent, last - r.sent, len(r.chunks), len(r.prompt_ids),
            r.cached_tokens, r.reusable_tokens, r.error]  # fmt: skip


def figures(records: list[Record], wall: float) -> dict[str, Any]:
    """The figures of these requests (their `reusable_tokens` set), over `wall` seconds of makespan."""
    ok = [r for r in records if r.error is None]
    ttft = [r.chunks[0] - r.sent for r in ok if r.chunks]
    itl = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:], strict=False)]
    lat = [r.chunks[-1] - r.sent for r in ok if r.chunks]
    tokens = sum(r.tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_messages": sorted({r.error for r in records if r.error})[:5],
        "makespan_s": wall,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "requests_per_s": len(ok) / wall if wall > 0 else float("nan"),
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "ttft_p99_ms": 1e3 * pct(ttft, 99),
        "ttft_mean_ms": 1e3 * float(np.mean(ttft)) if ttft else float("nan"),
        "itl_p50_ms": 1e3 * pct(itl, 50),
        "itl_p99_ms": 1e3 * pct(itl, 99),
        "chunks_per_request": float(np.mean([len(r.chunks) for r in ok])) if ok else float("nan"),
        "latency_p50_ms": 1e3 * pct(lat, 50),
        "latency_p99_ms": 1e3 * pct(lat, 99),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "prefix_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else float("nan"),
        "reusable_tokens": sum(r.reusable_tokens for r in ok),
        "reusable_rate": sum(r.reusable_tokens for r in ok) / prompt if prompt else float("nan"),
    }


class CompileLog(logging.Handler):
    """Counts the programs JAX builds in this process (`jax_log_compiles`), to say whether any was
    built while timed."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def emit(self, record) -> None:
        m = COMPILING.match(record.getMessage())
        if m:
            self.names.append(compiled_name(m))

    def __enter__(self) -> CompileLog:
        logger = logging.getLogger("jax")
        self._saved = jax.config.jax_log_compiles, logger.propagate
        jax.config.update("jax_log_compiles", True)
        logger.addHandler(self)
        logger.propagate = False  # (the lines come here, not to stderr)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("jax")
        logger.removeHandler(self)
        jax.config.update("jax_log_compiles", self._saved[0])
        logger.propagate = self._saved[1]


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# ------------------------------------------------------------------------------------ engine
def build_engine(loaded, args) -> hkv.Engine:
    """The engine `hkv serve` builds from the same flags (`hkv.serve.cli`)."""
    config = hkv.CacheConfig(slots=args.slots, max_context=args.max_context)
    return hkv.Engine(loaded.model, config, tokenizer=loaded.tokenizer, model_id=loaded.name,
                      prefill_chunk=args.prefill_chunk, decode_steps=args.decode_steps)  # fmt: skip


def engine_prefix(engine: hkv.Engine) -> dict[str, int]:
    """The engine's prefix counters: hash-hit and restored tokens, rejections by stage/reason, and preemptions."""
    stats = engine.stats()
    p = stats["prefix"] or {}
    out = {"hash_hit_tokens": int(p.get("hash_hit_tokens", 0)), "restored_tokens": int(p.get("restored_tokens", 0))}
    for stage, reasons in (p.get("rejections") or {}).items():
        for reason, n in reasons.items():
            out[f"rejections:{stage}/{reason}"] = int(n)
    out["preemptions"] = int(stats.get("preemptions", 0))
    return out


def delta(after: dict[str, float], before: dict[str, float], prefix: str) -> dict[str, float]:
    """The counters named `prefix`... that changed, after - before."""
    keys = [k for k in after if k.startswith(prefix)]
    return {k[len(prefix) :]: after[k] - before.get(k, 0) for k in keys if after[k] != before.get(k, 0)}


# ------------------------------------------------------------------------------------ HTTP
class Server:
    """`python -m hkv serve` on a free port of 127.0.0.1 (or, `thread`, create_app under uvicorn in a
    thread of this process); `stop()` always ends it."""

    def __init__(self, args, loaded=None, engine=None):
        self.args, self.proc, self.thread, self.uvicorn, self.log_path = args, None, None, None, None
        if args.server == "process":
            self.port = _free_port()
            cmd = [sys.executable, "-m", "hkv", "serve", args.model, "--host", "127.0.0.1", "--port", str(self.port),
                   "--slots", str(args.slots), "--max-context", str(args.max_context),
                   "--prefill-chunk", str(args.prefill_chunk), "--decode-steps", str(args.decode_steps),
                   "--max-queue", str(max(256, args.concurrency)), "--drain-timeout", "10"]  # fmt: skip
            fd, self.log_path = tempfile.mkstemp(prefix="hkv-serving-bench-", suffix=".log")
            env = {**os.environ, "JAX_LOG_COMPILES": "1", "PYTHONPATH": ROOT}
            with os.fdopen(fd, "w") as out:
                self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)  # fmt: skip
            log(f"started {' '.join(cmd[1:])} (pid {self.proc.pid}, log {self.log_path})")
        else:
            import uvicorn

            from hkv.serve import create_app

            app = create_app(engine, model_name=loaded.name, tokenizer=loaded.tokenizer,
                             chat_template=loaded.chat_template, max_queue=max(256, args.concurrency),
                             drain_timeout=10.0, close_engine=False)  # fmt: skip
            sock = socket.create_server(("127.0.0.1", 0))
            self.port, self.sock = sock.getsockname()[1], sock
            config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10)
            self.uvicorn = uvicorn.Server(config)
            self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
            self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"hkv serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.thread is not None and not self.thread.is_alive():
                raise RuntimeError("the server thread ended before it started")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s\n{self.log_tail()}")

    def log_size(self) -> int:
        return os.path.getsize(self.log_path) if self.log_path else 0

    def log_text(self, start: int = 0) -> str:
        if not self.log_path:
            return ""
        with open(self.log_path, errors="replace") as f:
            f.seek(start)
            return f.read()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def cpu_seconds(self) -> float | None:
        return proc_cpu_seconds(self.proc.pid) if self.proc is not None else None

    def metrics(self) -> dict[str, float]:
        """The /metrics samples this benchmark reads, summed over labels."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=60).text
        out: dict[str, float] = collections.defaultdict(float)
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name] += s.value
                if s.name == "hkv_prefix_rejections_total":  # by validation stage and reason
                    out[f"rejections:{s.labels.get('stage')}/{s.labels.get('reason')}"] += s.value
        return dict(out)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                log(f"hkv serve did not stop within {STOP_TIMEOUT:.0f} s of SIGTERM: killed")
                self.proc.kill()
                self.proc.wait(10)
        if self.log_path is not None and self.proc.poll() is not None:
            if self.proc.returncode == 0:  # (kept when the server failed or was killed, for its traceback)
                with contextlib.suppress(OSError):
                    os.remove(self.log_path)
            else:
                log(f"hkv serve exited with {self.proc.returncode}; its output: {self.log_path}")
            self.log_path = None
        if self.thread is not None and self.thread.is_alive():
            self.uvicorn.should_exit = True
            self.thread.join(STOP_TIMEOUT)
            self.sock.close()
            if self.thread.is_alive():
                raise RuntimeError(f"the server thread did not stop within {STOP_TIMEOUT:.0f} s")


def settle(server: Server | None, timeout: float = START_TIMEOUT) -> float:
    """Wait for background work to end before a timed phase: this process's step-store compiles
    (`hkv.engine.compiled.wait_for_store`; a first run after a source change compiles every step
    again in a background thread to store it) and, for a server process, until it uses under 0.05
    CPU-seconds per second (its own step store). Returns the seconds waited."""
    t = time.monotonic()
    wait_for_store()
    before = server.cpu_seconds() if server is not None else None
    while before is not None and time.monotonic() - t < timeout:
        time.sleep(2.0)
        now = server.cpu_seconds()
        if now is None or now - before < 0.1:
            break
        before = now
    return time.monotonic() - t


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_request(client: openai.AsyncOpenAI, rec: Record, body: dict[str, Any], q: Queue, args) -> None:
    """Send one streamed chat request; fill `rec` (an exception is recorded as its error)."""
    extra = {"ignore_eos": body["ignore_eos"]}
    kw = {k: body[k] for k in ("model", "messages", "max_tokens", "temperature", "stream", "stream_options")}
    if "seed" in body:
        kw["seed"] = body["seed"]
    usage = None
    rec.sent = time.perf_counter()
    try:
        stream = await client.chat.completions.create(**kw, extra_body=extra)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta is not None and c.delta.content:
                    rec.chunks.append(now)
                    rec.text += c.delta.content
                if c.finish_reason is not None:
                    rec.finish_reason = c.finish_reason
        if usage is None:
            raise RuntimeError("no usage chunk")
        rec.tokens, rec.prompt_tokens = usage.completion_tokens, usage.prompt_tokens
        details = usage.prompt_tokens_details
        rec.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
        check(rec, args)
    except Exception as e:
        rec.error = f"{type(e).__name__}: {str(e)[:200]}"


def check(rec: Record, args) -> None:
    """A finished request must have every token, its prompt counted right, and text."""
    if rec.finish_reason != "length" or rec.tokens != args.max_tokens:
        raise RuntimeError(
            f"finish_reason={rec.finish_reason!r} tokens={rec.tokens} (want 'length', {args.max_tokens})"
        )
    if rec.prompt_tokens != len(rec.prompt_ids):
        raise RuntimeError(f"prompt_tokens={rec.prompt_tokens}, the rendered prompt has {len(rec.prompt_ids)}")
    if not rec.chunks:
        raise RuntimeError("no content chunk")


def http_warmup(url: str, name: str, args) -> None:
    """The phase's untimed requests (`WARM_PROMPTS`): the HTTP path's first use, prefix recording's,
    and a prefix lookup with records in the index."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=args.request_timeout) as client:
        for text in WARM_PROMPTS:
            client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": text}], max_tokens=2, temperature=0
            )


async def http_phase(q: Queue, url: str, args) -> tuple[float, float]:
    """Run the workload through the server; returns (first sent, last done)."""
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=timeout) as client:
        wake = asyncio.Event()

        async def worker() -> None:
            while q.left > 0:
                item = q.take()
                if item is None:
                    wake.clear()
                    await wake.wait()
                    continue
                rec, body, job = item
                if job is not None:
                    await http_request(client, rec, body, q, args)
                q.done(rec)
                wake.set()
            wake.set()

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(args.concurrency))), args.timeout)
        return t0, time.perf_counter()


# ------------------------------------------------------------------------------------ direct
def direct_warmup(engine: hkv.Engine, served: ServedModel, args) -> None:
    """The phase's untimed requests, as `http_warmup`'s."""
    for text in WARM_PROMPTS:
        body = {"model": served.name, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        warm = chat_job(ChatCompletionRequest(**body, temperature=0), served)
        handle = engine.submit(warm.prompts[0], warm.max_tokens[0], sampling=warm.sampling)
        handle.result(timeout=args.request_timeout)


def direct_phase(q: Queue, engine: hkv.Engine, args) -> tuple[float, float]:
    """The same workload straight to the engine, from one thread: submit ready turns up to the
    concurrency bound, step, read each handle's new `TokenOutput`s without waiting (`outputs(start)`)."""
    live: dict[int, tuple[Record, hkv.RequestHandle, int]] = {}  # request id -> (record, handle, outputs read)
    deadline = time.monotonic() + args.timeout
    t0 = time.perf_counter()
    while q.left > 0:
        while len(live) < args.concurrency and (item := q.take()) is not None:
            rec, _, job = item
            if job is None:
                q.done(rec)
                continue
            rec.sent = time.perf_counter()
            try:
                h = engine.submit(job.prompts[0], job.max_tokens[0], sampling=job.sampling)
            except Exception as e:
                rec.error = f"{type(e).__name__}: {str(e)[:200]}"
                q.done(rec)
                continue
            live[h.request_id] = (rec, h, 0)
        if not live:
            if q.left > 0 and not q.ready:
                raise RuntimeError(f"{q.left} requests left and none ready or running")
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"the direct phase did not finish within {args.timeout:.0f} s")
        engine.step()
        now = time.perf_counter()
        for rid, (rec, h, seen) in list(live.items()):
            done = h.done  # (before reading: a done handle's outputs are all there)
            outs = h.outputs(seen)
            text = "".join(o.text or "" for o in outs)
            gen = None
            if done:
                try:
                    gen = h.result()
                    full = gen.text or ""
                    if full.startswith(rec.text + text):  # what the outputs held back (as the server's last chunk)
                        text = full[len(rec.text) :]
                except Exception as e:
                    rec.error = f"{type(e).__name__}: {str(e)[:200]}"
            if text:
                rec.chunks.append(now)
                rec.text += text
            live[rid] = (rec, h, seen + len(outs))
            if not done:
                continue
            del live[rid]
            if gen is not None:
                rec.tokens, rec.finish_reason, rec.gen_ids = len(gen.tokens), gen.finish_reason, list(gen.tokens)
                rec.prompt_tokens, rec.cached_tokens = len(rec.prompt_ids), int(gen.plan.restored_tokens)
                try:
                    check(rec, args)
                except RuntimeError as e:
                    rec.error = str(e)
            q.done(rec)
    return t0, time.perf_counter()


# ------------------------------------------------------------------------------------ report
ROWS = [
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}", True),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}", True),
    ("ITL p50 (ms)", "itl_p50_ms", "{:.1f}", True),
    ("ITL p99 (ms)", "itl_p99_ms", "{:.1f}", True),
    ("latency p50 (ms)", "latency_p50_ms", "{:.0f}", True),
    ("latency p99 (ms)", "latency_p99_ms", "{:.0f}", True),
    ("throughput (tokens/s)", "tokens_per_s", "{:.1f}", True),
    ("requests/s", "requests_per_s", "{:.2f}", True),
    ("makespan (s)", "makespan_s", "{:.1f}", True),
    ("content chunks / request", "chunks_per_request", "{:.1f}", False),
    ("errors", "errors", "{}", False),
    ("prefix hit rate (cached / prompt)", "prefix_hit_rate", "{:.1%}", False),
    ("  engine restored / prompt", "engine_restored_rate", "{:.1%}", False),
    ("  engine hash-hit / prompt", "engine_hash_hit_rate", "{:.1%}", False),
    ("  reusable / prompt (shared prefixes)", "reusable_rate", "{:.1%}", False),
    ("TTFT mean (ms)", "ttft_mean_ms", "{:.0f}", True),
    ("  server-side TTFT mean (ms)", "server_ttft_mean_ms", "{:.0f}", False),
    ("  HTTP's share: client - server (ms)", "http_ttft_ms", "{:.0f}", False),
    ("programs compiled while timed", "compiled_while_timed", "{}", False),
    ("CPU ms / generated token (both processes)", "cpu_ms_per_token", "{:.1f}", True),
    ("CPU s: server process", "cpu_server_s", "{:.1f}", False),
    ("CPU s: this process", "cpu_self_s", "{:.1f}", False),
]


def fmt(spec: str, v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return spec.format(v)


def table(http: dict, direct: dict) -> list[str]:
    lines = [f"{'':36s} {'HTTP':>12s} {'direct':>12s} {'HTTP/direct':>12s}"]
    for label, key, spec, ratio in ROWS:
        h, d = http.get(key), direct.get(key)
        r = f"{h / d:.2f}x" if ratio and h is not None and d and h == h and d == d else ""
        lines.append(f"{label:36s} {fmt(spec, h):>12s} {fmt(spec, d):>12s} {r:>12s}")
    return lines


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-deepseek-v4", help=f"{' or '.join(TINY_MODELS)}, or a checkpoint folder")
    p.add_argument("--server", choices=("process", "thread"), default="process",
                   help="process: `python -m hkv serve` (default); thread: uvicorn in this process")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="16 users x 3 turns, 16 concurrent, 2 system prompts, 1 round")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at most")
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-words", type=int, default=80)
    p.add_argument("--user-words", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of an HTTP and a direct phase, alternating which goes first (HTTP, direct, direct, "
                   "HTTP, ...: drift cancels); each phase starts from an empty prefix cache")  # fmt: skip
    p.add_argument("--slots", type=int, default=8, help="engine slots (hkv serve's default)")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per phase")
    p.add_argument("--json", metavar="PATH", help="write the figures here")
    args = p.parse_args(argv)
    if args.quick:  # other defaults; flags given explicitly still win
        p.set_defaults(users=16, turns=3, concurrency=16, system_prompts=2, rounds=1)
        args = p.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (1: an error or a failed check)."""
    args = parse_args(argv)
    with CompileLog() as compiles:
        return run(args, compiles)


@dataclasses.dataclass
class Phase:
    """One timed phase: `mode` "http" or "direct", its round, its requests, when it ran, and the
    server's / engine's own figures over it (`extra`)."""

    mode: str
    round: int
    records: list[Record]
    t0: float
    t1: float
    extra: dict[str, Any]


def http_round(args, wl: Workload, served: ServedModel, loaded, engine, compiles: CompileLog, rnd: int,
               server: Server | None = None) -> Phase:  # fmt: skip
    """One HTTP phase on a server started for it (a fresh engine with `--server process`; the shared
    engine, its prefixes evicted, with `--server thread`), stopped at its end."""
    if server is None:
        if args.server == "thread":
            engine.evict_prefixes()
        server = Server(args) if args.server == "process" else Server(args, loaded, engine)
    try:
        server.wait_ready()
        log(f"server ready at {server.url}")
        q = Queue(wl, args, served)
        http_warmup(server.url, served.name, args)
        log(f"settled in {settle(server):.1f} s (background compiles of either process)")
        m0 = server.metrics()  # (after the warm-up requests: every delta below is of the timed requests)
        log_at, compiled_at = server.log_size(), len(compiles.names)
        cpu_srv, cpu_self, load0 = server.cpu_seconds(), time.process_time(), os.getloadavg()[0]
        t0, t1 = asyncio.run(http_phase(q, server.url, args))
        cpu_srv = None if cpu_srv is None else server.cpu_seconds() - cpu_srv
        cpu_self = time.process_time() - cpu_self
        compiled = [compiled_name(m) for m in COMPILING.finditer(server.log_text(log_at))]
        compiled += compiles.names[compiled_at:]
        m1 = server.metrics()
    finally:
        server.stop()
    d = lambda k: m1.get(k, 0.0) - m0.get(k, 0.0)
    extra = {
        "engine_restored_tokens": d("hkv_prefix_restored_tokens_total"),
        "engine_hash_hit_tokens": d("hkv_prefix_hash_hit_tokens_total"),
        "server_ttft_sum_s": d("hkv_time_to_first_token_seconds_sum"),
        "server_ttft_count": d("hkv_time_to_first_token_seconds_count"),
        "compiled_names": compiled,
        "rejections": delta(m1, m0, "rejections:"),
        "preemptions": None,  # (not among the server's metrics)
        "cpu_server_s": cpu_srv,
        "cpu_self_s": cpu_self,
        "load": [load0, os.getloadavg()[0]],
    }
    log(f"round {rnd} HTTP: {len(q.records)} requests in {t1 - t0:.1f} s")
    return Phase("http", rnd, q.records, t0, t1, extra)


def direct_round(args, wl: Workload, served: ServedModel, engine, compiles: CompileLog, rnd: int) -> Phase:
    """One direct phase, its prefixes evicted first (every phase starts from an empty prefix cache)."""
    engine.evict_prefixes()
    q = Queue(wl, args, served)
    direct_warmup(engine, served, args)
    log(f"settled in {settle(None):.1f} s")
    p0, compiled_at = engine_prefix(engine), len(compiles.names)
    cpu_self, load0 = time.process_time(), os.getloadavg()[0]
    t0, t1 = direct_phase(q, engine, args)
    cpu_self = time.process_time() - cpu_self
    p1 = engine_prefix(engine)
    extra = {
        "engine_restored_tokens": p1["restored_tokens"] - p0["restored_tokens"],
        "engine_hash_hit_tokens": p1["hash_hit_tokens"] - p0["hash_hit_tokens"],
        "server_ttft_sum_s": None,
        "server_ttft_count": None,
        "compiled_names": compiles.names[compiled_at:],
        "rejections": delta(p1, p0, "rejections:"),
        "preemptions": p1["preemptions"] - p0["preemptions"],
        "cpu_server_s": None,
        "cpu_self_s": cpu_self,
        "load": [load0, os.getloadavg()[0]],
    }
    log(f"round {rnd} direct: {len(q.records)} requests in {t1 - t0:.1f} s")
    return Phase("direct", rnd, q.records, t0, t1, extra)


def _total(values):
    values = [v for v in values if v is not None]
    return sum(values) if values else None


def pooled(phases: list[Phase]) -> dict[str, Any]:
    """The figures of one mode over its phases: percentiles over every request, throughput over the
    phases' summed makespans, the server's and engine's counters summed."""
    records = [r for ph in phases for r in ph.records]
    f = figures(records, sum(ph.t1 - ph.t0 for ph in phases))
    ex = [ph.extra for ph in phases]
    prompt = f["prompt_tokens"] or float("nan")
    count = _total(e["server_ttft_count"] for e in ex)
    rejections: collections.Counter = collections.Counter()
    for e in ex:
        rejections.update(e["rejections"])
    f.update(
        engine_restored_tokens=_total(e["engine_restored_tokens"] for e in ex),
        engine_hash_hit_tokens=_total(e["engine_hash_hit_tokens"] for e in ex),
        server_ttft_mean_ms=1e3 * _total(e["server_ttft_sum_s"] for e in ex) / count if count else None,
        compiled_names=[n for e in ex for n in e["compiled_names"]],
        rejections=dict(rejections),
        preemptions=_total(e["preemptions"] for e in ex),
        cpu_server_s=_total(e["cpu_server_s"] for e in ex),
        cpu_self_s=_total(e["cpu_self_s"] for e in ex),
        load=[x for e in ex for x in e["load"]],
        phases=len(phases),
    )
    if f["server_ttft_mean_ms"] is not None:
        f["http_ttft_ms"] = f["ttft_mean_ms"] - f["server_ttft_mean_ms"]
    f["engine_restored_rate"] = f["engine_restored_tokens"] / prompt
    f["engine_hash_hit_rate"] = f["engine_hash_hit_tokens"] / prompt
    f["compiled_while_timed"] = len(f["compiled_names"])
    cpu = (f["cpu_server_s"] or 0.0) + f["cpu_self_s"]
    f["cpu_ms_per_token"] = 1e3 * cpu / f["generated_tokens"] if f["generated_tokens"] else None
    return f


def phase_json(ph: Phase) -> dict[str, Any]:
    """A phase for the JSON output: its figures and every request's (`ROW_FIELDS`)."""
    figs = figures(ph.records, ph.t1 - ph.t0) | ph.extra
    return {"mode": ph.mode, "round": ph.round, "figures": figs, "requests": [row(r, ph.t0) for r in ph.records]}


def tree_state() -> str:
    """Whether the hkv / models sources this process imported differ from the commit it names."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "hkv", "models", "pallas_kernels"],
                             capture_output=True, text=True, check=False, cwd=ROOT).stdout  # fmt: skip
    except OSError:
        return "git status unavailable"
    files = [line[3:] for line in out.splitlines() if line.strip()]
    return "clean" if not files else f"plus uncommitted changes in {', '.join(files)}"


RATIOS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_s", "requests_per_s")


def run(args: argparse.Namespace, compiles: CompileLog) -> int:
    wl = make_workload(args.seed, args.users, args.turns, args.system_prompts, args.system_words, args.user_words)
    say(f"# serving.py: backend={jax.default_backend()} cores={_machine.cores()} hkv={_machine.hkv_revision()} "
        f"({tree_state()}) load={os.getloadavg()[0]:.2f}")  # fmt: skip
    order = [("http", "direct") if r % 2 == 0 else ("direct", "http") for r in range(args.rounds)]
    say(f"# {args.model}, {args.users} users x {args.turns} turns = {wl.requests} requests, concurrency "
        f"{args.concurrency}, {args.system_prompts} system prompts, max_tokens {args.max_tokens}, "
        f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature} seeded'}; engine: slots "
        f"{args.slots} x {args.max_context}, prefill chunk {args.prefill_chunk}, decode steps {args.decode_steps}; "
        f"server: {'python -m hkv serve (subprocess)' if args.server == 'process' else 'uvicorn thread'}; "
        f"phases: {', '.join(m for pair in order for m in pair)}")  # fmt: skip
    loaded = load_model(args.model)
    served = ServedModel(loaded.name, loaded.tokenizer, loaded.chat_template, args.max_context,
                         loaded.model.vocab_size)  # fmt: skip
    first_server = Server(args) if args.server == "process" else None  # starts while this process builds its engine
    engine = None
    phases: list[Phase] = []
    try:
        engine = build_engine(loaded, args)
        t = time.perf_counter()
        engine.warmup()
        log(f"direct engine warmed up in {time.perf_counter() - t:.1f} s")
        for rnd, pair in enumerate(order):
            for mode in pair:
                if mode == "http":
                    phases.append(http_round(args, wl, served, loaded, engine, compiles, rnd, first_server))
                    first_server = None
                else:
                    phases.append(direct_round(args, wl, served, engine, compiles, rnd))
    finally:
        if first_server is not None:
            first_server.stop()
        if engine is not None:
            engine.close()

    # the HTTP replies' token ids are the direct ones where the texts are equal (for the reusable bound)
    by_key = {(r.user, r.turn, r.text): r.gen_ids for ph in phases if ph.mode == "direct" for r in ph.records}
    for ph in phases:
        for r in ph.records:
            if r.gen_ids is None and r.error is None:
                r.gen_ids = by_key.get((r.user, r.turn, r.text))
        reusable(ph.records)  # (per phase: each starts from an empty cache)
    http = pooled([ph for ph in phases if ph.mode == "http"])
    direct = pooled([ph for ph in phases if ph.mode == "direct"])
    ratios = {k: http[k] / direct[k] for k in RATIOS if direct[k]}

    say()
    for line in table(http, direct):
        say(line)
    if args.rounds > 1:
        by_round = collections.defaultdict(dict)
        for ph in phases:
            by_round[ph.round][ph.mode] = figures(ph.records, ph.t1 - ph.t0)
        for k, label in (("tokens_per_s", "throughput"), ("ttft_p50_ms", "TTFT p50"), ("itl_p50_ms", "ITL p50")):
            per = [by_round[r]["http"][k] / by_round[r]["direct"][k] for r in sorted(by_round)]
            say(f"HTTP/direct {label} per round: {', '.join(f'{x:.2f}x' for x in per)}")
    say(f"load average (1 min) at each phase's start / end: HTTP {' '.join(f'{x:.1f}' for x in http['load'])}; "
        f"direct {' '.join(f'{x:.1f}' for x in direct['load'])}")  # fmt: skip

    # ---- checks
    failures = []
    for name, f in (("HTTP", http), ("direct", direct)):
        if f["errors"]:
            failures.append(f"{name}: {f['errors']} failed requests, e.g. {f['error_messages']}")
        if f["cached_tokens"] != f["engine_restored_tokens"]:
            restored = f["engine_restored_tokens"]
            failures.append(f"{name}: usage's cached tokens {f['cached_tokens']} != engine restored {restored:.0f}")
        top = sorted(f["rejections"].items(), key=lambda kv: -kv[1])[:4]
        say(f"{name}: prefix rejections (stage/reason: plans shrunk) {dict(top) or 'none'}; "
            f"preemptions {'-' if f['preemptions'] is None else f['preemptions']}")  # fmt: skip
        if f["compiled_while_timed"]:
            names = collections.Counter(f["compiled_names"])
            say(f"{name}: programs compiled while timed: {', '.join(f'{k} x{v}' for k, v in names.items())}")
    reference = {(r.user, r.turn): r.text for r in phases[0].records if r.error is None}
    compared = differ = 0
    for ph in phases[1:]:
        for r in ph.records:
            key = (r.user, r.turn)
            if r.error is None and key in reference:
                compared += 1
                if r.text != reference[key]:
                    differ += 1
                    if differ == 1:
                        failures.append(f"replies differ between phases: round {ph.round} {ph.mode}, (user, turn) = "
                                        f"{key}: {r.text!r}, round 0 {phases[0].mode}: {reference[key]!r}")  # fmt: skip
    if differ > 1:
        failures.append(f"{differ} replies differ between phases in all")
    say(f"replies equal to the first phase's: {compared - differ} of {compared}")

    if args.json:
        out = {
            "args": vars(args),
            "revision": _machine.hkv_revision(),
            "tree": tree_state(),
            "cores": _machine.cores(),
            "backend": jax.default_backend(),
            "http": http,
            "direct": direct,
            "ratios": ratios,
            "replies_differ": differ,
            "request_fields": ROW_FIELDS,
            "phases": [phase_json(ph) for ph in phases],
            "failures": failures,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=float)
    for msg in failures:
        say(f"FAILED: {msg}")
    return 1 if failures else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (so the finally blocks stop the server)
    sys.exit(main())
