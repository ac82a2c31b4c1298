"""What a benchmark prints about where it ran (CPU cores available, the hkv revision), and the one way
the benchmarks time an engine's decode steps (`step_until_done`)."""

from __future__ import annotations

import os
import subprocess
import time


def cores() -> int:
    """CPU cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def hkv_revision() -> str:
    """Short git revision of the checkout the benchmarks live in ("?" outside git)."""
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            ).stdout.strip()
            or "?"
        )
    except OSError:
        return "?"


def step_until_done(engine, handle) -> list[float]:
    """Drive `engine.step()` until request `handle` is done, timing each step on its own.

    Args:
        engine: an `hkv.Engine` holding the request.
        handle: the request's handle (`engine.submit(...)`).
    Returns:
        Seconds per token of every step that only decoded for it (a token existed before the step and
        the step added some), in order; prefill steps are left out.
    """
    per_token = []
    while not handle.done:
        had = len(handle.tokens)
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        got = len(handle.tokens) - had
        if had and got:
            per_token.append(dt / got)
    return per_token
