"""From a user's call to the requests the scheduler runs: prompts, budgets, per-prompt sampling,
stop ids and strings, `n` choices — checked in the user's terms before anything runs.

`Intake.requests(...)` is what `Engine.generate`, `submit`, `submit_choices`, `generate_text` and
`chat` (and a `MeshEngine`'s) call: it returns one `RequestSpec` per request (a prompt's choices in
order), or raises `ValueError` naming the bad value, so a bad call never half-queues. `Intake.live`
turns a spec into the scheduler's `LiveRequest` with its text reader (engines with a tokenizer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..core.sampling import GREEDY, SEED_RANGE, SamplingParams
from .chat import ChatTemplate
from .requests import LiveRequest, RequestHandle, check_prompts
from .text import StopStrings, TextCodec, encode_texts


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request to queue, checked.

    Attributes:
      source: the index of its prompt in the call.
      choice: which of the prompt's `n` completions it is.
      prompt: token ids; max_new: its new-token budget.
      sampling: its settings; seed: the resolved seed (choice i of a seeded prompt: seed + i).
      stop_ids: the ids that end it (the call's, its sampling's, and end-of-sequence ids of a text
        request unless `ignore_eos`).
      keep_logits: return its logits.
    """

    source: int
    choice: int
    prompt: list[int]
    max_new: int
    sampling: SamplingParams
    seed: int
    stop_ids: tuple[int, ...]
    keep_logits: bool


def per_prompt(sampling, n_prompts: int) -> list[SamplingParams]:
    """None / one `SamplingParams` / a list of them (one per prompt) -> one per prompt."""
    if sampling is None:
        return [GREEDY] * n_prompts
    if isinstance(sampling, SamplingParams):
        return [sampling] * n_prompts
    if isinstance(sampling, (list, tuple)):
        if len(sampling) != n_prompts:
            raise ValueError(f"sampling is a list of {len(sampling)} settings for {n_prompts} prompts (one each)")
        for i, s in enumerate(sampling):
            if not isinstance(s, SamplingParams):
                raise ValueError(f"sampling[{i}]={s!r} must be an hkv.SamplingParams")
        return list(sampling)
    raise ValueError(f"sampling={sampling!r} must be an hkv.SamplingParams, a list of them (one per prompt), or None")


def _budgets(max_new_tokens, rows: list[SamplingParams]) -> list[int | None]:
    """Each prompt's budget: the call's max_new_tokens, or its `SamplingParams.max_tokens`."""
    out = []
    for i, s in enumerate(rows):
        if max_new_tokens is None:
            if s.max_tokens is None:
                raise ValueError(
                    f"prompt {i}: no new-token budget: pass max_new_tokens or set SamplingParams(max_tokens=...)"
                )
            out.append(s.max_tokens)
        else:
            if s.max_tokens is not None and s.max_tokens != max_new_tokens:
                raise ValueError(
                    f"prompt {i}: max_new_tokens={max_new_tokens!r} and SamplingParams.max_tokens={s.max_tokens} "
                    "disagree (give one)"
                )
            out.append(max_new_tokens)
    return out


