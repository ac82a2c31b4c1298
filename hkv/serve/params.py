"""From an OpenAI request body to what the engine runs: prompts as token ids, budgets, `hkv.SamplingParams`.

`completion_job` and `chat_job` check a request against the served model (`ServedModel`) and return a
`Job`, or raise `ApiError` (400, the OpenAI error body's `param` naming the field; 404 for another
model's name). `sampling_params` is the one place a request's fields become an `hkv.SamplingParams`.

Defaults follow the OpenAI API: temperature 1.0, top_p 1.0, completions' max_tokens 16; a chat's
max_tokens defaults to what the context leaves after its prompt. The tokenizer's end-of-sequence ids
end every request unless `ignore_eos` (the engine gets token ids, so they are added here).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from hkv import SamplingParams
from hkv.engine.chat import ChatTemplate
from hkv.engine.text import TextCodec

from .protocol import ApiError, ChatCompletionRequest, CompletionRequest

__all__ = ["Job", "ServedModel", "chat_job", "completion_job", "sampling_params"]

OPENAI_TEMPERATURE = 1.0  # the OpenAI API's default temperature
COMPLETION_MAX_TOKENS = 16  # the OpenAI API's default max_tokens for /v1/completions
_FIELD = re.compile(r"SamplingParams\.(\w+)")


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What requests are checked against.

    Attributes:
      name: the model name clients send (`model`).
      codec: its tokenizer.
      chat_template: its chat template (None: /v1/chat/completions is refused).
      max_context: the longest sequence (prompt + completion) the engine holds.
      vocab_size: the model's vocabulary (token-id prompts must lie in it).
    """

    name: str
    codec: TextCodec
    chat_template: ChatTemplate | None
    max_context: int
    vocab_size: int


@dataclasses.dataclass(frozen=True)
class Job:
    """A checked request, ready for the engine.

    Attributes:
      endpoint: "completions" or "chat".
      prompts: each prompt's token ids (a chat has one).
      max_tokens: each prompt's new-token budget.
      sampling: the settings of every prompt (`n` choices each).
      logprobs: top logprobs asked per token (None: no logprobs at all).
      stream: answer with server-sent events.
      include_usage: a streamed answer ends with a usage chunk.
    """

    endpoint: str
    prompts: list[list[int]]
    max_tokens: list[int]
    sampling: SamplingParams
    logprobs: int | None
    stream: bool
    include_usage: bool

    @property
    def n(self) -> int:
        """Choices per prompt."""
        return self.sampling.n

    @property
    def choices(self) -> int:
        """Choices in all (prompts x n)."""
        return len(self.prompts) * self.sampling.n


def _refuse(param: str, message: str) -> ApiError:
    return ApiError(message, param=param)


def _check_model(requested: str, served: ServedModel) -> None:
    if requested != served.name:
        raise ApiError(
            f"The model `{requested}` does not exist; this server serves `{served.name}`.",
            status=404,
            param="model",
            code="model_not_found",
        )


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, *, logprobs: int | None, served: ServedModel, names: dict[str, str]
) -> SamplingParams:
    """The request's `hkv.SamplingParams` (the one mapping from OpenAI fields to hkv's).

    Args:
      req: the request body.
      logprobs: top logprobs per token (None: none).
      served: the model (its end-of-sequence ids join `stop_token_ids` unless `ignore_eos`).
      names: SamplingParams field -> request field, where they differ (for the error's `param`).
    Returns:
      the settings (max_tokens left to the call).
    Raises:
      ApiError: 400 naming the request field SamplingParams refused.
    """
    eos = () if req.ignore_eos else served.codec.eos_token_ids
    try:
        return SamplingParams(
            n=req.n,
            temperature=OPENAI_TEMPERATURE if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.logit_bias,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            stop=req.stop,
            stop_token_ids=tuple(dict.fromkeys([*(req.stop_token_ids or ()), *eos])),
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )
    except ValueError as e:
        m = _FIELD.search(str(e))
        field = m.group(1) if m else None
        param = names.get(field, field)
        msg = str(e).replace(f"SamplingParams.{field}", param) if field else str(e)
        raise _refuse(param, msg) from e


def _budget(prompt: list[int], max_tokens: int | None, served: ServedModel, prompt_param: str) -> int:
    """The new-token budget of a prompt: max_tokens, or (None) what the context leaves."""
    cap, n = served.max_context, len(prompt)
    if max_tokens is None:
        if n >= cap:
            raise _refuse(
                prompt_param,
                f"This model's maximum context length is {cap} tokens. However, your {prompt_param} has {n} tokens, "
                "which leaves no room for a completion. Please reduce the length of the "
                f"{prompt_param}.",
            )
        return cap - n
    if isinstance(max_tokens, bool) or max_tokens < 1:
        raise _refuse("max_tokens", f"max_tokens={max_tokens!r} must be an integer >= 1")
    if n + max_tokens > cap:
        raise _refuse(
            "max_tokens",
            f"This model's maximum context length is {cap} tokens. However, you requested {n + max_tokens} tokens "
            f"({n} in the {prompt_param}, {max_tokens} for the completion). Please reduce the length of the "
            f"{prompt_param} or the max_tokens.",
        )
    return max_tokens


