"""Many hosts: processes joined into one JAX cluster (`jax.distributed.initialize`, CPU devices, gloo
collectives), one `hkv.Engine` each, all sharing one prefix store (`hkv.DiskTier` on one directory).

Why one engine per host and not one engine over a global mesh: README "Many hosts". N hosts
(processes 0 .. N-1; process 0 runs the coordination service; N = 2 here, 3 under `make test-slow`)
run these phases, separated by collective barriers (`sync_global_devices`) while all are alive:

a. every host writes at once: one prompt all of them serve (the same block keys, N copies) and one
   of its own; then every host serves the other hosts' prompts, restored from disk.
b. host 0 serves a long prompt and moves its blocks to the store; the other hosts (no device record
   of it) serve the prompt with a new suffix: their plans restore every block from disk.
c. host 0 swaps in a tier with a small byte budget and keeps writing new prompts (each publish evicts
   whole segments, other hosts' included) while the other hosts keep restoring every prompt.
d. the last host publishes one segment of a prompt, then is killed with SIGKILL (by the parent)
   after the data of its second segment is committed and before that segment's manifest is
   published; the others carry on (the cluster runs with `jax_enable_recoverability`) and restore
   exactly the published part; `verify` finds no bad block, only the dead host's orphaned data.

Zero wrong tokens: every generation of every host equals the stateless greedy oracle (tokens and
logits), computed by the parent. Every miss has its reason: a plan that restored fewer tokens than
its hash match found names why. Children are this module run as `python -m tests.hkv.engine.test_multihost
host ...`; each writes its results to a JSON file after every phase (a killed host's file keeps what
it finished). The coordinator and gloo listen on 127.0.0.1 only.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODULE = "tests.hkv.engine.test_multihost"  # children run this module
CUT = 80  # phase d: the victim publishes blocks [0, CUT) of its prompt, then dies publishing the rest
BUDGET_SEGMENTS = 2  # phase c: the evicting host's budget, in segments of its own prompts
EVICTOR_PROMPTS = 4
DEADLINE = 240  # seconds: a child still running then is killed (it stops by itself well before)


# ------------------------------------------------------------------------------ shared prompts
def _tokens(name: str, n: int) -> list[int]:
    from .test_prefix import CFG

    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, n).tolist()


def _query(base: list[int], k: int, tag: str) -> list[int]:
    """base's first k tokens, then 5 of `tag`'s that differ from base right at position k."""
    from .test_prefix import CFG

    rest = _tokens(tag, 5)
    if k < len(base) and rest[0] == base[k]:
        rest[0] = (rest[0] + 1) % CFG.vocab_size
    return base[:k] + rest


def _prompts(hosts: int) -> dict[str, list[int]]:
    """Every prompt the hosts write, by name."""
    # at most 8 blocks each: every restore from disk uses one `swap_in` program (fewer compilations)
    out = {"A": _tokens("A", 140), "S": _tokens("S", 130), "D": _tokens("D", 136)}
    out.update({f"P{h}": _tokens(f"P{h}", 100 + 8 * h) for h in range(hosts)})
    out.update({f"E{j}": _tokens(f"E{j}", 100) for j in range(EVICTOR_PROMPTS)})
    out.update({f"K{j}": _tokens(f"K{j}", 100) for j in range(2)})  # the victim's last writes (random kill)
    return out


def _block_end(n: int) -> int:
    from .test_prefix import BT

    return n // BT * BT


def queries(hosts: int) -> dict[str, list[int]]:
    """Every prompt a host serves, by name: the written prompts, and each written prompt's full
    blocks followed by a new suffix per host ("<name>+q<host>")."""
    p = _prompts(hosts)
    out = {"A": p["A"], "D/first": p["D"][: CUT + 1], "D": p["D"]}
    out.update({f"S@{h}": p["S"] for h in range(hosts)} | {f"P{h}": p[f"P{h}"] for h in range(hosts)})
    out.update({f"E{j}": p[f"E{j}"] for j in range(EVICTOR_PROMPTS)})
    # the random-kill victim's last writes (a victim that got to them before its kill raised KeyError)
    out.update({f"K{j}": p[f"K{j}"] for j in range(2)})
    for name, base in p.items():
        for h in range(hosts):
            out[f"{name}+q{h}"] = _query(base, _block_end(len(base)), f"{name}+q{h}")
    return out


# ---------------------------------------------------------------------------------- the host
class _PauseBeforeNextPublish:
    """A kvstore proxy: the next manifest write announces itself (a marker file) and hangs, so the
    parent can kill the process with its segment's data committed and its manifest unpublished."""

    def __init__(self, kv, marker: str):
        self._kv, self._marker = kv, marker

    def __getattr__(self, name):
        return getattr(self._kv, name)

    def __truediv__(self, other):
        return self._kv / other

    def write(self, k, *a, **kw):
        if k.startswith("manifests/"):
            open(self._marker, "w").close()
            time.sleep(DEADLINE)
        return self._kv.write(k, *a, **kw)


