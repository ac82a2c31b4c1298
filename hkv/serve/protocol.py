"""The OpenAI API's request bodies (pydantic models) and error body, as `hkv serve` accepts them.

`CompletionRequest` is `POST /v1/completions`'s body and `ChatCompletionRequest` `POST
/v1/chat/completions`'s, with the OpenAI fields and vLLM's extensions (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`; chat: `add_generation_prompt`, `chat_template_kwargs`). Unknown fields are
ignored (clients send `user`, `metadata`, ...); fields the server cannot honour (`echo`, `suffix`,
`tools`, a JSON `response_format`, ...) are accepted by the schema and refused with a 400 naming them
(`hkv.serve.params`). Ranges are checked by `hkv.SamplingParams` and by `hkv.serve.params`, so every
error names the field the way the OpenAI API does (`param`).

`ApiError` is what every error response carries: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ApiError", "ChatCompletionRequest", "CompletionRequest", "StreamOptions"]


@dataclasses.dataclass(eq=False)  # (hashable, as exceptions are)
class ApiError(Exception):
    """An error answered with the OpenAI error body.

    Attributes:
      message: what is wrong, naming the bad value and what is allowed.
      status: the HTTP status (400 bad input, 404 unknown model, 429 queue full, 503 shutting down).
      param: the request field at fault (None: none in particular).
      type: the OpenAI error type ("invalid_request_error", "rate_limit_error", "server_error").
      code: a machine-readable code (e.g. "model_not_found", "rate_limit_exceeded"), or None.
    """

    message: str
    status: int = 400
    param: str | None = None
    type: str = "invalid_request_error"
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a last chunk with the usage and no choices."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share (OpenAI's, then vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None  # None: the OpenAI default, 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(_Sampling):
    """`POST /v1/completions`.

    `prompt` is a string, a list of strings, a list of token ids or a list of token-id lists; each
    prompt gets `n` choices (choice index = prompt index * n + choice). `max_tokens` defaults to 16
    (as OpenAI's); `logprobs` (0-20) asks for that many most likely tokens per generated token.
    `echo`, `suffix` and `best_of` other than `n` are refused with a 400.
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`.

    `messages` are rendered with the model's chat template (`hkv.engine.chat.ChatTemplate`; checked
    there, naming the bad message). `max_tokens` (or `max_completion_tokens`) defaults to what the
    context leaves after the prompt. `logprobs=true` reports each token's logprob, with
    `top_logprobs` (0-20) most likely alternatives. `tools`, `tool_choice` other than "none", and a
    `response_format` other than text are refused with a 400.
    """

    messages: list[Any]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(default=None)
