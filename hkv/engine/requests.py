"""Requests and their results: `Generation`, `RequestHandle` (streaming), `EngineBusyError`.

`Engine.submit(prompt, ...)` returns a `RequestHandle`. It is filled by whichever thread drives the
engine (`Engine.step`, `run_until_idle`, `generate`); iterating it, or calling `.result()`, drives the
engine itself when no other thread does, so a single-threaded caller never deadlocks:

    h = engine.submit(prompt, 64, sampling=hkv.SamplingParams(temperature=0.8, seed=1))
    for token in h:          # new token ids as they are produced
        print(token)
    gen = h.result()         # the `Generation`

Abandoning a stream (closing or dropping the iterator before the end) cancels the request: its slot
and pages are freed at the engine's next step.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ..core.plan import RestorePlan
from ..core.sampling import GREEDY, SamplingParams


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
      text: the decoded new tokens, cut at a stop string (engines with a tokenizer; None otherwise).
      top_logprobs: for each token, the `SamplingParams.logprobs` most likely tokens at its position
        as (id, logprob) pairs, most likely first (None when the request asked for none).
      prompt_logprobs: each prompt token's log-probability given the tokens before it (None for the
        first), when the request asked (`SamplingParams.prompt_logprobs`); else None.
      prompt_top_logprobs: at each prompt position, the N most likely tokens as (id, logprob) pairs
        (None for the first position), when the request asked for N; else None.
      choice: which of the prompt's `SamplingParams.n` completions this is (0 for n = 1).
      stop_string: the stop string that ended the request, or None.
    """

    tokens: list[int]
    logprobs: np.ndarray
    finish_reason: str
    plan: Any = None
    logits: np.ndarray | None = None
    seed: int | None = None
    text: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    choice: int = 0
    stop_string: str | None = None


@dataclasses.dataclass(frozen=True)
class TokenOutput:
    """One new token of a streamed request (`RequestHandle.events()`).

    Attributes:
      token: its id.
      logprob: its log-probability under the model's raw distribution.
      top_logprobs: the request's `SamplingParams.logprobs` most likely tokens at this position as
        (id, logprob) pairs (None when it asked for none).
      text: the text this token made final (engines with a tokenizer; "" while a character or a
        possible stop string is held back; the last event carries what was held). None without a
        tokenizer.
    """

    token: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] | None = None
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
        self._events: list[TokenOutput] = []
        self._result: Generation | None = None
        self._error: BaseException | None = None
        self._cancelled = False

    # ------------------------------------------------------------------ filled by the engine
    def _push(self, events: list[TokenOutput]) -> None:
        with self._cond:
            self._events.extend(events)
            self._tokens.extend(e.token for e in events)
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

    def outputs(self, start: int = 0) -> list[TokenOutput]:
        """The `TokenOutput`s produced so far from index `start` on (a copy), without waiting or
        driving the engine: what a thread that only reads (a server's driver) polls."""
        with self._cond:
            return self._events[start:]

    def cancel(self) -> None:
        """Stop the request; its slot and pages are freed at the engine's next step. No-op once done."""
        with self._cond:
            if self.done:
                return
            self._cancelled = True  # the driving thread drops the request at its next step (`Scheduler.reap`)

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
        for event in self.events():
            yield event.token

    def events(self):
        """Yield a `TokenOutput` per new token (id, logprob, top logprobs, text delta) in order as
        they are produced. Closing the iterator early (break, or dropping it) cancels the request;
        a failed request raises its error after the tokens it produced."""
        seen = 0
        finished = False
        try:
            while True:
                self._wait(lambda n=seen: len(self._tokens) > n or self._result is not None, None)
                with self._cond:
                    new, err, res = self._events[seen:], self._error, self._result
                seen += len(new)
                yield from new
                if err is not None and not isinstance(err, RequestCancelledError):
                    raise err
                if res is not None or err is not None:
                    with self._cond:
                        if len(self._events) == seen:
                            finished = True
                            return
        finally:
            if not finished and not self.done:
                self.cancel()

    def __repr__(self) -> str:
        state = "done" if self.done else "cancelled" if self._cancelled else "running"
        return f"RequestHandle(id={self.request_id}, {state}, tokens={len(self._tokens)})"