def _wait_for(path: str, timeout: float = DEADLINE / 2) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"no {path} after {timeout} s")
        time.sleep(0.01)


def _forget_device(engine) -> None:
    """Evict every prefix record from device memory WITHOUT writing to the store (a pure reader).
    Uses the engine's private evict transition, as tests/hkv/engine/test_disk.py does: the public
    `evict_prefixes` would first write the blocks the store lacks (those another host evicted)."""
    import jax.numpy as jnp

    every = jnp.ones((engine.layout.config.prefix_records,), bool)
    engine.cache = engine.steps.evict(engine.layout, engine.cache, every, every, every)


def _serve(engine, names: list[str], phase: str, out: dict) -> None:
    """Generate each named query (one call: they run side by side) and record tokens, logits, plan."""
    from .test_prefix import NEW

    q = queries(out["hosts"])
    # The restore cost model times disk reads; on this tiny model a read can cost more than
    # recomputing, after which the engine would recompute instead of restoring. Forget the measured
    # disk cost (a private attribute) so every plan takes the disk route the test is about.
    engine.prefix_manager.costs.disk_token = None
    t = time.monotonic()
    gens = engine.generate([q[n] for n in names], NEW, return_logits=True)
    out["notes"].setdefault("serve_seconds", []).append([phase, names, round(time.monotonic() - t, 2)])
    for n, g in zip(names, gens, strict=True):
        p = g.plan
        out["gens"].append(
            {
                "phase": phase,
                "query": n,
                "tokens": list(map(int, g.tokens)),
                "logits": np.asarray(g.logits, np.float64).round(6).tolist(),
                "plan": {
                    "prompt_tokens": p.prompt_tokens,
                    "hash_hit_tokens": p.hash_hit_tokens,
                    "restored_tokens": p.restored_tokens,
                    "disk_tokens": list(p.disk_tokens) if p.disk_tokens else None,
                    "first_failed_stage": p.first_failed_stage,
                    "reason": None if p.reason is None else str(p.reason),
                },
            }
        )


def _write(engine, names: list[str], phase: str, out: dict) -> int:
    """Serve the named prompts, then move every cached block of this host to the store."""
    _serve(engine, names, phase, out)
    n = engine.evict_prefixes()
    engine.flush_disk()
    return n


