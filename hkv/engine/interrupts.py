"""`DeferredInterrupt`: SIGINT held back to a point between two transitions of the engine's cache."""

from __future__ import annotations

import signal
import threading


class DeferredInterrupt:
    """Defers SIGINT (Ctrl-C, a notebook's stop button) to `deliver()`, called between two transitions,
    so an interrupt never lands between a donating transition and the engine installing its result.
    Active only in the main thread and only over Python's default SIGINT handler; a second SIGINT
    before delivery interrupts at once (the engine then recovers: `Engine._abort`). A signal still pending
    when the scope ends is raised there."""

    def __init__(self):
        self.pending = False
        self._previous = None

    def __enter__(self):
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def deliver(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if exc[0] is None:
            self.deliver()
