"""Chaos harness (issue 11: "never a wrong token, never a stuck engine").

Several OS processes, each with its own `hkv.Engine` (tiny DeepSeek-V4, prefix cache, `hkv.DiskTier`
on ONE shared store), run multi-turn chats while the parent process injects faults:

* store faults, by the parent, on the files of the running store: byte flips, truncations and
  deletions of data shards and manifests; one segment's manifest or shard copied over another's;
  stray and hostile files (deeply nested JSON, symlink loops, `manifests/README.json`, garbage,
  empty files, directories named like manifests); manifests resealed with a valid crc32 but huge or
  overflowing sizes; budget eviction by another process (`DiskTier(budget_bytes=...)`,
  `enforce_budget`); with a store key, manifests forged without the key (block objects swapped);
* process faults: SIGKILL of a process while its disk writes are in flight; SIGKILL of a process
  inside `engine.save(path, overwrite=True)` (paused after each file-system operation of the save:
  at every pause the parent checks that `path` still holds a whole checkpoint, then kills at one of
  them) followed by `Engine.restore(path)`; `KeyboardInterrupt` inside `generate` (raised by the
  `progress=` callback at a chosen call, or SIGINT sent at a chosen delay) followed by a health check
  (slots released, cache not donated, `check_invariants`) and a retry; a full disk for one turn
  (RLIMIT_FSIZE of 64 bytes: every file write of that process past 64 bytes fails with EFBIG, as
  writes fail on a full file system — unprivileged and confined to one process, unlike mounting a
  tiny tmpfs, which needs root); a process with OTHER weights and the same `model_id` that stores
  the shared system prompt's blocks first (same block keys: only the ABI fingerprint keeps them
  apart).

Every generation is checked token by token against the truth: greedy decoding by the stateless
forward (`models.deepseek_v4.forward_fn`, the definition of truth; the same loop as
`greedy_stateless`, compiled once at a fixed padded length). Workers report counts as JSON;
the parent aggregates them (`run_chaos` -> report dict) and `judge` lists every failure:
a wrong token, an unexpected exception, an engine left unusable (slot leak, donated cache, a retry
that fails), a disk tier that raised or stopped serving restores, a checkpoint lost by a kill during
save, a turn that did not finish in time, and `hkv store verify` exiting other than 0/1 or with a
traceback.

Everything random is drawn from `random.Random(seed)` (parent: fault kinds, dealt in shuffled
rounds, targets, timings, interrupts, kill points) and `numpy.random.default_rng` (workloads; the
replies are the truth's, so a bug never changes the workload); the OS interleaving of processes is
not controlled, so the files a fault hits (and the counts) vary a little between runs of one seed.
Children run under RLIMIT_AS = 6 GiB: a hostile size may fail an allocation, never exhaust the
machine.

Children run `python -m tests.chaos.harness worker CONFIG.json`. Used by tests/chaos/test_chaos.py
and benchmarks/chaos.py.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import inspect
import json
import os
import pathlib
import queue
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPILE_CACHE = os.environ.get("HKV_TEST_COMPILATION_CACHE") or os.path.join(
    tempfile.gettempdir(), "hkv-test-xla-cache"
)
TAG = "CHAOS "  # protocol lines on a worker's stdout start with this
STRAY = "stray-"  # names of the files the parent plants in the store
STORE_KEY = b"chaos-store-key-0123456789abcdef"

# the engine: the configuration of tests/hkv/engine/test_prefix.make_engine(scale=1, records=24), so every
# compiled program is shared with the rest of the suite through the compilation cache
BT, SLOTS, MAX_CONTEXT, PAGE, RECORDS, CHUNK = 16, 2, 352, 8, 24, 16
MAX_NEW = 3
SYSTEM_TOKENS = 96  # six blocks shared by every chat (and stored first by the process with other weights)
ADDRESS_SPACE = 6 << 30  # RLIMIT_AS of children: a hostile size may fail an allocation, never eat the machine

STORE_FAULTS = (
    "flip_data",
    "truncate_data",
    "delete_data",
    "flip_manifest",
    "truncate_manifest",
    "delete_manifest",
    "swap_manifest",
    "swap_data",
    "nested_json",
    "symlink_loop",
    "readme_json",
    "garbage",
    "huge_manifest",
    "budget_evict",
)
KEYED_FAULTS = ("forged_manifest",)  # a manifest resealed without the key that lies about its data


def known_reasons() -> set[str]:
    """Every plan reason hkv documents (prefix stages and disk tier)."""
    import hkv

    return {str(r) for r in hkv.Reason}


@dataclasses.dataclass
class ChaosConfig:
    workers: int = 2  # processes with the shared weights
    alien: bool = True  # one more process: other weights, same model_id, same store
    turns: int = 3  # turns per process (at least; `duration` may add more)
    duration: float | None = None  # seconds of turns (then `turns` is a minimum)
    seed: int = 0
    fault_rate: float = 1.5  # store faults per turn (1.5: one or two); kinds dealt in shuffled rounds
    store_faults: tuple[str, ...] = STORE_FAULTS
    key: bool = False  # DiskTier(key=...) in every process (skipped when hkv lacks it) + forged manifests
    interrupt_rate: float = 0.35  # per generate call: a KeyboardInterrupt is armed
    disk_full_rate: float = 0.15  # per turn and process: writes fail (RLIMIT_FSIZE) for that turn
    evict_rate: float = 0.5  # per turn and process: evict_prefixes first (the hit comes from disk)
    branch_rate: float = 0.3  # per turn: a second prompt re-asks an earlier prefix (batch of two)
    budget_bytes: int | None = 320 << 10  # store budget of worker 0 (segments are ~100 KiB: it evicts others')
    kill_alien_turn: int | None = 1  # SIGKILL the alien while its disk writes are in flight (no respawn)
    kill_writer_turns: tuple[int, ...] = ()  # SIGKILL worker 0 mid-write at these turns, respawn + restore
    save_kill_turns: tuple[int, ...] = (1,)  # worker 1 (or 0) saves paused; killed at one pause; restored
    final_save_kill: bool = True  # after the final checks, worker 0 is SIGKILLed inside a save (no restart)
    save_every: int = 0  # every worker also saves after each N-th turn (0: only the saves the kills need)
    turn_timeout: float = 240.0
    start_timeout: float = 300.0
    message_tokens: tuple[int, int] = (6, 18)  # a turn's new message (larger: chats reach max_context sooner)
    corrupt_truth: bool = False  # self-check of the harness: worker 0 flips a truth token (must be caught)


# ----------------------------------------------------------------------------------- workload
class Chat:
    """A deterministic multi-turn chat: prompt(t) = previous prompt + the (true) reply + a message.
    The reply is the truth (not the engine's output), so the workload never depends on a bug."""

    def __init__(self, seed: int, wid: int, vocab: int = 128, message: tuple[int, int] = (6, 18)):
        import numpy as np

        self.np = np
        self.system = np.random.default_rng([seed, 7]).integers(0, vocab, SYSTEM_TOKENS).tolist()
        self.rng = np.random.default_rng([seed, 11, wid])
        self.vocab = vocab
        self.message = tuple(message)
        self.history: list[int] = []
        self.asked: list[list[int]] = []  # earlier prompts (for branches)

    def _msg(self, lo: int, hi: int) -> list[int]:
        return self.rng.integers(0, self.vocab, int(self.rng.integers(lo, hi + 1))).tolist()

    def prompts(self, branch: bool) -> list[list[int]]:
        if not self.history or len(self.history) + self.message[1] + 6 + MAX_NEW > MAX_CONTEXT - 8:
            self.history = self.system + self._msg(8, 20)  # a new conversation
        else:
            self.history = self.history + self._msg(*self.message)
        out = [list(self.history)]
        if branch and self.asked:
            old = self.asked[int(self.rng.integers(0, len(self.asked)))]
            cut = int(self.rng.integers(1, max(2, len(old) // BT + 1))) * BT
            out.append(old[: min(cut, len(old) - 1)] + self._msg(4, 12))
        self.asked.append(list(self.history))
        return out

    def reply(self, tokens: list[int]) -> None:
        self.history = self.history + list(tokens)

    def state(self) -> dict:
        return {"history": self.history, "asked": self.asked, "rng": self.rng.bit_generator.state}

    def load(self, st: dict) -> None:
        self.history, self.asked = st["history"], st["asked"]
        self.rng.bit_generator.state = st["rng"]


# ------------------------------------------------------------------------------------- worker
def _count(d: dict, k: str, n: int = 1) -> None:
    d[k] = d.get(k, 0) + n


def _new_counts() -> dict:
    return {
        "generations": 0,
        "tokens_checked": 0,
        "wrong_tokens": 0,
        "wrong": [],
        "exceptions": {},
        "exception_details": [],
        "plan_reasons": {},
        "disk_plans": 0,
        "disk_tokens": 0,
        "restored_tokens": 0,
        "interrupts": {"armed": 0, "raised": 0, "missed": 0},
        "interrupt_damage": {},
        "tier_errors": {},
        "tier_error_details": [],
        "tier_open_failures": {},
        "disk_unavailable": 0,
        "disk_full_turns": 0,
        "write_failures": 0,
        "writes_dropped": 0,
        "capacity_refusals": {},
        "saves": 0,
        "save_errors": {},
        "restores": {"ok": 0, "failed": 0, "fresh": 0},
        "restore_errors": [],
        "engine_replaced": 0,
        "worker_faults": {},
        "turns": 0,
        "plan_log": [],
        "final": None,
    }


class Worker:
    """One process of the chaos run (see the module docstring); driven by JSON lines on stdin."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.wid = cfg["wid"]
        self.state_path = cfg["state_path"]
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        jax.config.update("jax_compilation_cache_dir", cfg["compile_cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # as the suite (tests/conftest.py)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        import numpy as np

        import hkv
        from models.deepseek_v4 import forward_fn, init, tiny_config

        self.jax, self.np, self.hkv = jax, np, hkv
        self.model = init(tiny_config(), seed=cfg["weights_seed"])
        self.fwd = forward_fn(self.model)
        self.truths: dict[tuple, list[int]] = {}
        self.chat = Chat(cfg["seed"], cfg["chat_id"], message=cfg.get("message_tokens", (6, 18)))
        self.counts = _new_counts()
        self.turn = 0
        if os.path.exists(self.state_path):
            st = json.loads(pathlib.Path(self.state_path).read_text())
            self.chat.load(st["chat"])
            self.counts, self.turn = st["counts"], st["turn"]
        self.armed: dict | None = None  # the interrupt armed for the running generate
        self.progress_calls = 0
        self.tier = self._open_tier()
        self.engine = self._engine(restore=cfg.get("restore"))
        self.t_init = round(time.monotonic() - T0, 1)  # imports, weights, tier, engine (or restore)

    # ----------------------------------------------------------------------------- plumbing
    def say(self, **event) -> None:
        sys.stdout.write(TAG + json.dumps(event) + "\n")
        sys.stdout.flush()

    def save_state(self) -> None:
        tmp = self.state_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"chat": self.chat.state(), "counts": self.counts, "turn": self.turn}, f)
        os.replace(tmp, self.state_path)

    def _exception(self, where: str, e: BaseException) -> None:
        _count(self.counts["exceptions"], type(e).__name__)
        if self.counts["exceptions"][type(e).__name__] <= 3:  # the first three of each type
            self.counts["exception_details"].append(
                f"worker {self.wid} turn {self.turn} {where}: {type(e).__name__}: {str(e)[:300]}\n"
                + "".join(traceback.format_exception(e)[-3:])[-1200:]
            )

    def _tier_error(self, what: str, e: BaseException) -> None:
        _count(self.counts["tier_errors"], f"{what}:{type(e).__name__}")
        if len(self.counts["tier_error_details"]) < 6:
            self.counts["tier_error_details"].append(
                f"worker {self.wid} turn {self.turn} {what}: {type(e).__name__}: {str(e)[:300]}"
            )

    def _open_tier(self):
        kw = {"writer_id": f"w{self.wid}-{os.getpid()}", "refresh_seconds": 0.2}
        if self.cfg["key"]:
            kw["key"] = STORE_KEY
        if self.cfg.get("budget_bytes") is not None:
            kw["budget_bytes"] = self.cfg["budget_bytes"]
        try:
            tier = self.hkv.DiskTier(self.cfg["store"], **kw)
        except Exception as e:  # one bad file must not keep a process from its store
            _count(self.counts["tier_open_failures"], type(e).__name__)
            self._exception("DiskTier()", e)
            return None
        # count what the engine would swallow as "disk tier unavailable": a store fault must be a
        # reason on a shorter plan, never an exception inside the tier
        for name in ("find_chain", "read", "refresh", "write_async"):
            real = getattr(tier, name)

            def wrapped(*a, _real=real, _name=name, **kw):
                try:
                    return _real(*a, **kw)
                except Exception as e:
                    self._tier_error(_name, e)
                    raise

            setattr(tier, name, wrapped)
        return tier

    def _progress(self, msg: str) -> None:
        if "disk tier unavailable" in msg:
            self.counts["disk_unavailable"] += 1
        self.progress_calls += 1
        a = self.armed
        if a is not None and a["mode"] == "progress" and self.progress_calls == a["at"]:
            self.armed = None
            raise KeyboardInterrupt(f"chaos: progress call {a['at']}")

    def _alarm(self, *_):
        """A Ctrl-C at a random moment of generate: SIGINT to this process, handled by whatever
        SIGINT handler is installed then (Python's raises KeyboardInterrupt; hkv may defer it)."""
        if self.armed is not None and self.armed["mode"] == "signal":
            self.armed = None
            signal.raise_signal(signal.SIGINT)

    def _engine(self, restore: str | None = None):
        hkv = self.hkv
        kw = dict(disk=self.tier, progress=self._progress)
        if restore and os.path.isdir(restore):
            try:
                eng = hkv.Engine.restore(restore, self.model, **kw)
                self.counts["restores"]["ok"] += 1
                return eng
            except Exception as e:  # reported; the process goes on with a fresh engine
                self.counts["restores"]["failed"] += 1
                self.counts["restore_errors"].append(f"worker {self.wid}: {type(e).__name__}: {str(e)[:300]}")
        elif restore:
            self.counts["restores"]["failed"] += 1
            self.counts["restore_errors"].append(f"worker {self.wid}: no checkpoint at {restore} after a kill")
        self.counts["restores"]["fresh"] += 1
        layout = hkv.CacheLayout(
            self.model.cache_spec(block_tokens=BT),
            hkv.CacheConfig(slots=SLOTS, max_context=MAX_CONTEXT, page_size=PAGE),
        )
        pages = tuple(layout.reserved_pages(g) for g in range(len(layout.groups)))
        config = hkv.CacheConfig(
            slots=SLOTS, max_context=MAX_CONTEXT, page_size=PAGE, pool_pages=pages, prefix_records=RECORDS
        )
        return hkv.Engine(self.model, config, block_tokens=BT, prefill_chunk=CHUNK, model_id="chaos-tiny", **kw)

    def truth(self, prompt: list[int]) -> list[int]:
        """Greedy tokens of the stateless forward (no cache): the definition of truth."""
        key = tuple(prompt)
        if key not in self.truths:
            np = self.np
            buf = np.zeros((1, MAX_CONTEXT), np.int32)
            buf[0, : len(prompt)] = prompt
            cur, out = len(prompt), []
            for _ in range(MAX_NEW):
                tok = int(np.asarray(self.fwd(buf))[0, cur - 1].argmax())
                out.append(tok)
                buf[0, cur] = tok
                cur += 1
            self.truths[key] = out
        return list(self.truths[key])

    # ---------------------------------------------------------------------------- health
    def health(self) -> list[str]:
        """What is wrong with an idle engine (after an interrupt or an exception)."""
        problems = []
        leaves = self.jax.tree_util.tree_leaves(self.engine.cache) if self.engine.cache is not None else []
        if not leaves or any(x.is_deleted() for x in leaves if hasattr(x, "is_deleted")):
            return ["donated_cache"]
        if int(self.np.asarray(self.engine.cache.active).sum()):
            problems.append("slot_leak")
        if self.engine.scheduler.running:
            problems.append("running_left")
        try:
            self.hkv.check_invariants(self.engine.layout, self.engine.cache)
        except Exception as e:
            problems.append(f"invariants:{type(e).__name__}")
        return problems

    def replace_engine(self) -> None:
        self.counts["engine_replaced"] += 1
        self.engine = self._engine()

    # ------------------------------------------------------------------------------- turns
    def check(self, gens, prompts, where: str) -> None:
        for g, p in zip(gens, prompts, strict=True):
            want = self.truth(p)
            if self.cfg.get("corrupt_truth") and self.counts["generations"] == 1:
                want[0] = (want[0] + 1) % self.model.cfg.vocab_size  # the harness's self-check
            self.counts["generations"] += 1
            self.counts["tokens_checked"] += len(want)
            bad = sum(a != b for a, b in zip(g.tokens, want, strict=False)) + abs(len(g.tokens) - len(want))
            if bad:
                self.counts["wrong_tokens"] += bad
                if len(self.counts["wrong"]) < 8:
                    self.counts["wrong"].append(
                        {
                            "worker": self.wid,
                            "turn": self.turn,
                            "where": where,
                            "got": g.tokens,
                            "want": want,
                            "prompt_len": len(p),
                            "plan": {
                                "reason": g.plan.reason,
                                "restored": g.plan.restored_tokens,
                                "disk": g.plan.disk_tokens,
                            },
                        }
                    )
            plan = g.plan
            if len(self.counts["plan_log"]) < 60:
                self.counts["plan_log"].append(
                    [self.wid, self.turn, where, len(p), plan.reason, plan.restored_tokens, plan.disk_tokens, bad]
                )
            _count(self.counts["plan_reasons"], str(plan.reason))
            self.counts["restored_tokens"] += plan.restored_tokens
            if plan.disk_tokens:
                self.counts["disk_plans"] += 1
                self.counts["disk_tokens"] += plan.disk_tokens[1] - plan.disk_tokens[0]

    def generate(self, prompts, interrupt: dict | None, where: str):
        """engine.generate with an optional interrupt; checks the output. Returns True if it ran."""
        for p in prompts:
            self.truth(p)  # computed first: an alarm only ever fires inside generate
        if interrupt is not None:
            self.counts["interrupts"]["armed"] += 1
            _count(self.counts["worker_faults"], f"interrupt_{interrupt['mode']}")
            self.progress_calls = 0
            self.armed = dict(interrupt)
            if interrupt["mode"] == "signal":
                signal.setitimer(signal.ITIMER_REAL, interrupt["delay"])
        try:
            try:
                gens = self.engine.generate(prompts, MAX_NEW)
            finally:
                self.armed = None
                signal.setitimer(signal.ITIMER_REAL, 0)
        except KeyboardInterrupt:
            self.counts["interrupts"]["raised"] += 1
            return self.recover(prompts, where, "interrupt")
        except Exception as e:  # an exception from generate is a failure (counted)
            self._exception(where, e)
            if type(e).__name__ == "CacheCapacityError":  # does it fit once the prefix cache is empty?
                leaked = {"slot_leak", "running_left", "donated_cache"} & set(self.health())
                _count(self.counts["capacity_refusals"], "with_a_leaked_slot" if leaked else "idle_engine")
                try:
                    self.engine.evict_prefixes()
                    gens = self.engine.generate(prompts, MAX_NEW)
                    _count(self.counts["capacity_refusals"], "fits_after_evict_prefixes")
                    self.check(gens, prompts, where + " (after evict_prefixes)")
                    return True
                except Exception as e2:
                    _count(self.counts["capacity_refusals"], f"still_refused:{type(e2).__name__}")
            return self.recover(prompts, where, "exception")
        if interrupt is not None:
            self.counts["interrupts"]["missed"] += 1  # generate finished before the interrupt point
        self.check(gens, prompts, where)
        return True

    def recover(self, prompts, where: str, why: str) -> bool:
        """After an interrupt or exception: the engine must be idle and usable; the retry exact."""
        for p in self.health():
            _count(self.counts["interrupt_damage"], f"{why}:{p}")
        try:
            gens = self.engine.generate(prompts, MAX_NEW)
        except BaseException as e:
            _count(self.counts["interrupt_damage"], f"{why}:retry_failed:{type(e).__name__}")
            self._exception(where + f" (retry after {why})", e)
            self.replace_engine()
            try:
                gens = self.engine.generate(prompts, MAX_NEW)
            except Exception as e2:
                self._exception(where + " (fresh engine)", e2)
                return False
        self.check(gens, prompts, where + f" (retry after {why})")
        return True

    def run_turn(self, cmd: dict) -> None:
        a = cmd["actions"]
        prompts = self.chat.prompts(branch=a.get("branch", False))
        if a.get("disk_full"):
            self.counts["disk_full_turns"] += 1
            _count(self.counts["worker_faults"], "disk_full")
        if a.get("evict"):
            try:
                self.engine.evict_prefixes()
            except Exception as e:
                self._exception("evict_prefixes", e)
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        if a.get("disk_full"):
            resource.setrlimit(resource.RLIMIT_FSIZE, (64, limits[1]))
        try:
            self.generate(prompts, a.get("interrupt"), "turn")
            if self.tier is not None:
                self.say(event="writing", turn=self.turn)
                try:
                    self.engine.write_through()
                    self.engine.flush_disk()
                except Exception as e:
                    self._exception("write_through", e)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        self.chat.reply(self.truth(prompts[0]))
        self.turn += 1
        self.counts["turns"] += 1
        self._tier_counters()
        self.save_state()

    def _tier_counters(self) -> None:
        if self.tier is not None:
            c = self.tier.counters
            self.counts["write_failures"] = self._base_wf + c["write_failures"]
            self.counts["writes_dropped"] = self._base_wd + c["writes_dropped"]

    def save(self, cmd: dict) -> None:
        """engine.save(overwrite=True); with pause=True, stop after each file-system operation of the
        save until the parent says go on (or kills this process there)."""
        path = self.cfg["ckpt"]
        patched = []
        if cmd.get("pause"):
            n = [0]
            lock = threading.Lock()

            def hook(mod, name):
                real = getattr(mod, name)

                def op(*a, **kw):
                    out = real(*a, **kw)
                    with lock:
                        n[0] += 1
                        self.say(event="op", n=n[0], op=name, args=[str(x) for x in a[:2]])
                        line = sys.stdin.readline()
                        if not line:
                            os._exit(3)
                    return out

                setattr(mod, name, op)
                patched.append((mod, name, real))

            for name in ("rename", "replace", "symlink", "unlink", "remove", "rmdir", "link"):
                hook(os, name)
            hook(shutil, "rmtree")
        try:
            self.engine.save(path, overwrite=True)
            self.counts["saves"] += 1
        except Exception as e:
            _count(self.counts["save_errors"], type(e).__name__)
            self._exception("save", e)
        finally:
            for mod, name, real in patched:
                setattr(mod, name, real)
        self.save_state()

    def quiesce(self) -> None:
        if self.tier is not None:
            self.tier.budget_bytes = None  # nobody evicts during the final checks
            try:
                self.engine.flush_disk()
            except Exception as e:
                self._exception("flush_disk", e)

    def final(self) -> None:
        """After the faults: the engine is idle and exact, and the store, hostile files and all,
        still serves what this process writes: a fresh prompt (on an emptied device prefix index,
        so every block is recorded) is written, evicted, found and read back verified by the tier,
        then generated again (restored from disk unless the engine's measured costs say recompute)."""
        from hkv.engine.block_keys import chain_keys

        out = {"health": self.health(), "exact": None, "disk_restore": None, "tier_ok": None}
        if out["health"]:
            for p in out["health"]:
                _count(self.counts["interrupt_damage"], f"final:{p}")
            self.replace_engine()
        rng = self.np.random.default_rng([self.cfg["seed"], 99, self.wid])
        prompt = rng.integers(0, self.model.cfg.vocab_size, 5 * BT + 7).tolist()
        before = self.counts["wrong_tokens"]
        try:
            self.engine.evict_prefixes()
            self.engine.flush_disk()
        except Exception as e:
            self._exception("final evict_prefixes", e)
        ok = self.generate([prompt], None, "final")
        if self.tier is not None and ok:
            try:
                wf = self.tier.counters["write_failures"]
                out["offloaded"] = self.engine.write_through()
                self.engine.flush_disk()
                out["evicted"] = self.engine.evict_prefixes()
                self.engine.flush_disk()
                out["write_failures"] = self.tier.counters["write_failures"] - wf
                keys = chain_keys(prompt, BT)
                toks = [prompt[i * BT : (i + 1) * BT] for i in range(len(keys))]
                found = self.tier.find_chain(self.engine.spec.fingerprint(), keys, toks)
                res = self.tier.read(found.refs)
                out["tier_read"] = {
                    "blocks": len(keys),
                    "found": len(found.refs),
                    "stop": found.stop,
                    "verified": len(res.payloads),
                    "reason": res.reason,
                    "detail": res.detail[:200],
                }
                out["tier_ok"] = len(res.payloads) == len(keys) and res.reason is None
                (g,) = self.engine.generate([prompt], MAX_NEW)
                self.check([g], [prompt], "final from disk")
                out["disk_restore"] = g.plan.disk_tokens is not None
                out["disk_plan"] = {
                    "reason": g.plan.reason,
                    "disk": g.plan.disk_tokens,
                    "restored": g.plan.restored_tokens,
                }
            except Exception as e:
                self._exception("final from disk", e)
                out["tier_ok"] = False
        out["exact"] = ok and self.counts["wrong_tokens"] == before
        out["health_after"] = self.health()
        self.counts["final"] = out
        self._tier_counters()
        self.save_state()

    def close(self) -> None:
        if self.tier is not None:
            try:
                self.tier.close()
            except Exception as e:
                self._exception("tier.close", e)
        self.save_state()

    def main(self) -> None:
        signal.signal(signal.SIGALRM, self._alarm)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a full disk is an error, not a dead process
        c = self.tier.counters if self.tier is not None else {"write_failures": 0, "writes_dropped": 0}
        self._base_wf = self.counts["write_failures"] - c["write_failures"]
        self._base_wd = self.counts["writes_dropped"] - c["writes_dropped"]
        # warm-up (compiles every program, checked like any generation): a cold prompt, then the same
        # prompt restored from disk
        if self.cfg.get("warmup"):
            rng = self.np.random.default_rng([self.cfg["seed"], 5, self.wid])
            p = rng.integers(0, self.model.cfg.vocab_size, 3 * BT + 5).tolist()
            if self.cfg["weights_seed"] != 0:  # the other weights store the shared system prompt first
                p = self.chat.system + p[:5]
            self.generate([p], None, "warmup")
            if self.tier is not None:
                self.engine.evict_prefixes()
                self.engine.flush_disk()
                self.generate([p], None, "warmup from disk")
        self.save_state()
        self.say(event="ready", turn=self.turn, seconds=round(time.monotonic() - T0, 1), init=self.t_init)
        while True:
            line = sys.stdin.readline()
            if not line:
                return
            cmd = json.loads(line)
            kind = cmd["cmd"]
            try:
                if kind == "turn":
                    self.run_turn(cmd)
                elif kind == "save":
                    self.save(cmd)
                elif kind == "quiesce":
                    self.quiesce()
                elif kind == "final":
                    self.final()
                    self.say(event="summary", counts=self.counts)
                    continue
                elif kind == "exit":
                    self.close()
                    return
            except KeyboardInterrupt:  # a SIGINT delivered after generate returned (deferred by hkv)
                _count(self.counts["interrupts"], "late")
                self.save_state()
            except Exception as e:  # the harness itself must not die silently
                self._exception(f"cmd {kind}", e)
                self.save_state()
            self.say(event="done", cmd=kind, turn=self.turn)


T0 = time.monotonic()


def worker_entry(config_path: str) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, resource.getrlimit(resource.RLIMIT_AS)[1]))
    cfg = json.loads(pathlib.Path(config_path).read_text())
    Worker(cfg).main()


# --------------------------------------------------------------------------------- store faults
class StoreFaults:
    """The parent's store faults: plain file operations on the running store (see the module doc)."""

    def __init__(self, store: str, rng: random.Random, keyed: bool):
        self.store, self.rng, self.keyed = store, rng, keyed
        self.log: list[str] = []
        self.counts: dict[str, int] = {}
        self.skipped: dict[str, int] = {}
        self.parent_tier_errors: dict[str, int] = {}
        self.parent_tier_error_details: list[str] = []

    def _manifests(self) -> list[str]:
        return sorted(
            f
            for f in glob.glob(os.path.join(self.store, "manifests", "*", "*.json"))
            if os.path.isfile(f) and not os.path.islink(f) and STRAY not in os.path.basename(f)
        )

    def _shards(self) -> list[str]:
        return sorted(
            f
            for f in glob.glob(os.path.join(self.store, "data", "*", "*", "c", "*"))
            if os.path.isfile(f)
            and not os.path.islink(f)
            and not f.endswith(".__lock")
            and STRAY not in os.path.relpath(f, self.store)
        )

    def _abis(self) -> list[str]:
        return (
            sorted(d for d in os.listdir(os.path.join(self.store, "manifests")) if len(d) == 32)
            if os.path.isdir(os.path.join(self.store, "manifests"))
            else []
        )

    def _name(self) -> str:
        return f"{STRAY}{self.rng.randrange(1 << 30):08x}"

    def inject(self, kind: str) -> bool:
        try:
            what = getattr(self, "_" + kind)()
        except FileNotFoundError:  # the target went away under us (eviction): try another time
            what = None
        if what is None:
            _count(self.skipped, kind)
            return False
        _count(self.counts, kind)
        self.log.append(f"{kind}: {what}")
        return True

    @staticmethod
    def _rewrite(path: str, data: bytes) -> None:
        with open(path, "r+b" if os.path.exists(path) else "wb") as f:
            f.seek(0)
            f.write(data)
            f.truncate()

    # -- damage to published files
    def _flip(self, files: list[str]):
        if not files:
            return None
        f = self.rng.choice(files)
        data = bytearray(pathlib.Path(f).read_bytes())
        if not data:
            return None
        i = self.rng.randrange(len(data))
        data[i] ^= 1 << self.rng.randrange(8)
        self._rewrite(f, bytes(data))
        return f"{os.path.relpath(f, self.store)} byte {i}"

    def _truncate(self, files: list[str]):
        if not files:
            return None
        f = self.rng.choice(files)
        n = os.path.getsize(f)
        cut = self.rng.randrange(n) if n else 0
        os.truncate(f, cut)
        return f"{os.path.relpath(f, self.store)} {n} -> {cut} bytes"

    def _delete(self, files: list[str]):
        if not files:
            return None
        f = self.rng.choice(files)
        os.remove(f)
        return os.path.relpath(f, self.store)

    def _swap(self, files: list[str]):
        if len(files) < 2:
            return None
        a, b = self.rng.sample(files, 2)
        data = pathlib.Path(a).read_bytes()
        self._rewrite(b, data)
        return f"{os.path.relpath(a, self.store)} copied over {os.path.relpath(b, self.store)}"

    def _flip_data(self):
        return self._flip(self._shards())

    def _truncate_data(self):
        return self._truncate(self._shards())

    def _delete_data(self):
        return self._delete(self._shards())

    def _flip_manifest(self):
        return self._flip(self._manifests())

    def _truncate_manifest(self):
        return self._truncate(self._manifests())

    def _delete_manifest(self):
        return self._delete(self._manifests())

    def _swap_manifest(self):
        return self._swap(self._manifests())

    def _swap_data(self):
        return self._swap(self._shards())

    # -- stray and hostile files
    def _dir(self, *parts) -> str:
        d = os.path.join(self.store, *parts)
        os.makedirs(d, exist_ok=True)
        return d

    def _abi(self) -> str:
        abis = self._abis()
        return self.rng.choice(abis) if abis else "0" * 32

    def _nested_json(self):
        depth = self.rng.choice((5_000, 100_000))
        body = ("[" * depth + "]" * depth) if self.rng.random() < 0.5 else ('{"a":' * depth + "1" + "}" * depth)
        where = self.rng.choice(("manifests", "hits"))
        d = self._dir(where, self._abi())
        f = os.path.join(d, self._name() + ".json")
        pathlib.Path(f).write_text(body)
        return f"{os.path.relpath(f, self.store)} (depth {depth})"

    def _symlink_loop(self):
        variant = self.rng.choice(("self", "dir", "pair", "data"))
        abi = self._abi()
        name = self._name()
        if variant == "self":
            f = os.path.join(self._dir("manifests", abi), name + ".json")
            os.symlink(os.path.basename(f), f)
        elif variant == "dir":
            f = os.path.join(self._dir("manifests", abi), name)
            os.symlink(".", f)
        elif variant == "pair":
            d = self._dir("manifests", abi)
            f = os.path.join(d, name + "a.json")
            os.symlink(name + "b.json", f)
            os.symlink(name + "a.json", os.path.join(d, name + "b.json"))
        else:
            f = os.path.join(self._dir("data", abi), name)
            os.symlink("..", f)
        return f"{variant}: {os.path.relpath(f, self.store)}"

    def _readme_json(self):
        where = self.rng.choice((("manifests",), ("manifests", self._abi()), ("hits",)))
        f = os.path.join(self._dir(*where), "README.json")
        pathlib.Path(f).write_text(json.dumps({"note": "this store is shared by the chaos suite", "owner": "ops"}))
        return os.path.relpath(f, self.store)

    def _garbage(self):
        variant = self.rng.choice(("manifest", "empty_manifest", "data", "hits", "dir_manifest", "tmp"))
        abi, name = self._abi(), self._name()
        junk = bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(1, 600)))
        if variant == "manifest":
            f = os.path.join(self._dir("manifests", abi), name + ".json")
            pathlib.Path(f).write_bytes(junk)
        elif variant == "empty_manifest":
            f = os.path.join(self._dir("manifests", abi), name + ".json")
            open(f, "wb").close()
        elif variant == "data":
            f = os.path.join(self._dir("data", abi, name, "c"), "0")
            pathlib.Path(f).write_bytes(junk)
        elif variant == "hits":
            f = os.path.join(self._dir("hits", abi), name + ".json")
            pathlib.Path(f).write_bytes(junk)
        elif variant == "dir_manifest":
            f = self._dir("manifests", abi, name + ".json")
        else:
            f = os.path.join(self._dir("manifests", abi), name + ".json.tmp")
            pathlib.Path(f).write_bytes(junk)
        return f"{variant}: {os.path.relpath(f, self.store)}"

    def _resealed(self, mutate, forge: bool = False) -> str | None:
        """A published manifest, changed by `mutate(doc)` and resealed with a valid crc32 (what a
        writer without the store key can do), written over itself or as a new segment."""
        import zlib

        from hkv.store import manifest as mf

        files = self._manifests()
        self.rng.shuffle(files)
        for f in files:
            try:  # what a writer without the key can read: the JSON, its crc32
                doc = json.loads(pathlib.Path(f).read_bytes())
                if doc.get("checksum") != zlib.crc32(mf._canonical(doc)) or not doc.get("blocks"):
                    continue
            except Exception:  # damaged already
                continue
            what = mutate(doc)
            if what is None:
                continue
            in_place = forge or self.rng.random() < 0.5
            target = f if in_place else os.path.join(os.path.dirname(f), self._name() + ".json")
            if not in_place:
                doc["segment"] = os.path.basename(target)[:-5]
            raw = mf.seal({k: v for k, v in doc.items() if k not in ("checksum", "format", "version", "hmac")})
            if "hmac" in doc:  # a keyed manifest keeps its (now stale) HMAC: only the key can tell
                raw = raw[:-1] + b',"hmac":%s}' % json.dumps(doc["hmac"]).encode()
            self._rewrite(target, raw)
            return f"{what} ({'in place' if in_place else 'new segment'}): {os.path.relpath(target, self.store)}"
        return None

    def _huge_manifest(self):
        variant = self.rng.choice(("data_bytes", "object", "overflow", "stored_bytes"))

        def mutate(doc):
            o = doc["blocks"][0]["objects"][0]
            if variant == "data_bytes":
                doc["data_bytes"] = doc["stored_bytes"] = 1 << 50
            elif variant == "stored_bytes":
                doc["stored_bytes"] = 1 << 62
            elif variant == "object":  # an object of 2**40 bytes, inside a data_bytes that allows it
                o["shape"] = [1 << 20, 1 << 18]
                o["nbytes"] = (1 << 38) * (4 if o["dtype"] in ("float32", "int32") else 2 if "16" in o["dtype"] else 1)
                doc["data_bytes"] = o["offset"] + o["nbytes"]
            else:  # a shape whose product overflows int64 to a small number
                o["shape"] = [1 << 32, 1 << 32, 1 << 1] + [1] * max(0, len(o["shape"]) - 3)
            return variant

        return self._resealed(mutate)

    def _forged_manifest(self):
        """Two blocks' objects swapped (same names, dtypes and shapes): every crc32 still matches
        its bytes, so only a keyed manifest seal can refuse it."""

        def mutate(doc):
            bl = doc["blocks"]
            sig = lambda b: [(o["name"], o["dtype"], o["shape"]) for o in b["objects"]]
            pairs = [
                (i, j)
                for i in range(len(bl))
                for j in range(i + 1, len(bl))
                if sig(bl[i]) == sig(bl[j]) and bl[i]["objects"] != bl[j]["objects"]
            ]
            if not pairs:
                return None
            i, j = self.rng.choice(pairs)
            bl[i]["objects"], bl[j]["objects"] = bl[j]["objects"], bl[i]["objects"]
            return f"objects of blocks {bl[i]['index']} and {bl[j]['index']} swapped"

        return self._resealed(mutate, forge=True)

    def _budget_evict(self):
        """Another process (this one) opens the store with half its size as budget and enforces it.
        In a thread with a timeout: a store that hangs its opener must not hang the harness."""
        from hkv.store.tier import DiskTier

        out: dict = {}

        def run():
            try:
                kw = {"key": STORE_KEY} if self.keyed else {"key": b""} if key_supported() else {}
                tier = DiskTier(self.store, writer_id="chaos-parent", **kw)
                total = tier.stored_bytes()
                tier.budget_bytes = total // 2
                n = tier.enforce_budget()
                tier.close()
                out["what"] = f"enforce_budget({total // 2}) deleted {n} segments of {total} bytes"
            except Exception as e:  # a hostile file keeping another process off the store
                out["error"] = e

        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(timeout=90)
        if th.is_alive():
            out["error"] = TimeoutError("DiskTier open + enforce_budget did not return in 90 s")
        if "error" in out:
            e = out["error"]
            _count(self.parent_tier_errors, type(e).__name__)
            if len(self.parent_tier_error_details) < 4:
                self.parent_tier_error_details.append(f"{type(e).__name__}: {str(e)[:300]}")
            return None
        return out["what"]


# -------------------------------------------------------------------------------- the parent
def _drain(stream, q: queue.Queue | None, tail: collections.deque) -> None:
    for line in stream:
        if q is not None and line.startswith(TAG):
            q.put(json.loads(line[len(TAG) :]))
        else:
            tail.append(line)
    if q is not None:
        q.put({"event": "eof"})


class Proc:
    """A worker process, its protocol queue and the tail of its other output."""

    def __init__(self, wid: int, cfg: dict, workdir: str):
        self.wid, self.cfg = wid, cfg
        path = os.path.join(workdir, f"worker{wid}.json")
        pathlib.Path(path).write_text(json.dumps(cfg))
        env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
        env.pop("HKV_STORE_KEY", None)  # a process without key= must not pick one up
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tests.chaos.harness", "worker", path],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.q: queue.Queue = queue.Queue()
        self.tail: collections.deque = collections.deque(maxlen=60)
        for s, q in ((self.p.stdout, self.q), (self.p.stderr, None)):
            threading.Thread(target=_drain, args=(s, q, self.tail), daemon=True).start()
        self.alive = True

    def send(self, **cmd) -> None:
        try:
            self.p.stdin.write(json.dumps(cmd) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=30)
        self.alive = False

    def stderr_tail(self) -> str:
        return "".join(self.tail)[-3000:]


def key_supported() -> bool:
    from hkv.store.tier import DiskTier

    return "key" in inspect.signature(DiskTier.__init__).parameters


def verify_takes_key() -> bool:
    """Whether `hkv store verify` reads the store key (from the HKV_STORE_KEY environment variable, hex)."""
    from hkv.store import cli

    return "HKV_STORE_KEY" in inspect.getsource(cli)


def run_verify(store: str, workdir: str, keyed: bool, timeout: float = 120) -> dict:
    """`python -m hkv store verify --json STORE` in a child (a hang or a crash is a result)."""
    cmd = [sys.executable, "-m", "hkv", "store", "verify", "--json", store]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("HKV_STORE_KEY", None)
    if keyed:
        if not verify_takes_key():
            return {"skipped": "hkv store verify reads no store key (HKV_STORE_KEY)"}
        env["HKV_STORE_KEY"] = STORE_KEY.hex()
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            cmd,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE,) * 2),
        )
    except subprocess.TimeoutExpired:
        return {"exit_code": None, "timed_out": True, "traceback": False, "seconds": timeout}
    out = {
        "exit_code": r.returncode,
        "timed_out": False,
        "traceback": "Traceback" in r.stderr,
        "seconds": round(time.monotonic() - t0, 1),
        "stderr": r.stderr[-1500:],
    }
    try:
        rep = json.loads(r.stdout)
        out["summary"] = {
            k: v for k, v in rep.items() if isinstance(v, int) and not isinstance(v, bool) and k != "exit_code"
        }
        out["problems"] = len(rep.get("problems", []))
    except (json.JSONDecodeError, TypeError):
        out["summary"] = None
    return out