def _host(port: str, work: str, hosts: str, pid: str, kill: str) -> None:
    """One host (process `pid` of `hosts`): join the cluster, build the engine, run phases a-d. kill:
    "pause" (the victim hangs before publishing its second segment of D, where the parent kills it)
    or "random" (the victim writes D's rest and then K0, K1 in small shards; the parent kills it at a
    random moment after it starts)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A dead task must not take the others down: without this the coordination service turns one
    # host's death into a fatal error in every other host (see README "Many hosts").
    jax.config.update("jax_enable_recoverability", True)
    n, i = int(hosts), int(pid)
    victim, survivors = n - 1, list(range(n - 1))
    out: dict = {"host": i, "hosts": n, "errors": [], "gens": [], "phases": [], "notes": {}, "seconds": {}}
    out["seconds"]["imported"] = round(time.monotonic() - T0, 2)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        coordinator_bind_address=f"127.0.0.1:{port}",
        num_processes=n,
        process_id=i,
        initialization_timeout=DEADLINE // 2,
    )
    from jax._src import distributed
    from jax.experimental import multihost_utils as mu

    import hkv
    from models.deepseek_v4 import init

    from .test_prefix import CFG, make_engine

    result_path = os.path.join(work, f"host{i}.json")

    def done(phase: str) -> None:
        out["phases"].append(phase)
        out["seconds"][phase] = round(time.monotonic() - T0, 2)
        with open(result_path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(result_path + ".tmp", result_path)

    def barrier(name: str) -> None:
        t = time.monotonic()
        mu.sync_global_devices(name)  # a collective over every process's devices
        out["notes"].setdefault("barrier_seconds", []).append([name, round(time.monotonic() - t, 2)])

    try:
        out["seconds"]["joined"] = round(time.monotonic() - T0, 2)
        gathered = mu.process_allgather(np.array([jax.process_index()], np.int32))
        out["cluster"] = {
            "process_count": jax.process_count(),
            "process_index": jax.process_index(),
            "allgather": np.asarray(gathered).reshape(-1).tolist(),
            "devices": len(jax.devices()),
            "local_devices": len(jax.local_devices()),
        }
        store = os.path.join(work, "store")
        model = init(CFG, seed=3)  # every host: the same weights, so the same ABI fingerprint
        # restore_choice="longest": these phases check that every stored block is read from disk. With
        # the default ("cheapest": measured prefill seconds per chunk against disk seconds per token)
        # this tiny model's prefill is cheap enough that a host sometimes estimated recomputing the
        # other host's 96-token prefix cheaper than reading it: 1 run in 3-5 failed that way.
        engine = make_engine(
            model, disk=hkv.DiskTier(store, writer_id=f"host{jax.process_index()}"), restore_choice="longest"
        )
        out["notes"]["abi"] = engine.spec.fingerprint()
        done("ready")

        # a. everyone writes at once (one shared prompt, one own), then serves the others' prompts
        barrier("a-go")
        _write(engine, [f"S@{i}", f"P{i}"], "a-write", out)
        barrier("a-written")
        # The others published before the barrier, but this host's view of their manifests may be up
        # to `refresh_seconds` (0.5 s) old: a host that knows others wrote refreshes.
        engine.disk.refresh(force=True)
        if i == 0:
            out["notes"]["a_writers"] = sorted({m["writer"] for m in _manifests(store)})
        _serve(engine, [f"S+q{i}", *(f"P{h}+q{i}" for h in range(n) if h != i)], "a", out)
        done("a")

        # b. host 0 writes a long prompt, the others restore it
        if i == 0:
            out["notes"]["b_evicted"] = _write(engine, ["A"], "b-write", out)
        barrier("b-written")
        engine.disk.refresh(force=True)  # (as after "a-written")
        if i != 0:
            _serve(engine, [f"A+q{i}"], "b", out)
        done("b")

        # c. host 0 writes over a small budget (evicting any host's segments); the others read on
        barrier("c-go")
        c_done = os.path.join(work, "c-done")
        if i == 0:
            budget = BUDGET_SEGMENTS * max(m["stored_bytes"] for m in _manifests(store))
            engine.disk = hkv.DiskTier(store, budget_bytes=budget, writer_id="host0-budget", refresh_seconds=0)
            for j in range(EVICTOR_PROMPTS):
                _write(engine, [f"E{j}"], "c-write", out)
            out["notes"]["c_budget"] = budget
            out["notes"]["c_evicted"] = engine.disk.counters["segments_evicted"]
            open(c_done, "w").close()
        else:
            engine.disk.refresh_seconds = 0  # see every eviction at once
            names = [f"{p}+q{i}" for p in _prompts(n) if p[0] in "ASPE"]
            passes, last = 0, False
            while not last:  # until the evicting host is done, then one more pass
                last = os.path.exists(c_done)
                for name in names:
                    _forget_device(engine)
                    _serve(engine, [name], "c", out)
                passes += 1
            out["notes"]["c_passes"] = passes
        out["notes"]["compilations"] = engine.compilations
        done("c")

        # d. the victim dies mid-write; the survivors restore what it published
        barrier("d-go")
        if i == victim:
            _write(engine, ["D/first"], "d-write", out)  # blocks [0, CUT): one published segment
            done("d-first")
            if kill == "pause":
                engine.disk.kv = _PauseBeforeNextPublish(engine.disk.kv, os.path.join(work, "d-paused"))
                _write(engine, ["D"], "d-write", out)  # restores [0, CUT) from disk, writes the rest: hangs
                raise AssertionError("the victim's second publish returned: it should have been killed there")
            engine.flush_disk()
            # small shards: each segment is several files, so a kill can fall between any two of them
            engine.disk = hkv.DiskTier(store, writer_id=f"host{i}-last", chunk_bytes=4096, shard_bytes=4096)
            open(os.path.join(work, "d-paused"), "w").close()  # the parent kills at a random moment now
            for name in ("D", "K0", "K1"):
                _write(engine, [name], "d-write", out)
            time.sleep(DEADLINE)  # finished before the kill: wait for it
        _wait_for(os.path.join(work, "d-killed"))
        _forget_device(engine)
        _serve(engine, [f"D+q{i}"] + ([f"K0+q{i}", f"K1+q{i}"] if kill == "random" else []), "d", out)
        if i == 0:
            tier = hkv.DiskTier(store)
            out["notes"]["d_verify"] = tier.verify()
            tier.close()
        engine.close()
        # With recoverable tasks the shutdown barrier no longer waits for everyone: synchronize the
        # survivors explicitly, and let the coordinator (process 0) go last (a task that shuts down
        # after the coordination service is gone is terminated).
        distributed.global_state.client.wait_at_barrier("end", DEADLINE * 1000 // 2, survivors)
        if i != 0:
            jax.distributed.shutdown()
            open(os.path.join(work, f"host{i}.shutdown"), "w").close()
        else:
            for h in survivors[1:]:
                _wait_for(os.path.join(work, f"host{h}.shutdown"))
        done("d")
    except BaseException:  # reported to the parent (which fails the test), then re-raised
        out["errors"].append(traceback.format_exc())
        done("error")
        raise


def _manifests(store: str) -> list[dict]:
    root = os.path.join(store, "manifests")
    return [
        json.loads(_read(os.path.join(root, abi, name)))
        for abi in sorted(os.listdir(root))
        for name in sorted(os.listdir(os.path.join(root, abi)))
        if name.endswith(".json")
    ]


ROLES = {"host": _host}
T0 = time.monotonic()


# ------------------------------------------------------------------------------ parent side
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    import jax

    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    cache = jax.config.jax_compilation_cache_dir  # the test session's (tests/conftest.py): shared
    if cache:
        env["HKV_COMPILATION_CACHE"] = str(cache)
    return env


def run_cluster(work: str, hosts: int, kill: str = "pause") -> dict:
    """Run `hosts` processes through phases a-d, killing the last one in phase d (kill: "pause" or
    "random", see `_host`). Returns {"kill", "delay": seconds before a random kill, "hosts":
    {i: its result file}, "rc": {i: exit code}, "work", "oracle": {query: (tokens, logits)},
    "seconds": wall time, "log": i -> the tail of host i's output}."""
    port, env, t0 = _free_port(), _env(), time.monotonic()
    victim = hosts - 1
    procs = {}
    for i in range(hosts):
        with open(os.path.join(work, f"host{i}.log"), "w") as log:  # the child keeps its own descriptor
            procs[i] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.hkv.engine.test_multihost",
                    "host",
                    str(port),
                    work,
                    str(hosts),
                    str(i),
                    kill,
                ],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    try:
        oracle = _oracle(hosts)  # computed here while the hosts run
        paused, end = os.path.join(work, "d-paused"), time.monotonic() + DEADLINE
        while not os.path.exists(paused) and time.monotonic() < end:
            if any(p.poll() is not None for p in procs.values()):  # a host failed: stop waiting
                break
            time.sleep(0.02)
        delay = random.uniform(0.0, 0.4) if kill == "random" else 0.0
        if os.path.exists(paused):
            time.sleep(delay)
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs[victim].wait(timeout=max(1.0, end - time.monotonic()))
            open(os.path.join(work, "d-killed"), "w").close()
            for p in procs.values():
                p.wait(timeout=max(1.0, end - time.monotonic()))
        # else a host failed (the others may wait at a barrier for it) or the deadline passed: the
        # rest are killed below, and the checks report each host's log
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return {
        "kill": kill,
        "delay": delay,
        "hosts": {i: _read_json(os.path.join(work, f"host{i}.json")) for i in range(hosts)},
        "rc": {i: p.returncode for i, p in procs.items()},
        "work": work,
        "oracle": oracle,
        "seconds": time.monotonic() - t0,
        "log": lambda i: _read(os.path.join(work, f"host{i}.log"))[-6000:],
    }


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _read_json(path: str) -> dict:
    return json.loads(_read(path)) if os.path.exists(path) else {"errors": ["no result file"], "gens": []}


