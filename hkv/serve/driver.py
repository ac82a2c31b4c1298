"""The thread that drives the engine for the server, and the bridge from its request handles to asyncio.

One `EngineDriver` owns the engine's stepping: its thread calls `engine.step()` while requests are
pending (continuous batching: requests submitted meanwhile join at the next step) and sleeps on an
event otherwise. HTTP handlers, on the event loop, `submit` a checked `Job` (`engine.submit_choices`
is thread-safe) and get a `Ticket`; after every step the driver reads each ticket's handles without
blocking and hands their new tokens and results to the ticket's `asyncio.Queue` through
`loop.call_soon_threadsafe`, as `ChoiceUpdate`s. A handler whose client went away calls
`cancel(ticket)`: the handles are cancelled and the engine frees their slots at its next step.

Everything that reads the engine's device state from another thread (metrics scrapes) goes through
`call(fn)`, which runs `fn` on the driver thread between two steps.

Admission: more than `max_queue` choices waiting or running refuses a submission (`ApiError` 429).
Shutdown: `stop(timeout)` refuses new submissions (503), lets running tickets finish (cancelling what
is left after `timeout`) and ends the thread; the caller then closes the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hkv import EngineBusyError, Generation, RequestCancelledError, RequestHandle, TokenOutput

from .metrics import ServeMetrics
from .params import Job
from .protocol import ApiError

__all__ = ["ChoiceUpdate", "EngineDriver", "Ticket"]

log = logging.getLogger("hkv.serve")
MAX_STEP_FAILURES = 3  # consecutive failing steps after which the driver gives up (health answers 503)


@dataclasses.dataclass(frozen=True)
class ChoiceUpdate:
    """What one step produced for one choice of a ticket.

    Attributes:
      index: the choice's index in the response (prompt index * n + choice).
      outputs: its new tokens (id, logprob, top logprobs, text delta), possibly none.
      generation: its `hkv.Generation` once it finished (None until then, and on error).
      error: the exception it failed with (`hkv.RequestCancelledError` when cancelled), or None.
    """

    index: int
    outputs: tuple[TokenOutput, ...] = ()
    generation: Generation | None = None
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        """True for a choice's last update."""
        return self.generation is not None or self.error is not None


class _Choice:
    """The driver's reading position in one handle's event stream."""

    def __init__(self, index: int, handle: RequestHandle):
        self.index, self.handle = index, handle
        self.seen = 0
        self.finished = False
        self.t_last: float | None = None  # when its last token reached the driver

    def read(self) -> ChoiceUpdate | None:
        """The new tokens and, once done, the result: read without blocking (only events that are
        there already are asked for, and a finished handle's stream ends at once)."""
        h = self.handle
        outs = h.outputs(self.seen)
        self.seen += len(outs)
        if not h.done:
            return ChoiceUpdate(self.index, tuple(outs)) if outs else None
        self.finished = True
        try:
            outs += h.outputs(self.seen)  # (what arrived since the read above)
            return ChoiceUpdate(self.index, tuple(outs), generation=h.result())
        except Exception as e:  # cancelled, or failed alone (e.g. CacheCapacityError)
            return ChoiceUpdate(self.index, tuple(outs), error=e)


class Ticket:
    """One HTTP request's engine requests (its choices) and the queue their updates arrive in.

    Attributes:
      id: a number unique within the driver.
      endpoint: "completions" or "chat" (for the metrics).
      job: the request as checked.
      queue: the `asyncio.Queue` of `ChoiceUpdate`s (filled from the driver thread).
      handles: the engine's request handles, in choice order.
    """

    def __init__(self, tid: int, job: Job, handles: list[RequestHandle], loop: asyncio.AbstractEventLoop):
        self.id, self.job, self.endpoint, self.handles = tid, job, job.endpoint, handles
        self.queue: asyncio.Queue[ChoiceUpdate] = asyncio.Queue()
        self.t_submit = time.monotonic()
        self._loop = loop
        self._choices = [_Choice(i, h) for i, h in enumerate(handles)]

    @property
    def open(self) -> int:
        """Choices not finished yet (driver side)."""
        return sum(not c.finished for c in self._choices)

    def cancel(self) -> None:
        """Cancel every choice still running (their slots are freed at the engine's next step)."""
        for h in self.handles:
            h.cancel()

    def _post(self, update: ChoiceUpdate) -> bool:
        """Hand an update to the event loop; False if the loop is gone (the ticket is then cancelled)."""
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, update)
            return True
        except RuntimeError:  # the event loop was closed
            self.cancel()
            return False