class Parent:
    def __init__(self, cfg: ChaosConfig, workdir: str, say=None):
        self.cfg = cfg
        self.workdir = workdir
        self.store = os.path.join(workdir, "store")
        os.makedirs(self.store, exist_ok=True)
        self.rng = random.Random(cfg.seed)
        self.say = say or (lambda msg: None)
        self.procs: dict[int, Proc] = {}
        self.faults = StoreFaults(self.store, random.Random(cfg.seed + 1), cfg.key)
        self.process_faults: dict[str, int] = {}
        self.failures: list[str] = []
        self.save_points: list[dict] = []
        self.summaries: dict[int, dict] = {}
        self.key_skipped = None
        self.saved: set[int] = set()  # workers with a whole checkpoint (a restart restores it)
        self._deck: list[str] = []

    # --------------------------------------------------------------------- processes
    def _worker_cfg(self, wid: int, restore: str | None = None) -> dict:
        alien = self.cfg.alien and wid == self.cfg.workers
        return {
            "wid": wid,
            "seed": self.cfg.seed,
            "chat_id": 0 if alien else wid,
            "weights_seed": 1 if alien else 0,
            "store": self.store,
            "key": self.cfg.key,
            "compile_cache": COMPILE_CACHE,
            "state_path": os.path.join(self.workdir, f"state{wid}.json"),
            "ckpt": os.path.join(self.workdir, f"ckpt{wid}"),
            "restore": restore,
            "budget_bytes": self.cfg.budget_bytes if wid == 0 else None,
            "warmup": restore is None,
            "corrupt_truth": self.cfg.corrupt_truth and wid == 0,
            "message_tokens": list(self.cfg.message_tokens),
        }

    def _wait(self, pr: Proc, want: str, timeout: float, on_op=None) -> dict | None:
        """The next event `want` of `pr` (op events go to `on_op`); None if it died or timed out."""
        end = time.monotonic() + timeout
        while True:
            try:
                ev = pr.q.get(timeout=max(0.01, min(1.0, end - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > end:
                    self.failures.append(
                        f"stuck: worker {pr.wid} gave no '{want}' within {timeout:.0f} s\n{pr.stderr_tail()}"
                    )
                    pr.kill()
                    return None
                continue
            if ev["event"] == "eof":
                pr.p.wait(timeout=30)
                if pr.alive:
                    self.failures.append(
                        f"worker {pr.wid} exited (rc {pr.p.returncode}) waiting for '{want}':\n{pr.stderr_tail()}"
                    )
                pr.alive = False
                return None
            if ev["event"] == "op" and on_op is not None:
                on_op(ev)
                continue
            if ev["event"] == want or (want == "done" and ev["event"] == "summary"):
                return ev
            if ev["event"] == "writing":
                pr.writing = True

    def _start(self, wid: int, restore: str | None = None) -> Proc | None:
        pr = Proc(wid, self._worker_cfg(wid, restore), self.workdir)
        pr.writing = False
        self.procs[wid] = pr
        return pr

    def start_all(self) -> None:
        n = self.cfg.workers + (1 if self.cfg.alien else 0)
        for pr in [self._start(w) for w in range(n)]:
            ev = self._wait(pr, "ready", self.cfg.start_timeout)
            if ev is not None:
                self.say(f"worker {pr.wid} ready in {ev.get('seconds')} s (init {ev.get('init')} s)")

    def live(self) -> list[Proc]:
        return [p for p in self.procs.values() if p.alive]

    # -------------------------------------------------------------------------- a turn
    def _actions(self, wid: int) -> dict:
        c, r = self.cfg, self.rng
        a = {
            "evict": r.random() < c.evict_rate,
            "disk_full": r.random() < c.disk_full_rate,
            "branch": r.random() < c.branch_rate,
            "interrupt": None,
        }
        if r.random() < c.interrupt_rate:
            a["interrupt"] = (
                {"mode": "progress", "at": r.randint(1, 4)}
                if r.random() < 0.6
                else {"mode": "signal", "delay": round(r.uniform(0.001, 0.25), 3)}
            )
        return a

    def turn(self, t: int) -> None:
        c = self.cfg
        procs = self.live()
        for pr in procs:
            pr.writing = False
            pr.send(cmd="turn", t=t, actions=self._actions(pr.wid))
        # store faults at random moments while the turn runs: int(rate), plus one with the fraction
        n_faults = int(c.fault_rate) + (self.rng.random() < c.fault_rate - int(c.fault_rate))
        kinds = list(c.store_faults) + (list(KEYED_FAULTS) if c.key else [])
        schedule = sorted((self.rng.uniform(0.0, 1.5), self._next_kind(kinds)) for _ in range(n_faults))
        kill = None
        if c.alien and c.kill_alien_turn == t and c.workers in self.procs and self.procs[c.workers].alive:
            kill = (self.procs[c.workers], False)
        if t in c.kill_writer_turns and 0 in self.procs and self.procs[0].alive:
            kill = (self.procs[0], True)
        kill_delay = self.rng.uniform(0.0, 0.03)
        t0 = time.monotonic()
        pending = {pr.wid: pr for pr in procs}
        end = t0 + c.turn_timeout
        respawn = []
        while pending:
            now = time.monotonic() - t0
            while schedule and schedule[0][0] <= now:
                _, kind = schedule.pop(0)
                self._inject(kind, kinds)
            if kill is not None and kill[0].wid in pending:
                pr = kill[0]
                self._pump(pr)
                if pr.writing is None:  # it finished without writing: no kill this turn
                    kill = None
                elif pr.writing:
                    time.sleep(kill_delay)
                    pr.kill()
                    _count(self.process_faults, "kill_writer" if kill[1] else "kill_alien")
                    self.say(f"turn {t}: SIGKILL worker {pr.wid} while it writes to the store")
                    del pending[pr.wid]
                    if kill[1]:
                        respawn.append(pr.wid)
                    kill = None
                    continue
            for wid, pr in list(pending.items()):
                if kill is not None and kill[0] is pr:
                    continue
                ev = self._poll(pr)
                if ev is not None:
                    del pending[wid]
            if time.monotonic() > end:
                for wid, pr in pending.items():
                    self.failures.append(
                        f"stuck: worker {wid} did not finish turn {t} in {c.turn_timeout:.0f} s\n{pr.stderr_tail()}"
                    )
                    pr.kill()
                break
            time.sleep(0.005)
        for _, kind in schedule:  # the turn ended before these moments: inject them now
            self._inject(kind, kinds)
        for wid in respawn:
            self._respawn(wid, t)

    def _next_kind(self, kinds: list[str]) -> str:
        """Kinds are dealt like cards: every kind once, in a random order, then again (a run with as
        many faults as kinds injects each of them)."""
        if not self._deck:
            self._deck = list(kinds)
            self.rng.shuffle(self._deck)
        return self._deck.pop()

    def _inject(self, kind: str, kinds: list[str]) -> None:
        """One store fault of `kind`, or (no target for it now) of up to three other kinds."""
        for k in [kind] + [self.faults.rng.choice(kinds) for _ in range(3)]:  # not self.rng: it stays in step
            if self.faults.inject(k):
                return

    def _pump(self, pr: Proc) -> None:
        """Consume `pr`'s events up to the first 'writing' (sets pr.writing)."""
        while not pr.writing:
            try:
                ev = pr.q.get_nowait()
            except queue.Empty:
                return
            if ev["event"] == "writing":
                pr.writing = True
            elif ev["event"] in ("done", "eof"):
                pr.q.put(ev)  # it finished (or died) before writing: leave it for _poll
                pr.writing = None
                return

    def _poll(self, pr: Proc) -> dict | None:
        try:
            ev = pr.q.get_nowait()
        except queue.Empty:
            return None
        if ev["event"] == "done":
            return ev
        if ev["event"] == "eof":
            pr.p.wait(timeout=30)
            if pr.alive:
                self.failures.append(
                    f"worker {pr.wid} exited (rc {pr.p.returncode}) during a turn:\n{pr.stderr_tail()}"
                )
            pr.alive = False
            return ev
        return None  # writing / other progress events

    def _respawn(self, wid: int, t: int) -> None:
        # restarted from its checkpoint if it saved one (gone after a kill: a failure), else cold
        ckpt = os.path.join(self.workdir, f"ckpt{wid}") if wid in self.saved else None
        pr = self._start(wid, restore=ckpt)
        self._wait(pr, "ready", self.cfg.start_timeout)
        if pr.alive:  # redo the turn it was killed in (its state file holds the turns it finished)
            pr.send(cmd="turn", t=t, actions={"evict": False, "disk_full": False, "branch": False, "interrupt": None})
            self._wait(pr, "done", self.cfg.turn_timeout)

    # -------------------------------------------------------------------------- saves
    def _checkpoint_state(self, path: str) -> str:
        """'ok' if `path` holds a whole engine checkpoint (what a restore after a kill here finds)."""
        from hkv.engine.checkpoint import read_metadata

        try:
            read_metadata(path)
        except Exception as e:
            return f"{type(e).__name__}: {str(e)[:200]}"
        return "ok"

    def save(self, wid: int, kill: bool, restart: bool = True) -> None:
        pr = self.procs.get(wid)
        if pr is None or not pr.alive:
            return
        ckpt = os.path.join(self.workdir, f"ckpt{wid}")
        if not kill:
            pr.send(cmd="save")
            self._wait(pr, "done", self.cfg.turn_timeout)
            if self._checkpoint_state(ckpt) == "ok":
                self.saved.add(wid)
            return
        had = self._checkpoint_state(ckpt) == "ok"
        points: list[tuple[int, str, str]] = []
        target = self.rng.randint(1, 8)
        killed = []

        def on_op(ev):
            state = self._checkpoint_state(ckpt)
            points.append((ev["n"], ev["op"], state))
            if had and state != "ok":
                self.failures.append(
                    f"checkpoint lost: a SIGKILL of worker {wid} after op {ev['n']} of "
                    f"save(overwrite=True) ({ev['op']} {ev['args']}) leaves {ckpt}: {state}"
                )
            if ev["n"] >= target and not killed:
                pr.kill()
                killed.append(ev["n"])
            else:
                pr.send(cmd="continue")

        _count(self.process_faults, "kill_saving")
        pr.send(cmd="save", pause=True)
        ev = self._wait(pr, "done", self.cfg.turn_timeout, on_op=on_op)
        if ev is not None:  # the save had fewer operations than the kill point: kill it now, idle
            pr.kill()
            killed.append("after save")
        self.save_points.append(
            {
                "worker": wid,
                "had_checkpoint": had,
                "killed_after_op": killed[0] if killed else None,
                "ops": [f"{n}:{op}:{'ok' if s == 'ok' else 'LOST'}" for n, op, s in points],
            }
        )
        self.say(
            f"save of worker {wid}: killed after op {killed[0] if killed else None} of {len(points)}; "
            f"checkpoint at each op: {[s == 'ok' for _, _, s in points]}"
        )
        if restart:  # from the checkpoint it had before this save (old or new must be there)
            new = self._start(wid, restore=ckpt if had else None)
            self._wait(new, "ready", self.cfg.start_timeout)

    # ---------------------------------------------------------------------------- run
    def run(self) -> dict:
        c = self.cfg
        t_start = time.monotonic()
        if c.key and not key_supported():
            self.key_skipped = "hkv.DiskTier does not accept key= (HMAC support not there yet)"
            return {"skipped": self.key_skipped}
        try:
            self.start_all()
            self.say(f"{len(self.live())} workers ready after {time.monotonic() - t_start:.1f} s")
            t = 0
            turns_start = time.monotonic()
            save_worker = 1 if c.workers > 1 else 0
            while t < c.turns or (c.duration is not None and time.monotonic() - turns_start < c.duration):
                if not self.live():
                    break
                t1 = time.monotonic()
                self.turn(t)
                # saves after the turn: a clean one first (a checkpoint to lose), then the killed one
                if any(k == t + 1 for k in c.save_kill_turns) or (c.save_every and (t + 1) % c.save_every == 0):
                    for pr in self.live():
                        if pr.wid == save_worker or c.save_every:
                            self.save(pr.wid, kill=False)
                if t in c.save_kill_turns:
                    self.save(save_worker, kill=True)
                self.say(
                    f"turn {t}: {time.monotonic() - t1:.1f} s, store faults so far {sum(self.faults.counts.values())}"
                )
                t += 1
            for pr in self.live():
                pr.send(cmd="quiesce")
            for pr in self.live():
                self._wait(pr, "done", c.turn_timeout)
            for pr in self.live():
                pr.send(cmd="final")
            for pr in self.live():
                ev = self._wait(pr, "summary", c.turn_timeout)
                if ev is not None:
                    self.summaries[pr.wid] = ev["counts"]
            if c.final_save_kill and 0 in self.procs and self.procs[0].alive:
                # after the final checks: a clean save (a checkpoint to lose), then one SIGKILLed inside
                # save(overwrite=True); the checkpoint is checked at every pause (no restart)
                self.save(0, kill=False)
                self.save(0, kill=True, restart=False)
            for pr in self.live():
                pr.send(cmd="exit")
                try:
                    pr.p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.failures.append(f"stuck: worker {pr.wid} did not exit")
                pr.alive = False
            # every process's counts: its state file, written after each command (a killed process's
            # holds what it finished)
            for wid in self.procs:
                sp = os.path.join(self.workdir, f"state{wid}.json")
                if os.path.exists(sp):
                    self.summaries[wid] = json.loads(pathlib.Path(sp).read_text())["counts"]
            verify = run_verify(self.store, self.workdir, c.key)
        finally:
            for pr in self.procs.values():
                if pr.p.poll() is None:
                    pr.p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    pr.p.wait(timeout=30)
        return self.report(verify, time.monotonic() - t_start, turns=t)

    def report(self, verify: dict, seconds: float, turns: int) -> dict:
        agg = _new_counts()
        agg.pop("final")
        finals = {}
        for wid, s in sorted(self.summaries.items()):
            for k, v in s.items():
                if k == "final":
                    finals[wid] = v
                elif isinstance(v, (int, list)):
                    agg[k] += v
                elif isinstance(v, dict):
                    for kk, vv in v.items():
                        _count(agg[k], kk, vv)
        faults = dict(self.faults.counts)
        for k, v in self.process_faults.items():
            _count(faults, k, v)
        for k, v in agg.pop("worker_faults").items():
            _count(faults, k, v)
        if self.cfg.alien:
            _count(faults, "foreign_weights")
        rep = {
            "seconds": round(seconds, 1),
            "rounds": turns,
            "processes": len(self.procs),
            "key": self.cfg.key,
            **agg,
            "faults": dict(sorted(faults.items())),
            "faults_skipped": self.faults.skipped,
            "fault_log": self.faults.log,
            "parent_tier_errors": self.faults.parent_tier_errors,
            "parent_tier_error_details": self.faults.parent_tier_error_details,
            "save_points": self.save_points,
            "final": finals,
            "verify": verify,
            "harness_failures": list(self.failures),
        }
        rep["failures"] = judge(rep, expected_workers=sorted(self.procs))
        return rep


def judge(rep: dict, expected_workers: list[int]) -> list[str]:
    """Every way the run broke issue 11's promise, as readable lines (empty: it held)."""
    f = list(rep["harness_failures"])
    if rep["wrong_tokens"]:
        f.append(f"{rep['wrong_tokens']} wrong tokens: {rep['wrong'][:3]}")
    if rep["exceptions"]:
        first = [next((d for d in rep["exception_details"] if f": {t}: " in d), "") for t in rep["exceptions"]]
        f.append(f"unexpected exceptions {rep['exceptions']}: " + " | ".join(d for d in first if d))
    if rep["interrupt_damage"]:
        f.append(f"engine unusable after an interrupt/exception: {rep['interrupt_damage']}")
    if rep["tier_errors"] or rep["tier_open_failures"] or rep["parent_tier_errors"]:
        f.append(
            f"the disk tier raised (a store fault must be a miss with a reason): in engines "
            f"{rep['tier_errors']}, opening {rep['tier_open_failures']}, in another process "
            f"{rep['parent_tier_errors']}: "
            + " | ".join(rep["tier_error_details"][:2] + rep["parent_tier_error_details"][:1])
        )
    if rep["restores"]["failed"]:
        f.append(
            f"{rep['restores']['failed']} restores from a checkpoint failed after a SIGKILL: "
            f"{rep['restore_errors'][:2]}"
        )
    from hkv.store.tier import DISK_REASONS as disk_reasons

    unknown = set(rep["plan_reasons"]) - known_reasons() - {"None"}
    if unknown:
        f.append(f"plan reasons outside the documented set: {sorted(unknown)}")
    for wid in expected_workers:
        fin = rep["final"].get(wid)
        if fin is None:
            continue  # killed for good (the alien) or already reported as a harness failure
        if not fin.get("exact"):
            f.append(f"worker {wid}: final generate after the faults not exact / failed")
        if fin.get("tier_ok") is False:
            f.append(
                f"worker {wid}: after the faults the disk tier does not serve the blocks this process just "
                f"wrote: {fin.get('tier_read')}"
            )
        if (fin.get("disk_plan") or {}).get("reason") in disk_reasons:
            f.append(f"worker {wid}: the engine refused blocks just written to the store: {fin['disk_plan']}")
        if fin.get("health_after"):
            f.append(f"worker {wid}: engine not idle after the final generate: {fin['health_after']}")
    v = rep["verify"]
    if "skipped" not in v:
        if v.get("timed_out"):
            f.append("hkv store verify timed out")
        elif v.get("exit_code") not in (0, 1) or v.get("traceback"):
            f.append(
                f"hkv store verify exit {v.get('exit_code')} (must be 0 or 1, no traceback): "
                f"{v.get('stderr', '')[-600:]}"
            )
    return f


def run_chaos(cfg: ChaosConfig, workdir: str, say=None) -> dict:
    return Parent(cfg, workdir, say).run()


# ------------------------------------------------------------------------------------ output
def format_report(rep: dict) -> str:
    if "skipped" in rep:
        return f"skipped: {rep['skipped']}"
    lines = [
        f"processes            {rep['processes']} ({rep['rounds']} rounds, {rep['turns']} turns, "
        f"{rep['seconds']} s, store key {'on' if rep['key'] else 'off'})",
        f"generations          {rep['generations']}",
        f"tokens checked       {rep['tokens_checked']}",
        f"wrong tokens         {rep['wrong_tokens']}",
        f"faults injected      {sum(rep['faults'].values())}",
    ]
    lines += [f"  {k:<22} {v}" for k, v in rep["faults"].items()]
    if rep["faults_skipped"]:
        lines.append(f"  (no target for {sum(rep['faults_skipped'].values())}: {rep['faults_skipped']})")
    reasons = {k: v for k, v in rep["plan_reasons"].items() if k != "None"}
    lines.append(
        f"plans                {rep['generations']} ({rep['disk_plans']} from disk, "
        f"{rep['disk_tokens']} tokens; {rep['restored_tokens']} restored in all)"
    )
    lines.append("rejections/misses    " + (", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "none"))
    lines.append(f"interrupts           {rep['interrupts']}")
    lines.append(
        f"write failures       {rep['write_failures']} (full disk turns {rep['disk_full_turns']}), "
        f"dropped {rep['writes_dropped']}"
    )
    lines.append(f"checkpoints          saves {rep['saves']}, restores {rep['restores']}")
    for sp in rep["save_points"]:
        lines.append(
            f"  kill during save     worker {sp['worker']}: killed after op {sp['killed_after_op']}; "
            f"checkpoint at each op {sp['ops']}"
        )
    lines.append(
        "final checks         "
        + (
            "; ".join(
                f"worker {w}: exact {f.get('exact')}, store serves new blocks {f.get('tier_ok')}, "
                f"restored from disk {f.get('disk_restore')}"
                for w, f in sorted(rep["final"].items())
                if f
            )
            or "none"
        )
    )
    lines.append("exceptions           " + (", ".join(f"{k} {v}" for k, v in rep["exceptions"].items()) or "none"))
    if rep["interrupt_damage"]:
        lines.append(f"engine damage        {rep['interrupt_damage']}")
    if rep["tier_errors"] or rep["tier_open_failures"] or rep["parent_tier_errors"]:
        lines.append(
            f"disk tier raised     {rep['tier_errors']} open {rep['tier_open_failures']} "
            f"other process {rep['parent_tier_errors']}"
        )
    if rep["capacity_refusals"]:
        lines.append(f"capacity refusals    {rep['capacity_refusals']}")
    v = rep["verify"]
    if "skipped" in v:
        lines.append(f"verify               skipped: {v['skipped']}")
    else:
        lines.append(
            f"verify               exit {v.get('exit_code')}{' TIMEOUT' if v.get('timed_out') else ''}"
            f"{' TRACEBACK' if v.get('traceback') else ''} {v.get('summary')}"
        )
    lines.append(f"failures             {len(rep['failures'])}")
    lines += ["  - " + x.replace("\n", "\n    ")[:1500] for x in rep["failures"]]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        worker_entry(sys.argv[2])
    else:
        sys.exit("usage: python -m tests.chaos.harness worker CONFIG.json (see benchmarks/chaos.py)")