def _oracle(hosts: int) -> dict:
    from models.deepseek_v4 import init

    from ...oracle import oracle_for
    from .test_prefix import CFG, NEW

    q = queries(hosts)
    names = sorted(q)
    tokens, logits = oracle_for(init(CFG, seed=3), pad_to=352)([q[n] for n in names], NEW)
    return {n: (t, np.asarray(lg)) for n, t, lg in zip(names, tokens, logits, strict=True)}


# --------------------------------------------------------------------------------- the checks
def _gens(cluster, phase: str) -> list[tuple[int, dict]]:
    return [(i, g) for i, h in cluster["hosts"].items() for g in h["gens"] if g["phase"] == phase]


def _assert_exact(cluster, gens) -> None:
    """Zero wrong tokens: each generation's tokens equal the oracle's, its logits within 1e-4; and
    every miss has its reason (a plan that restored fewer tokens than its hash match names why)."""
    assert gens
    for i, g in gens:
        t, lg = cluster["oracle"][g["query"]]
        assert g["tokens"] == t, (i, g["query"], g["plan"])
        assert np.abs(np.asarray(g["logits"]) - lg).max() < 1e-4, (i, g["query"])
        p = g["plan"]
        if p["restored_tokens"] < p["hash_hit_tokens"]:
            assert p["reason"] is not None, (i, g["query"], p)
        # Where the stored chain ends before the prompt's last full block, a plan that restored every
        # hashed block names no reason, from the device or extended from disk: nothing was rejected.