class Intake:
    """Checks calls against one engine's limits and builds its requests.

    Args:
      max_context: the longest sequence the cache holds; vocab_size: the model's vocabulary.
      tokenizer: the engine's `TextCodec` (None: token ids only — text, stop strings and chat refused).
      draw_seed: the engine's seed generator (called once per request that needs a seed).
      engine: the class name errors mention.
    """

    def __init__(self, *, max_context: int, vocab_size: int, tokenizer: TextCodec | None,
                 draw_seed: Callable[[SamplingParams], int], engine: str = "hkv.Engine"):  # fmt: skip
        self.max_context, self.vocab_size, self.tokenizer = max_context, vocab_size, tokenizer
        self.draw_seed, self.engine = draw_seed, engine

    def encode(self, texts) -> list[list[int]]:
        """Token ids of a non-empty list of strings (`ValueError` without a tokenizer or for a text
        that encodes to nothing)."""
        if self.tokenizer is None:
            raise ValueError(f"text prompts need a tokenizer: {self.engine}(..., tokenizer=<checkpoint folder>)")
        return encode_texts(self.tokenizer, texts)

    def requests(self, prompts, max_new_tokens, sampling=None, stop_token_ids=(), return_logits=False, *,
                 text: bool = False) -> list[RequestSpec]:  # fmt: skip
        """Check a call and return its requests (each prompt's `n` choices in order).

        Args:
          prompts: a non-empty list of token-id sequences (or a 2-D integer array).
          max_new_tokens: an integer >= 0, or None to take each prompt's `SamplingParams.max_tokens`.
          sampling: None (greedy), one `SamplingParams` for every prompt, or a list (one per prompt).
          stop_token_ids: ids that end every request (with each sampling's own `stop_token_ids`).
          return_logits: keep each token's logits.
          text: the prompts came as text (stop at the tokenizer's end-of-sequence ids unless
            `ignore_eos`).
        Raises:
          ValueError: naming the bad value and the allowed range.
        """
        n_prompts = len(prompts) if isinstance(prompts, (list, tuple, np.ndarray)) else 0
        rows = per_prompt(sampling, max(n_prompts, 1))
        budgets = _budgets(max_new_tokens, rows)
        if len(set(budgets)) <= 1:
            prompts, _ = check_prompts(prompts, budgets[0], max_context=self.max_context, vocab_size=self.vocab_size)
        else:
            checked = [check_prompts([p], m, max_context=self.max_context, vocab_size=self.vocab_size)[0][0]
                       for p, m in zip(prompts, budgets, strict=True)]  # fmt: skip
            prompts = checked
        if len(rows) != len(prompts):  # (a single SamplingParams expanded before the prompts were counted)
            rows, budgets = rows[:1] * len(prompts), budgets[:1] * len(prompts)
        common = self._ids(stop_token_ids, "stop_token_ids")
        if not isinstance(return_logits, (bool, np.bool_)):
            raise ValueError(f"return_logits={return_logits!r} must be a bool")
        out = []
        for i, (p, m, s) in enumerate(zip(prompts, budgets, rows, strict=True)):
            stops = self._stops(s, common, text, i)
            for c in range(s.n):
                seed = (s.seed + c) % SEED_RANGE if s.seed is not None else self.draw_seed(s)
                out.append(RequestSpec(i, c, p, int(m), s, seed, stops, bool(return_logits)))
        return out

    def _ids(self, ids, what: str) -> tuple[int, ...]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray, set, frozenset)):
            raise ValueError(f"{what}={ids!r} must be a sequence of token ids")
        out = []
        for t in ids:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or not 0 <= t < self.vocab_size:
                raise ValueError(f"stop token id {t!r} must be an integer in [0, vocab_size={self.vocab_size})")
            out.append(int(t))
        return tuple(out)

    def _stops(self, s: SamplingParams, common: tuple[int, ...], text: bool, i: int) -> tuple[int, ...]:
        """The stop ids of prompt i's requests; checks what needs the vocabulary or a tokenizer."""
        own = self._ids(s.stop_token_ids, f"prompt {i}: SamplingParams.stop_token_ids")
        for t in s.logit_bias:
            if t >= self.vocab_size:
                raise ValueError(f"prompt {i}: logit_bias id {t} must lie in [0, vocab_size={self.vocab_size})")
        if s.stop and self.tokenizer is None:
            raise ValueError(
                f"prompt {i}: stop strings {list(s.stop)!r} need a tokenizer: {self.engine}(..., tokenizer=...)"
            )
        eos = self.tokenizer.eos_token_ids if (text and self.tokenizer is not None and not s.ignore_eos) else ()
        return tuple(dict.fromkeys(common + own + tuple(eos)))

    def live(self, spec: RequestSpec, index: int, *, handle: RequestHandle | None = None,
             shard: int | None = None) -> LiveRequest:  # fmt: skip
        """The scheduler's request for `spec` (with a text reader when the engine has a tokenizer)."""
        reader = None
        if self.tokenizer is not None:
            s = spec.sampling
            reader = StopStrings(self.tokenizer, s.stop, include_stop=s.include_stop_str_in_output,
                                 skip_special_tokens=s.skip_special_tokens, vocab_size=self.vocab_size,
                                 context=spec.prompt)  # fmt: skip
        return LiveRequest(index, spec.prompt, spec.max_new, spec.sampling, spec.seed, spec.stop_ids,
                           spec.keep_logits, handle, shard=shard, reader=reader, choice=spec.choice)  # fmt: skip


def link_choices(specs: list[RequestSpec], seqs: list[LiveRequest]) -> None:
    """Point each later choice of a prompt at its first (`LiveRequest.leader`): it waits for that
    prefill, then restores it from the prefix cache."""
    first: dict[int, LiveRequest] = {}
    for spec, seq in zip(specs, seqs, strict=True):
        if spec.choice == 0:
            first[spec.source] = seq
        else:
            seq.leader = first.get(spec.source)


def chat_prompts(template: ChatTemplate | None, codec: TextCodec | None, messages, **template_kwargs) -> list:
    """The prompt ids of one conversation (a list of message dicts) or of several (a list of them),
    rendered by `template` and encoded with `codec` (`Engine.chat`).

    Raises:
      ValueError: no tokenizer or template, or a bad message (its index and field named).
    """
    if codec is None or template is None:
        raise ValueError(
            "chat needs a tokenizer and a chat template: hkv.Engine(..., tokenizer=<checkpoint folder>, "
            "chat_template=<ChatTemplate or folder>) or chat(..., template=...)"
        )
    one = isinstance(messages, (list, tuple)) and (not messages or isinstance(messages[0], Mapping))
    convs = [messages] if one else list(messages)
    return [template.encode(codec, conv, **template_kwargs) for conv in convs]
