"""Progress bars for long engine work (tqdm.auto: a widget in notebooks, text in a terminal).

`Bars(enabled)`: enabled None shows bars when stderr is a terminal or the code runs in a Jupyter
kernel; True / False force them on / off. Engines show one for each compilation (a step compiled for
the first time in the process: the slowest part of a cold start) and one per `generate` /
`generate_text` call whose prompts and new tokens add up to `min_tokens` or more.
"""

from __future__ import annotations

import contextlib
import sys


def _interactive() -> bool:
    if "ipykernel" in sys.modules:
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Bars:
    """Factory of tqdm bars that are no-ops when disabled."""

    def __init__(self, enabled: bool | None = None, min_tokens: int = 2048):
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(f"progress_bars={enabled!r} must be None, True or False")
        self.enabled = _interactive() if enabled is None else enabled
        self.min_tokens = min_tokens

    def tokens(self, total: int, desc: str):
        """A bar over `total` tokens (None when disabled or total < min_tokens)."""
        if not self.enabled or total < self.min_tokens:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="tok", leave=False, dynamic_ncols=True)

    def bytes(self, total: int, desc: str):
        """A bar over `total` bytes (None when disabled or total is 0)."""
        if not self.enabled or total <= 0:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False, dynamic_ncols=True)

    @contextlib.contextmanager
    def compiling(self, name: str):
        """An elapsed-time bar while `name` compiles."""
        if not self.enabled:
            yield
            return
        from tqdm.auto import tqdm

        bar = tqdm(total=1, desc=f"hkv: compiling {name}", bar_format="{desc} ({elapsed})", leave=False)
        try:
            yield
        finally:
            bar.update(1)
            bar.close()