@dataclasses.dataclass
class LiveRequest:
    """A request as the engine schedules it: what it asked for, what it has produced, and where it
    stands in the cache (its slot, the tokens written, its block keys and prefix record, its plan).
    The scheduler, the prefix manager (`hkv.engine.prefix_manager`) and a mesh's router share it;
    users see its `Generation` and its `RequestHandle`."""

    index: int  # position in a generate call, or the request id of a submitted request
    prompt: list[int]
    max_new: int
    sampling: SamplingParams = GREEDY
    seed: int = 0  # resolved seed (the request's own, or drawn by the engine)
    stop_ids: tuple[int, ...] = ()
    keep_logits: bool = False
    handle: RequestHandle | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    cancelled: bool = False
    slot: int = -1
    admitted_at: int = 0
    t_admit: float = 0.0
    ids: list[int] = dataclasses.field(default_factory=list)  # prompt + tokens at admission (what prefill runs)
    fed: int = 0  # tokens written into the cache
    start: int = 0  # tokens this admission restored (its prefill runs ids[start:])
    keys: list = dataclasses.field(default_factory=list)  # block keys of the fed tokens
    parent_record: int = -1  # prefix record of the last recorded block
    plan: RestorePlan | None = None
    # admission control for record slots (hkv.core.policy): fixed at the request's first recorded step — the
    # prefix clock of its own previous use and the length it restored (None: it restored nothing)
    admission_set: bool = False
    prev_use: int | None = None
    prev_len: int | None = None
    record_stopped: bool = False  # refused a record slot: this request caches no more blocks
    # block number -> snapshot slot the running prefill step stages its TAIL in (None: no staging:
    # a decode step, or a model without `InteriorSnapshots`); `PrefixManager.after_step` consumes it
    staged: dict | None = None
    shard: int | None = None  # data shard of an `hkv.MeshEngine` (None: a single-device engine)
    reader: Any = None  # `hkv.engine.text.StopStrings` of an engine with a tokenizer (text, stop strings)
    stop_at: int | None = None  # tokens kept when a stop string ended the request (later ones were fed)
    top: list = dataclasses.field(default_factory=list)  # per token: (id, logprob) pairs (logprobs asked)
    prompt_lps: dict = dataclasses.field(default_factory=dict)  # prompt position -> (logprob, top pairs)
    leader: LiveRequest | None = None  # choice 0 of the prompt (n > 1): admitted after its prefill
    choice: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or len(self.tokens) >= self.max_new

    @property
    def over(self) -> bool:
        """Finished, failed or cancelled: nothing more will happen to it."""
        return self.done or self.error is not None or self.cancelled

    @property
    def waiting(self) -> bool:
        """A later choice of a prompt whose first choice has not finished its prefill (it restores
        that prefill from the prefix cache instead of computing it again)."""
        lead = self.leader
        return lead is not None and not lead.over and (lead.slot < 0 or lead.fed < len(lead.prompt))

    def _prompt_fields(self) -> dict:
        """`Generation.prompt_logprobs` / `prompt_top_logprobs` from `prompt_lps`."""
        if self.sampling.prompt_logprobs is None:
            return {}
        got = [self.prompt_lps.get(i) for i in range(1, len(self.prompt))]
        return {
            "prompt_logprobs": [None] + [None if g is None else g[0] for g in got],
            "prompt_top_logprobs": [None] + [None if g is None else list(g[1]) for g in got],
        }

    def emit(self, tokens: list[int], logprobs: list[float], logits, tops=None) -> int:
        """Append new tokens and hand them to the request's handle as `TokenOutput`s; returns how many
        were reported (the engine counts them as generated). A stop id, the budget or a stop string
        in the decoded text (`LiveRequest.reader`) ends the request; tokens the device produced after
        a stop string are kept as fed (the prefix manager records what the cache holds) but never
        reported (`LiveRequest.stop_at`)."""
        events = []
        reader = self.reader
        for j, t in enumerate(tokens):
            self.tokens.append(t)
            self.logprobs.append(logprobs[j])
            if self.keep_logits:
                self.logits.append(np.asarray(logits[j], np.float32))
            n_top = self.sampling.logprobs
            top = None
            if n_top is not None:
                top = tuple((int(i), float(v)) for i, v in zip(tops[0][j][:n_top], tops[1][j][:n_top], strict=True))
                self.top.append(top)
            if self.finish_reason:  # after a stop string earlier in this dispatch
                continue
            text = None
            if reader is not None:
                text = reader.feed(t).text
                if reader.stopped:
                    self.finish_reason, self.stop_at = "stop", len(self.tokens)
            if t in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.max_new:
                self.finish_reason = self.finish_reason or "length"
            if self.finish_reason and reader is not None and not reader.stopped:
                text += reader.finish().text
            events.append(TokenOutput(t, float(logprobs[j]), top, text))
        if self.handle is not None:
            self.handle._push(events)
        return len(events)

    def generation(self, vocab: int) -> Generation:
        n = len(self.tokens) if self.stop_at is None else self.stop_at
        logits = None
        if self.keep_logits:
            logits = np.stack(self.logits[:n]) if n else np.zeros((0, vocab), np.float32)
        return Generation(
            tokens=list(self.tokens[:n]),
            logprobs=np.asarray(self.logprobs[:n], np.float32),
            finish_reason=self.finish_reason or "length",
            plan=dataclasses.replace(self.plan or RestorePlan.cold(len(self.prompt)), shard=self.shard),
            logits=logits,
            seed=None if self.sampling.greedy else self.seed,
            text=None if self.reader is None else self.reader.text,
            top_logprobs=None if self.sampling.logprobs is None else [list(t) for t in self.top[:n]],
            **self._prompt_fields(),
            choice=self.choice,
            stop_string=None if self.reader is None else self.reader.stop_string,
        )


