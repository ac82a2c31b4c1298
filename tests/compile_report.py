"""Sum up a test run's XLA compiles, as logged with `HKV_TEST_COMPILE_LOG=DIR` (see tests/conftest.py).

    HKV_TEST_COMPILE_LOG=/tmp/clog make test
    python -m tests.compile_report /tmp/clog [--top 25]

Prints, for a run that started with a cold persistent cache (a fresh machine), where the compile time
went: per test file and per test, the seconds spent compiling programs the cache did not have; the
programs compiled under the most distinct keys (one function traced at several shapes or configs: the
candidates for sharing one config between tests); and keys compiled more than once (two workers
compiling the same program at once, or programs under the cache's 0.5 s floor compiled again); and the
seconds spent tracing and lowering, which a warm cache does not save.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re


def _name(module: str) -> str:
    """One spelling for a program's name: the cache log writes `jit__f`, the compile event `jit(_f)`."""
    m = re.fullmatch(r"(\w+)\((.*)\)", module)
    return f"{m.group(1)}_{m.group(2)}" if m else module


def load(directory: str) -> tuple[list[dict], list[dict]]:
    """Every compile of the run, `{test, module, key, hit, seconds}` (a cache lookup paired with the
    compile event that followed it for the same program in the same process), and every trace and
    lowering, `{event, test, module, seconds}`."""
    compiles, stages = [], []
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        pending: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                name = _name(rec["module"])
                if rec["event"] in ("trace", "lower"):
                    stages.append(rec)
                elif rec["event"] == "lookup":
                    pending[name].append(rec)
                elif pending[name]:
                    lookup = pending[name].popleft()
                    compiles.append({**lookup, "module": name, "seconds": rec["seconds"]})
                else:  # compiled without a persistent-cache lookup (the cache declined the program)
                    compiles.append({"test": rec["test"], "module": name, "key": None, "hit": False, **rec})
    return compiles, stages


def report(compiles: list[dict], stages: list[dict], top: int) -> str:
    misses = [c for c in compiles if not c["hit"]]
    trace_s = sum(r["seconds"] for r in stages if r["event"] == "trace")
    lower_s = sum(r["seconds"] for r in stages if r["event"] == "lower")
    lines = [
        f"{len(compiles)} compile requests; {len(misses)} misses, {sum(c['seconds'] for c in misses):.0f} s compiling; "
        + f"{len(compiles) - len(misses)} cache hits, {sum(c['seconds'] for c in compiles if c['hit']):.0f} s loading",
        f"programs >= 0.5 s compiled: {sum(c['seconds'] >= 0.5 for c in misses)}",
        f"tracing {trace_s:.0f} s, lowering {lower_s:.0f} s (no cache saves these)",
    ]

    def table(title, key):
        agg = collections.defaultdict(lambda: [0.0, 0])
        for c in misses:
            agg[key(c)][0] += c["seconds"]
            agg[key(c)][1] += 1
        lines.append(f"\n{title} (compile seconds on misses, programs)")
        for k, (s, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"  {s:8.1f} s  {n:4d}  {k}")
        return agg

    table("per test file", lambda c: c["test"].split("::")[0])
    table("per test", lambda c: c["test"])
    per_name = table("per program name", lambda c: c["module"])
    traced = collections.defaultdict(float)
    for r in stages:
        traced[r["test"].split("::")[0]] += r["seconds"]
    lines.append("\nper test file: seconds tracing + lowering")
    for k, s in sorted(traced.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {s:8.1f} s  {k}")

    keys = collections.defaultdict(set)
    for c in misses:
        if c["key"]:
            keys[c["module"]].add(c["key"])
    lines.append("\nprograms compiled under the most distinct keys")
    for name, ks in sorted(keys.items(), key=lambda kv: -len(kv[1]))[:top]:
        lines.append(f"  {len(ks):4d} keys  {per_name[name][0]:8.1f} s  {name}")

    again = collections.Counter(c["key"] for c in misses if c["key"])
    by_time = collections.defaultdict(float)  # key compiled more than once -> seconds of all its compiles
    for c in misses:
        if c["key"] and again[c["key"]] > 1:
            by_time[c["key"]] += c["seconds"]
    lines.append(
        f"\nkeys compiled more than once: {len(by_time)} ({sum(by_time.values()):.0f} s in all those compiles)"
    )
    for k, s in sorted(by_time.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {again[k]}x  {s:7.1f} s  {k[:90]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="the HKV_TEST_COMPILE_LOG directory of a test run")
    parser.add_argument("--top", type=int, default=25, help="rows per table (default 25)")
    args = parser.parse_args()
    if not os.path.isdir(args.directory):
        raise SystemExit(f"no such directory: {args.directory!r}")
    print(report(*load(args.directory), args.top))


if __name__ == "__main__":
    main()
