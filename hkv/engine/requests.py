"""Requests and their results: `Generation`, `RequestHandle` (streaming), `EngineBusyError`.

`Engine.submit(prompt, ...)` returns a `RequestHandle`. It is filled by whichever thread drives the
engine (`Engine.step`, `run_until_idle`, `generate`); iterating it, or calling `.result()`, drives the
engine itself when no other thread does, so a single-threaded caller never deadlocks:

    h = engine.submit(prompt, 64, sampling=hkv.Sampling(temperature=0.8, seed=1))
    for token in h:          # new token ids as they are produced
        print(token)
    gen = h.result()         # the `Generation`

Abandoning a stream (closing or dropping the iterator before the end) cancels the request: its slot
and pages are freed at the engine's next step.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np


class EngineBusyError(RuntimeError):
    """Another thread is driving this engine (`step`, `generate`, `run_until_idle`, a handle's
    stream); one engine advances from one thread at a time. `submit` never raises it."""


class EngineClosedError(RuntimeError):
    """The engine was closed (`Engine.close`): it runs nothing more; build a new one (or
    `Engine.restore` a saved one)."""


class RequestCancelledError(RuntimeError):
    """The request was cancelled (`RequestHandle.cancel`, or its stream was abandoned) before it finished."""


@dataclasses.dataclass
class Generation:
    """One request's result.

    Attributes:
      tokens: the new token ids (a stop id, when one ended the request, is the last of them).
      logprobs: float32[len(tokens)] each token's log-probability under the model's raw distribution.
      finish_reason: "length" (max_new_tokens reached) or "stop" (a stop id was produced).
      plan: the `RestorePlan` of the request's prefix lookup (what the cache restored, and why not more).
      logits: float32[len(tokens), vocab] the logits each token was chosen from, only when asked for
        (`return_logits=True`); None otherwise (nothing vocabulary-sized crosses to the host).
      seed: the seed the request's tokens were drawn with (None for greedy requests).
      text: the decoded new tokens (`Engine.generate_text` only).
    """

    tokens: list[int]
    logprobs: np.ndarray
    finish_reason: str
    plan: Any = None
    logits: np.ndarray | None = None
    seed: int | None = None
    text: str | None = None


class RequestHandle:
    """A submitted request: stream its tokens (iterate), wait for its `Generation` (`result`), or `cancel`.

    Thread-safe: any thread may iterate or wait. Iterating or waiting drives the engine when no other
    thread is driving it; otherwise it waits for the driving thread.
    """

    def __init__(self, engine: Any, request_id: int):
        """engine: the `hkv.Engine` that runs the request (not imported here: the engine imports this module)."""
        self._engine = engine
        self.request_id = request_id
        self._cond = threading.Condition()
        self._tokens: list[int] = []
        self._result: Generation | None = None
        self._error: BaseException | None = None
        self._cancelled = False

    # ------------------------------------------------------------------ filled by the engine
    def _push(self, tokens: list[int]) -> None:
        with self._cond:
            self._tokens.extend(tokens)
            self._cond.notify_all()

    def _finish(self, result: Generation | None, error: BaseException | None = None) -> None:
        with self._cond:
            self._result, self._error = result, error
            self._cond.notify_all()

    # ------------------------------------------------------------------------------- public
    @property
    def done(self) -> bool:
        """True once the request finished, failed or was cancelled."""
        return self._result is not None or self._error is not None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def tokens(self) -> list[int]:
        """The tokens produced so far (a copy)."""
        with self._cond:
            return list(self._tokens)

    def cancel(self) -> None:
        """Stop the request; its slot and pages are freed at the engine's next step. No-op once done."""
        with self._cond:
            if self.done:
                return
            self._cancelled = True
        self._engine._cancel(self)

    def _wait(self, ready, timeout: float | None) -> None:
        """Drive the engine (or wait for the thread that does) until `ready()`."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if ready() or self._error is not None:
                    return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"request {self.request_id} not ready after {timeout} s")
            if not self._engine._try_step():
                with self._cond:  # another thread drives: wait for its next token or result
                    if not (ready() or self._error is not None):
                        self._cond.wait(0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic())))

    def result(self, timeout: float | None = None) -> Generation:
        """The request's `Generation`, driving the engine until it is done. Raises the request's error
        (e.g. `CacheCapacityError`, `RequestCancelledError`) if it failed; `TimeoutError` after `timeout` s."""
        self._wait(lambda: self._result is not None, timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def __iter__(self):
        """Yield new token ids in order as they are produced. Closing the iterator early (break, or
        dropping it) cancels the request."""
        seen = 0
        finished = False
        try:
            while True:
                self._wait(lambda n=seen: len(self._tokens) > n or self._result is not None, None)
                with self._cond:
                    new, err, res = self._tokens[seen:], self._error, self._result
                seen += len(new)
                yield from new
                if err is not None and not isinstance(err, RequestCancelledError):
                    raise err
                if res is not None or err is not None:
                    with self._cond:
                        if len(self._tokens) == seen:
                            finished = True
                            return
        finally:
            if not finished and not self.done:
                self.cancel()

    def __repr__(self) -> str:
        state = "done" if self.done else "cancelled" if self._cancelled else "running"
        return f"RequestHandle(id={self.request_id}, {state}, tokens={len(self._tokens)})"