def _assert_host_ok(cluster, i, phase) -> None:
    h = cluster["hosts"][i]
    assert h["errors"] == [], f"host {i}: {h['errors'][0]}\n{cluster['log'](i)}"
    assert phase in h["phases"], f"host {i} finished {h['phases']}\n{cluster['log'](i)}"


def check_cluster(cluster) -> None:
    n = len(cluster["hosts"])
    abis = set()
    for i in range(n):
        _assert_host_ok(cluster, i, "ready")
        c = cluster["hosts"][i]["cluster"]
        assert c["process_count"] == n and c["process_index"] == i
        assert c["allgather"] == list(range(n))  # a collective across every process
        assert c["devices"] == n * c["local_devices"]
        abis.add(cluster["hosts"][i]["notes"]["abi"])
    assert len(abis) == 1  # same weights: one ABI fingerprint, so every host can restore every block
    print(f"\n{n} hosts, phases a-d in {cluster['seconds']:.1f} s; seconds since each host started:")
    for i in range(n):
        print(f"  host {i}: {cluster['hosts'][i]['seconds']}")
        print(f"  host {i}: {cluster['hosts'][i]['notes'].get('compilations')}")
        print(f"  host {i}: {cluster['hosts'][i]['notes'].get('serve_seconds')}")


def check_concurrent_writers(cluster) -> None:
    n = len(cluster["hosts"])
    for i in range(n):
        _assert_host_ok(cluster, i, "a")
    gens = _gens(cluster, "a")
    assert sorted(i for i, _ in gens) == sorted(i for i in range(n) for _ in range(n))  # S + the others' P
    p = _prompts(n)
    for i, g in gens:
        base = g["query"].split("+")[0]
        assert g["plan"]["disk_tokens"] == [0, _block_end(len(p[base]))], (i, g["query"], g["plan"])
    _assert_exact(cluster, gens + _gens(cluster, "a-write"))
    # every host's segments are in the store, each named by its process index
    assert {f"host{i}" for i in range(n)} <= set(cluster["hosts"][0]["notes"]["a_writers"])


