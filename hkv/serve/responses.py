"""The OpenAI response bodies and stream chunks, built from the engine's `Generation`s and `TokenOutput`s.

`Responder` holds what every body of one request shares (id, creation time, model name, endpoint) and
builds: the whole answer (`body`), one streamed chunk (`chunk`), the role chunk a chat stream starts
with (`role_chunk`), and the usage chunk (`usage_chunk`). Logprobs follow the OpenAI formats:
completions `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}` (each
dict holds the top-N and the chosen token, so up to N+1 entries); chat `{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}` (exactly the top-N).

A token's text is its own decoding with special tokens kept; a token that is only part of a character
(it decodes to U+FFFD) is shown as `bytes:\\xNN...`, as the OpenAI API does, and chat's `bytes` are
the bytes it stands for.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

from hkv import Generation
from hkv.engine.text import TextCodec, bytes_to_unicode

from .params import Job

__all__ = ["Responder", "TokenLogprob", "sse", "token_bytes", "token_text", "usage"]


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its logprob and its most likely alternatives ((id, logprob) pairs)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of_generation(cls, gen: Generation) -> list[TokenLogprob]:
        """Every token of a finished choice."""
        tops = gen.top_logprobs or [()] * len(gen.tokens)
        return [
            cls(int(t), float(lp), tuple((int(i), float(v)) for i, v in top))
            for t, lp, top in zip(gen.tokens, gen.logprobs, tops, strict=True)
        ]

    @classmethod
    def of_outputs(cls, outputs: Sequence[Any]) -> list[TokenLogprob]:
        """The tokens of a streamed update (`hkv.TokenOutput`s)."""
        return [
            cls(int(o.token), float(o.logprob), tuple((int(i), float(v)) for i, v in (o.top_logprobs or ())))
            for o in outputs
        ]


_BYTE_LEVEL = {c: b for b, c in bytes_to_unicode().items()}  # ByteLevel character -> byte
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens (Gemma)


def token_bytes(codec: TextCodec, token: int) -> bytes:
    """A token's bytes: its decoding's UTF-8, or for a token that is only part of a character, the
    bytes it stands for (ByteLevel and `<0xNN>` byte-fallback vocabularies)."""
    if not 0 <= token < codec.vocab_size:
        return b""
    text = codec.decode([token], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text.encode("utf-8")
    raw = codec.tokenizer.id_to_token(token) or ""
    if m := _BYTE_FALLBACK.fullmatch(raw):
        return bytes([int(m.group(1), 16)])
    if raw and all(ch in _BYTE_LEVEL for ch in raw):
        return bytes(_BYTE_LEVEL[ch] for ch in raw)
    return text.encode("utf-8")


def token_text(codec: TextCodec, token: int) -> str:
    """How a token is shown in logprobs: its decoding with special tokens kept; a token that is only
    part of a character as `bytes:\\xNN...` (the OpenAI API's convention); an id past the tokenizer's
    vocabulary as `<token_id:N>`."""
    if not 0 <= token < codec.vocab_size:
        return f"<token_id:{token}>"
    text = codec.decode([token], skip_special_tokens=False)
    if "\ufffd" in text:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes(codec, token))
    return text


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json>` and a blank line (`[DONE]` as is)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(job: Job, gens: dict[int, Generation]) -> dict[str, Any]:
    """The usage of a request: its prompts counted once each, every choice's tokens, and the prompt
    tokens restored from the prefix cache (each prompt's first choice's `plan.restored_tokens`)."""
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(g.tokens) for g in gens.values())
    cached = 0
    for i in range(len(job.prompts)):
        g = gens.get(i * job.n)
        if g is not None and g.plan is not None:
            cached += int(g.plan.restored_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Responder:
    """Builds one request's response bodies and chunks.

    Args:
      job: the request; model: the served model name; codec: its tokenizer (token texts for logprobs).
    """

    def __init__(self, job: Job, model: str, codec: TextCodec):
        self.job, self.model, self.codec = job, model, codec
        self.chat = job.endpoint == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def logprobs(self, tokens: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        """The logprobs object of some tokens (None when the request asked for none).

        Args:
          tokens: the tokens; offset: the completion text's length before them (text_offset).
        """
        if self.job.logprobs is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(t) for t in tokens], "refusal": None}
        texts = [token_text(self.codec, t.token) for t in tokens]
        offsets = []
        for s in texts:
            offsets.append(offset)
            offset += len(s)
        tops = []
        for t, s in zip(tokens, texts, strict=True):
            top = {token_text(self.codec, i): v for i, v in t.top}
            top.setdefault(s, t.logprob)
            tops.append(top)
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entry(self, t: TokenLogprob) -> dict[str, Any]:
        def one(token: int, logprob: float) -> dict[str, Any]:
            s = token_text(self.codec, token)
            return {"token": s, "logprob": logprob, "bytes": list(token_bytes(self.codec, token))}

        return {**one(t.token, t.logprob), "top_logprobs": [one(i, v) for i, v in t.top]}

    def body(self, gens: dict[int, Generation]) -> dict[str, Any]:
        """The whole (not streamed) answer: every choice in index order, and the usage."""
        choices = []
        for i in sorted(gens):
            g = gens[i]
            lp = self.logprobs(TokenLogprob.of_generation(g))
            if self.chat:
                message = {"role": "assistant", "content": g.text or ""}
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": g.finish_reason})
            else:
                choices.append({"index": i, "text": g.text or "", "logprobs": lp, "finish_reason": g.finish_reason})
        return {**self._head(False), "choices": choices, "usage": usage(self.job, gens)}

    def chunk(
        self, index: int, text: str, tokens: Sequence[TokenLogprob] = (), offset: int = 0, finish: str | None = None
    ) -> dict[str, Any]:
        """One streamed chunk of choice `index`: its new text, its tokens' logprobs, and its finish reason
        on the last one."""
        lp = self.logprobs(tokens, offset) if tokens else None
        if self.chat:
            delta = {"content": text} if text or finish is None else {}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}

    def role_chunk(self, index: int) -> dict[str, Any]:
        """A chat stream's first chunk of a choice: the assistant role, empty content."""
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, gens: dict[int, Generation]) -> dict[str, Any]:
        """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage(self.job, gens)}
