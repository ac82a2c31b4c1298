"""What a benchmark prints about where it ran: CPU cores available, and the hkv revision."""

from __future__ import annotations

import os
import subprocess


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