def check_one_writes_another_restores(cluster) -> None:
    from .test_prefix import BT

    n = len(cluster["hosts"])
    for i in range(n):
        _assert_host_ok(cluster, i, "b")
    assert cluster["hosts"][0]["notes"]["b_evicted"] >= 140 // BT  # its records of A (and of phase a)
    gens = _gens(cluster, "b")
    assert sorted(i for i, _ in gens) == list(range(1, n))
    for _, g in gens:
        assert g["plan"]["disk_tokens"] == [0, _block_end(140)], g["plan"]  # every block from disk
        assert g["plan"]["reason"] is None
    _assert_exact(cluster, gens + _gens(cluster, "b-write"))


def check_budget_eviction_while_reading(cluster) -> None:
    n = len(cluster["hosts"])
    for i in range(n):
        _assert_host_ok(cluster, i, "c")
    notes = cluster["hosts"][0]["notes"]
    assert notes["c_evicted"] > 0
    gens = _gens(cluster, "c")
    assert all(cluster["hosts"][i]["notes"]["c_passes"] >= 1 for i in range(1, n))
    _assert_exact(cluster, gens + _gens(cluster, "c-write"))
    reasons: dict = {}
    for _, g in gens:
        reasons[g["plan"]["reason"]] = reasons.get(g["plan"]["reason"], 0) + 1
    restored = sum(bool(g["plan"]["disk_tokens"]) for _, g in gens)
    assert restored > 0
    print(f"phase c: {len(gens)} reads, {restored} from disk, reasons {reasons}; {notes['c_evicted']} evicted")


def check_killed_mid_write(cluster, capsys) -> None:
    n, rc = len(cluster["hosts"]), cluster["rc"]
    victim = n - 1
    assert rc[victim] == -signal.SIGKILL, cluster["log"](victim)
    assert "d-first" in cluster["hosts"][victim]["phases"]
    for i in range(victim):
        _assert_host_ok(cluster, i, "d")
        assert rc[i] == 0, cluster["log"](i)  # a dead host does not take the others down
    gens = _gens(cluster, "d")
    p = _prompts(n)
    if cluster["kill"] == "pause":
        assert sorted(i for i, _ in gens) == list(range(victim))
        for _, g in gens:
            assert g["plan"]["disk_tokens"] == [0, CUT], g["plan"]  # the published segment, not the killed one
    else:  # each segment is all or nothing, and every survivor sees the same store
        assert sorted(i for i, _ in gens) == sorted(list(range(victim)) * 3)
        seen = {}
        for _, g in gens:
            name = g["query"].split("+")[0]
            full = [0, _block_end(len(p[name]))]
            assert g["plan"]["disk_tokens"] in (([0, CUT], full) if name == "D" else (None, full)), g
            seen.setdefault(name, set()).add(str(g["plan"]["disk_tokens"]))
        assert all(len(v) == 1 for v in seen.values()), seen
        print(f"random kill after {cluster['delay']:.3f} s: restored {seen}")
    _assert_exact(cluster, gens + _gens(cluster, "d-write"))
    report = cluster["hosts"][0]["notes"]["d_verify"]
    assert all(report[r] == 0 for r in ("disk_checksum", "disk_missing", "disk_truncated", "disk_abi")), report
    if cluster["kill"] == "pause":
        assert report["orphaned_segments"] >= 1, report  # the killed write's data, never published

    from hkv.store.cli import main

    capsys.readouterr()
    assert main(["store", "verify", "--json", os.path.join(cluster["work"], "store")]) == 0
    assert json.loads(capsys.readouterr().out)["orphaned_segments"] == report["orphaned_segments"]