def check_prompts(prompts, max_new_tokens, *, max_context: int, vocab_size: int) -> tuple[list[list[int]], int]:
    """Check a batch of prompts for an engine (`Engine.generate`'s rules).

    Args:
      prompts: a non-empty list of token-id sequences or a 2-D integer array [batch, tokens].
      max_new_tokens: an integer >= 0 (Python or numpy; not a bool).
      max_context: the longest sequence the cache holds; vocab_size: the model's vocabulary.
    Returns:
      (prompts as lists of Python ints, max_new_tokens as an int).
    Raises:
      ValueError: naming the bad value and the allowed range.
    """
    if (
        isinstance(max_new_tokens, (bool, np.bool_))
        or not isinstance(max_new_tokens, (int, np.integer))
        or max_new_tokens < 0
    ):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0 (Python or numpy, not a bool)")
    max_new = int(max_new_tokens)
    if isinstance(prompts, (np.ndarray, jax.Array)):
        if prompts.ndim != 2:
            raise ValueError(f"prompts given as an array must be 2-D [batch, tokens]; got shape {prompts.shape}")
        prompts = list(np.asarray(prompts))
    elif not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"prompts must be a non-empty list of token-id sequences or a 2-D integer array; got "
            f"{type(prompts).__name__}"
        )
    if not prompts:
        raise ValueError("prompts must be a non-empty list of token-id sequences")
    cap, vocab = max_context, vocab_size
    out = []
    for i, p in enumerate(prompts):
        if p is None or isinstance(p, (str, bytes, dict)):
            raise ValueError(f"prompt {i} is a {type(p).__name__}; it must be a sequence of integer token ids")
        try:
            arr = np.asarray(p)
        except (ValueError, TypeError) as e:
            raise ValueError(f"prompt {i} must be a flat sequence of integer token ids (ragged: {e})") from None
        if arr.size == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs >= 1 token")
        if arr.ndim != 1 or arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
            hint = (
                f" (prompts is a batch: one prompt is [[{int(arr)}, ...]], not [{int(arr)}, ...])"
                if arr.ndim == 0 and np.issubdtype(arr.dtype, np.integer)
                else ""
            )
            raise ValueError(
                f"prompt {i} must be a flat sequence of integer token ids; got shape {arr.shape}, "
                f"dtype {arr.dtype}{hint}"
            )
        if arr.size + max_new > cap:
            raise ValueError(
                f"prompt {i}: {arr.size} tokens + max_new_tokens={max_new} = {arr.size + max_new} "
                f"exceeds max_context={cap}"
            )
        if arr.min() < 0 or arr.max() >= vocab:
            raise ValueError(
                f"prompt {i}: token ids range [{arr.min()}, {arr.max()}] must lie in [0, vocab_size={vocab})"
            )
        out.append(arr.tolist())
    return out, max_new


def check_request_options(
    sampling, stop_token_ids, return_logits, *, vocab_size: int
) -> tuple[SamplingParams, tuple[int, ...]]:
    """Check a request's options (`Engine.generate`'s rules).

    Returns:
      (sampling, GREEDY for None; the stop ids as a tuple of distinct ints).
    Raises:
      ValueError: naming the bad value.
    """
    if sampling is None:
        sampling = GREEDY
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling={sampling!r} must be an hkv.SamplingParams or None")
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (Sequence, np.ndarray, set)):
        raise ValueError(f"stop_token_ids={stop_token_ids!r} must be a sequence of token ids")
    vocab = vocab_size
    stops = []
    for t in stop_token_ids:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
            raise ValueError(f"stop token id {t!r} must be an integer in [0, vocab_size={vocab})")
        stops.append(int(t))
    if not isinstance(return_logits, (bool, np.bool_)):
        raise ValueError(f"return_logits={return_logits!r} must be a bool")
    return sampling, tuple(dict.fromkeys(stops))
