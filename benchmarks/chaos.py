"""Chaos run of issue 11 ("never a wrong token, never a stuck engine"): processes sharing one disk
tier store run multi-turn chats while faults are injected; every generation is checked against the
stateless forward.

    python benchmarks/chaos.py [--processes 3 --turns 6 --seed 0 --fault-rate 3 --duration 0 --key]

--processes counts every engine process: one of them runs OTHER weights under the same model_id
(unless --no-alien). Faults: store file damage (flips, truncations, deletions, swapped manifests and
shards), hostile files (deep JSON, symlink loops, README.json, garbage, resealed huge sizes), budget
eviction by another process, full disk, SIGKILL of a writer and of a process inside
`save(overwrite=True)` (then `Engine.restore`), KeyboardInterrupt inside `generate`; with --key,
manifests forged without the store key. The harness is tests/chaos/harness.py (shared with
tests/chaos/test_chaos.py). Prints generations, tokens checked, faults per kind, rejections per
reason, exceptions per type, wrong tokens and `hkv store verify`'s summary; exit code 1 if any wrong
token, unexpected exception or other failure (listed), 0 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: tests.chaos.harness

import _machine  # noqa: E402 — benchmarks/_machine.py (the script's folder is on sys.path)

from tests.chaos.harness import STORE_FAULTS, ChaosConfig, format_report, run_chaos  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--processes", type=int, default=3, help="engine processes on the store, the alien included")
    ap.add_argument("--no-alien", action="store_true", help="every process runs the same weights")
    ap.add_argument("--turns", type=int, default=6, help="turns per process (a minimum with --duration)")
    ap.add_argument("--duration", type=float, default=0, help="seconds of turns (0: just --turns)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fault-rate",
        type=float,
        default=3.0,
        help="store faults per turn (1.5: one or two); "
        "kinds are dealt in shuffled rounds, so 15 faults inject every kind",
    )
    ap.add_argument("--faults", default=",".join(STORE_FAULTS), help="store fault kinds, comma-separated")
    ap.add_argument("--interrupt-rate", type=float, default=0.35, help="per generate call")
    ap.add_argument("--disk-full-rate", type=float, default=0.15, help="per turn and process")
    ap.add_argument(
        "--kill-writer-turns",
        default="3",
        help="turns at which worker 0 is SIGKILLed mid-write "
        "and restarted from its checkpoint (comma-separated; '' for none)",
    )
    ap.add_argument(
        "--save-kill-turns",
        default="1,4",
        help="turns after which a process is SIGKILLed inside save(overwrite=True), then restored",
    )
    ap.add_argument(
        "--no-final-save-kill", action="store_true", help="skip the SIGKILL inside a save after the final checks"
    )
    ap.add_argument(
        "--message-tokens",
        default="6,18",
        help="a turn's new message, MIN,MAX tokens (larger: chats reach max_context sooner)",
    )
    ap.add_argument("--budget", type=int, default=320 << 10, help="store budget (bytes) of worker 0, 0 for none")
    ap.add_argument("--key", action="store_true", help="DiskTier(key=...) everywhere, plus forged manifests")
    ap.add_argument("--workdir", help="keep the store and logs here (default: a temporary directory, deleted)")
    ap.add_argument("--json", metavar="FILE", help="also write the whole report as JSON")
    ap.add_argument("--corrupt-truth", action="store_true", help=argparse.SUPPRESS)  # harness self-check
    args = ap.parse_args(argv)

    alien = not args.no_alien and args.processes >= 2
    turns_list = lambda s: tuple(int(x) for x in s.split(",") if x.strip())
    cfg = ChaosConfig(
        workers=args.processes - alien,
        alien=alien,
        turns=args.turns,
        duration=args.duration or None,
        seed=args.seed,
        fault_rate=args.fault_rate,
        store_faults=tuple(f for f in args.faults.split(",") if f),
        key=args.key,
        interrupt_rate=args.interrupt_rate,
        disk_full_rate=args.disk_full_rate,
        budget_bytes=args.budget or None,
        kill_alien_turn=1 if alien else None,
        kill_writer_turns=turns_list(args.kill_writer_turns),
        save_kill_turns=turns_list(args.save_kill_turns),
        final_save_kill=not args.no_final_save_kill,
        message_tokens=turns_list(args.message_tokens),
        corrupt_truth=args.corrupt_truth,
    )
    now = datetime.datetime.now(datetime.UTC)
    print(
        f"# hkv chaos  {now:%Y-%m-%d %H:%M} UTC  hkv {_machine.hkv_revision()}  {_machine.cores()} cores  "
        f"{platform.machine()}  python {platform.python_version()}"
    )
    print(f"# {' '.join(sys.argv[1:]) or '(defaults)'}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="hkv-chaos-")
    os.makedirs(workdir, exist_ok=True)
    try:
        rep = run_chaos(cfg, workdir, say=lambda m: print(f"  {m}", flush=True))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    if "skipped" in rep:
        return 0
    return 1 if rep["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