# --------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two hosts through phases a-d (host 1, the only one that compiles the engine from scratch:
    JAX's persistent compilation cache is written by process 0 only, and keyed by device ids)."""
    return run_cluster(str(tmp_path_factory.mktemp("multihost")), hosts=2)


@pytest.mark.slow  # two fresh processes compile an engine each (~100 s on 2 cores)
def test_hosts_join_one_jax_cluster_with_the_same_abi(cluster):
    check_cluster(cluster)


@pytest.mark.slow  # two fresh processes compile an engine each (~100 s on 2 cores)
def test_concurrent_writers_then_each_restores_the_others_blocks(cluster):
    check_concurrent_writers(cluster)


@pytest.mark.slow  # two fresh processes compile an engine each (~100 s on 2 cores)
def test_a_block_written_by_one_host_is_restored_by_another(cluster):
    check_one_writes_another_restores(cluster)


@pytest.mark.slow  # two fresh processes compile an engine each (~100 s on 2 cores)
def test_budget_eviction_by_one_host_while_another_restores(cluster):
    check_budget_eviction_while_reading(cluster)


@pytest.mark.slow  # two fresh processes compile an engine each (~100 s on 2 cores)
def test_a_host_killed_mid_write_leaves_only_verified_blocks(cluster, capsys):
    check_killed_mid_write(cluster, capsys)


@pytest.mark.slow
def test_three_hosts_every_phase(tmp_path, capsys):
    """Phases a-d with three hosts: two readers under the evicting host, two survivors of the kill."""
    c = run_cluster(str(tmp_path), hosts=3)
    check_cluster(c)
    check_concurrent_writers(c)
    check_one_writes_another_restores(c)
    check_budget_eviction_while_reading(c)
    check_killed_mid_write(c, capsys)


@pytest.mark.slow
def test_a_host_killed_at_a_random_moment_of_its_writes(tmp_path, capsys):
    """Phase d with the victim killed at a random moment while it writes three segments in 4 KiB
    shards: the survivors restore each of its prompts wholly or not at all, the same on every
    survivor, with exact tokens, and `verify` finds no bad block."""
    c = run_cluster(str(tmp_path), hosts=2, kill="random")
    check_cluster(c)
    check_killed_mid_write(c, capsys)


@pytest.mark.slow
def test_readme_many_hosts_example_runs(tmp_path):
    """README "Many hosts": its host.py, run as written by two processes (one a coordinator on
    127.0.0.1), restores host 0's blocks on host 1 from the shared store."""
    import re

    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("### Many hosts", 1)[1].split("\n## ", 1)[0]
    (script,) = re.findall(r"```python\n(# host.py.*?)```", section, re.DOTALL)
    (tmp_path / "host.py").write_text(script)
    port, store = _free_port(), str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "host.py"), str(i), "2", f"127.0.0.1:{port}", store],
            env=_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=DEADLINE)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs[1][-4000:] + outs[0][-4000:]
    assert "host 1: tokens (0, 128) restored from the store" in outs[1], outs[1][-4000:]


if __name__ == "__main__":
    ROLES[sys.argv[1]](*sys.argv[2:])