class EngineDriver:
    """Drives an engine from one thread and bridges its request handles into asyncio.

    Args:
      engine: an `hkv.Engine` (or `hkv.MeshEngine`) built with the served tokenizer; the driver is the
        only thread that steps it.
      max_queue: the most choices waiting or running at once; a submission beyond it is refused (429).
      metrics: where to count tokens, latencies and finish reasons (None: nowhere).
      idle_wait: seconds the idle thread sleeps between checks (a submission wakes it at once).
    """

    def __init__(self, engine: Any, *, max_queue: int, metrics: ServeMetrics | None = None, idle_wait: float = 0.5):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue={max_queue!r} must be an integer >= 1")
        self.engine, self.max_queue, self.metrics, self.idle_wait = engine, max_queue, metrics, idle_wait
        self._lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}
        self._ids = itertools.count()
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._wake = threading.Event()
        self._stopping = False
        self._exit = False
        self._failures = 0
        self.broken: str | None = None  # why the driver stopped stepping (None: healthy)
        self._thread = threading.Thread(target=self._loop, name="hkv-engine-driver", daemon=True)

    # ------------------------------------------------------------------------- event-loop side
    def start(self) -> None:
        """Start the driver thread."""
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The thread runs, steps succeed, and no shutdown has begun."""
        return self._thread.is_alive() and self.broken is None and not self._stopping

    @property
    def active(self) -> int:
        """Choices submitted and not finished (waiting or running)."""
        with self._lock:
            return sum(t.open for t in self._tickets.values())

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop) -> Ticket:
        """Queue a checked job into the engine.

        Args:
          job: the request; loop: the event loop its updates are delivered on.
        Returns:
          the `Ticket` (its queue receives every choice's updates).
        Raises:
          ApiError: 429 when more than `max_queue` choices would wait or run, 503 while shutting
            down or after the driver failed, 400 when the engine refuses the request (a ValueError).
        """
        with self._lock:
            if self._stopping or self.broken is not None or not self._thread.is_alive():
                why = self.broken or "the server is shutting down"
                raise ApiError(f"not accepting requests: {why}", status=503, type="server_error", code="unavailable")
            active = sum(t.open for t in self._tickets.values())
            if active + job.choices > self.max_queue:
                raise ApiError(
                    f"the server is at capacity: {active} requests are waiting or running and this one adds "
                    f"{job.choices}; at most {self.max_queue} are accepted (--max-queue). Retry later.",
                    status=429,
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                )
            handles: list[RequestHandle] = []
            try:
                for prompt, budget in zip(job.prompts, job.max_tokens, strict=True):
                    handles += self.engine.submit_choices(prompt, budget, sampling=job.sampling)
            except ValueError as e:
                for h in handles:
                    h.cancel()
                raise ApiError(str(e)) from e
            ticket = Ticket(next(self._ids), job, handles, loop)
            self._tickets[ticket.id] = ticket
        if self.metrics is not None:
            self.metrics.prompt_tokens.labels(job.endpoint).inc(sum(len(p) for p in job.prompts))
        self._wake.set()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Cancel a ticket's choices still running (e.g. its client disconnected)."""
        ticket.cancel()
        self._wake.set()

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run `fn` on the driver thread between two steps and return its result (a metrics scrape
        reads the engine's device state this way). Runs it here when the thread has ended.

        Raises:
          TimeoutError: the driver did not get to it within `timeout` seconds (a long compile).
        """
        if not self._thread.is_alive():
            return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._calls.append((fn, fut))
        self._wake.set()
        return fut.result(timeout)

    def stop(self, timeout: float = 30.0) -> bool:
        """Refuse new submissions, let the running tickets finish for up to `timeout` seconds (then
        cancel the rest), and end the thread.

        Returns:
          True when every ticket had finished by itself.
        """
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + timeout
        while self.active and self._thread.is_alive() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.05)
        drained = not self.active
        with self._lock:
            for t in self._tickets.values():
                t.cancel()
        self._exit = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(5.0, deadline - time.monotonic()))
        return drained

    # ---------------------------------------------------------------------------- driver side
    def _loop(self) -> None:
        while True:
            self._wake.clear()
            self._run_calls()
            if self._exit and (not self._tickets or not self.engine.pending or self.broken is not None):
                break
            stepped = False
            if self.engine.pending and self.broken is None:
                stepped = self._step()
            self._forward()
            if not stepped and not self._calls:
                self._wake.wait(self.idle_wait)
        self._run_calls()

    def _step(self) -> bool:
        """One `engine.step()`; a failure fails every ticket (and, repeated, stops the stepping)."""
        try:
            self.engine.step()
            self._failures = 0
            return True
        except EngineBusyError:  # another thread drives the engine for a moment (not the server's own)
            time.sleep(0.01)
            return False
        except Exception as e:
            self._failures += 1
            log.exception("engine step failed (%d in a row)", self._failures)
            if self._failures >= MAX_STEP_FAILURES:
                self.broken = f"the engine failed {self._failures} steps in a row: {type(e).__name__}: {e}"
            self._fail_all(e)
            time.sleep(0.1)
            return False

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            tickets = list(self._tickets.values())
            self._tickets.clear()
        for t in tickets:
            t.cancel()
            for c in t._choices:
                if not c.finished:
                    c.finished = True
                    t._post(ChoiceUpdate(c.index, error=error))
                    self._count_finish(t, None, error)

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, fut in calls:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)

    def _forward(self) -> None:
        """Hand every ticket's new tokens and results to its event loop; drop finished tickets."""
        with self._lock:
            tickets = list(self._tickets.values())
        now = time.monotonic()
        for t in tickets:
            for c in t._choices:
                if c.finished:
                    continue
                update = c.read()
                if update is None:
                    continue
                self._count_tokens(t, c, update, now)
                if update.finished:
                    self._count_finish(t, update.generation, update.error)
                t._post(update)
            if not t.open:
                with self._lock:
                    self._tickets.pop(t.id, None)

    def _count_tokens(self, t: Ticket, c: _Choice, update: ChoiceUpdate, now: float) -> None:
        m, k = self.metrics, len(update.outputs)
        if m is None or not k:
            return
        m.generation_tokens.labels(t.endpoint).inc(k)
        if c.t_last is None:
            m.ttft.labels(t.endpoint).observe(now - t.t_submit)
            k -= 1
        else:
            gap = (now - c.t_last) / k
            for _ in range(k):
                m.itl.labels(t.endpoint).observe(gap)
        c.t_last = now

    def _count_finish(self, t: Ticket, gen: Generation | None, error: BaseException | None) -> None:
        if self.metrics is None:
            return
        reason = gen.finish_reason if gen is not None else "cancelled"
        if error is not None and not isinstance(error, RequestCancelledError):
            reason = "error"
        self.metrics.requests.labels(t.endpoint, reason).inc()
        if gen is not None:
            self.metrics.latency.labels(t.endpoint).observe(time.monotonic() - t.t_submit)


@contextlib.contextmanager
def running(driver: EngineDriver, timeout: float = 30.0):
    """`driver` started for the duration of a `with` block, stopped (drained) at its end."""
    driver.start()
    try:
        yield driver
    finally:
        driver.stop(timeout)