def _prompts(prompt: Any, served: ServedModel) -> list[list[int]]:
    """A completion request's prompts as token ids (strings encoded, ids checked)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise _refuse("prompt", "prompt must be a non-empty string, list of strings, or list of token ids")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            (ids,) = served.codec.encode([p])
        else:
            ids = list(p)
            bad = [t for t in ids if not 0 <= t < served.vocab_size]
            if bad:
                raise _refuse("prompt", f"prompt {i}: token id {bad[0]} must lie in [0, {served.vocab_size})")
        if not ids:
            raise _refuse("prompt", f"prompt {i} is empty (or encodes to no tokens); every prompt needs >= 1 token")
        out.append(ids)
    return out


def _stream_usage(req) -> bool:
    if req.stream_options is not None and not req.stream:
        raise _refuse("stream_options", "stream_options is allowed only with stream=true")
    return bool(req.stream_options and req.stream_options.include_usage)


def completion_job(req: CompletionRequest, served: ServedModel) -> Job:
    """Check a `/v1/completions` request.

    Args:
      req: the body; served: the model.
    Returns:
      the `Job` (one prompt per prompt given, `n` choices each).
    Raises:
      ApiError: 404 another model's name; 400 naming the bad field (unsupported `echo`, `suffix`,
        `best_of`; a prompt too long for the context with max_tokens; a SamplingParams range).
    """
    _check_model(req.model, served)
    if req.echo:
        raise _refuse("echo", "echo=true is not supported by this server")
    if req.suffix:
        raise _refuse("suffix", "suffix is not supported by this server")
    if req.best_of is not None and req.best_of != req.n:
        raise _refuse("best_of", f"best_of={req.best_of} is not supported (only best_of == n)")
    prompts = _prompts(req.prompt, served)
    max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    budgets = [_budget(p, max_tokens, served, "prompt") for p in prompts]
    sampling = sampling_params(req, logprobs=req.logprobs, served=served, names={})
    return Job("completions", prompts, budgets, sampling, req.logprobs, req.stream, _stream_usage(req))


def _refuse_chat_extras(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise _refuse("tools", "tools are not supported by this server")
    if req.functions:
        raise _refuse("functions", "functions are not supported by this server")
    if req.tool_choice not in (None, "none"):
        raise _refuse("tool_choice", f"tool_choice={req.tool_choice!r} is not supported (only 'none')")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise _refuse("response_format", f"response_format={req.response_format!r} is not supported (only text)")
    if req.echo:
        raise _refuse("echo", "echo=true is not supported by this server")
    if req.top_logprobs is not None and not req.logprobs:
        raise _refuse("top_logprobs", "top_logprobs needs logprobs=true")


def chat_job(req: ChatCompletionRequest, served: ServedModel) -> Job:
    """Check a `/v1/chat/completions` request and render its messages with the chat template.

    Args:
      req: the body; served: the model.
    Returns:
      the `Job` (one prompt, `n` choices).
    Raises:
      ApiError: 404 another model's name; 400 naming the bad field (a message, by index and field; no
        chat template; unsupported tools / response_format / echo; too long a conversation; a
        SamplingParams range).
    """
    _check_model(req.model, served)
    _refuse_chat_extras(req)
    if served.chat_template is None:
        raise _refuse(
            "messages", f"the model `{served.name}` has no chat template; use /v1/completions with a prompt instead"
        )
    kwargs = dict(req.chat_template_kwargs or {})
    try:
        ids = served.chat_template.encode(
            served.codec, req.messages, add_generation_prompt=req.add_generation_prompt, **kwargs
        )
    except ValueError as e:
        raise _refuse("messages", str(e)) from e
    except TypeError as e:  # chat_template_kwargs naming messages= or add_generation_prompt= again
        raise _refuse("chat_template_kwargs", f"chat_template_kwargs: {e}") from e
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise _refuse("max_tokens", "give max_tokens or max_completion_tokens, not both")
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    budget = _budget(ids, max_tokens, served, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    sampling = sampling_params(req, logprobs=logprobs, served=served, names={"logprobs": "top_logprobs"})
    return Job("chat", [ids], [budget], sampling, logprobs, req.stream, _stream_usage(req))
