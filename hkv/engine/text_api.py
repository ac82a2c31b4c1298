"""Text in, text out for an engine: `generate_text` and `chat`, shared by `hkv.Engine` and
`hkv.MeshEngine` (`TextMethods`). They encode with the engine's tokenizer (and chat template), check
the call with its `Intake` and run the requests through its `_generate`, so a mesh routes each text to
a shard exactly as `generate` routes token ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ..core.sampling import SamplingParams
from .chat import ChatTemplate
from .intake import chat_prompts, per_prompt
from .requests import Generation
from .text import check_stop_strings


class TextMethods:
    """`generate_text` and `chat` for an engine class that has `_intake()` (an `Intake`),
    `_generate(specs)` (runs checked requests to the end), `tokenizer` and `chat_template`."""

    def generate_text(
        self,
        texts: Sequence[str],
        max_new_tokens: int | None = None,
        *,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        stop: Iterable[str] | None = (),
        stop_token_ids: Sequence[int] | None = None,
        include_stop: bool = False,
    ) -> list[Generation]:
        """Text in, text out (needs `tokenizer=`): each text is encoded, continued and decoded.

        Args:
          texts: a non-empty list of strings.
          max_new_tokens, sampling: as in `generate`.
          stop: strings (any iterable; None = none) that end a text's generation as soon as they appear
            in its decoded output, with each sampling's own `stop`; the request stops there (its slot
            is freed at once) and its text ends before the stop string (with it when include_stop or
            `SamplingParams.include_stop_str_in_output`). Tokens are cut after the one that completed it.
          stop_token_ids: ids that end generation; None = the tokenizer's end-of-sequence ids (unless
            `SamplingParams.ignore_eos`).
        Returns:
          one `Generation` per text (and choice) with `.text` set (finish_reason "stop" for a stop
          string or id; `.stop_string` names the string). An id the tokenizer has no token for (a
          model vocabulary padded past the tokenizer's, as DeepSeek-V4's) stays in `.tokens` and adds
          no text.
        """
        intake = self._intake()
        prompts = intake.encode(texts)
        stop = check_stop_strings(stop)
        rows = [dataclasses.replace(s, stop=s.stop + stop, include_stop_str_in_output=s.include_stop_str_in_output
                                    or bool(include_stop)) for s in per_prompt(sampling, len(prompts))]  # fmt: skip
        if stop_token_ids is None:
            specs = intake.requests(prompts, max_new_tokens, rows, (), text=True)
        else:
            specs = intake.requests(prompts, max_new_tokens, rows, stop_token_ids)
        return self._generate(specs)

    def chat(
        self,
        messages,
        max_new_tokens: int | None = None,
        *,
        sampling: SamplingParams | None = None,
        template: ChatTemplate | None = None,
        **template_kwargs,
    ) -> list[Generation]:
        """Continue a conversation: its messages rendered by the chat template, encoded with the
        engine's tokenizer, and the assistant's reply generated (stopping at the tokenizer's
        end-of-sequence ids unless `SamplingParams.ignore_eos`).

        Args:
          messages: one conversation, a list of {"role", "content"} dicts (`hkv.engine.chat.
            check_messages`), or a list of conversations.
          max_new_tokens, sampling: as in `generate` (one `SamplingParams`, or one per conversation).
          template: the `ChatTemplate` to use; None: `Engine(chat_template=...)`'s, or the one of the
            tokenizer's checkpoint folder.
          template_kwargs: further template variables (e.g. `tools`).
        Returns:
          one `Generation` per conversation (and choice), with `.text` the reply.
        Raises:
          ValueError: no tokenizer or template, or a bad message (its index and field named).
        """
        prompts = chat_prompts(template or self.chat_template, self.tokenizer, messages, **template_kwargs)
        return self._generate(self._intake().requests(prompts, max_new_tokens, sampling, (), text=True))
