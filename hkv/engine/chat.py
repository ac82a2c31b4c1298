"""Chat templates: a list of `{"role", "content"}` messages rendered to one prompt string, the way
Hugging Face tokenizers do it (`transformers`' `apply_chat_template`).

    template = ChatTemplate.from_pretrained("/path/to/checkpoint")   # None when the folder has none
    prompt = template.render([{"role": "user", "content": "Hi"}])    # add_generation_prompt=True
    ids = codec.encode([prompt])[0]

A template is a jinja2 source, compiled as transformers compiles it: an `ImmutableSandboxedEnvironment`
with `trim_blocks=True, lstrip_blocks=True`, the `loopcontrols` extension, a `tojson` filter that keeps
non-ASCII text (`ensure_ascii=False`), the globals `raise_exception(message)` and `strftime_now(format)`,
and `{% generation %}` blocks rendered as their body. It sees the variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token` and any extra keyword given to `render` (`tools`,
`documents`, a template's own switches).

Messages are checked before rendering (`check_messages`): each is a dict with a `role` in `ROLES` and a
`content` that is a string or a list of `{"type": "text", "text": str}` parts (the parts are joined
with newlines, as vLLM does for text-only models); an assistant message with `tool_calls` may have no
content. Other keys (`name`, `tool_call_id`, `tool_calls`) are passed to the template unchanged. A bad
message is a `ValueError` naming its index and field.

`jinja2` is an optional dependency (`pip install 'hkv[text]'`), imported when a template is compiled.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .text import TextCodec, read_json, token_string

__all__ = ["ROLES", "TINY_CHAT_TEMPLATE", "ChatTemplate", "check_messages", "tiny_chat_template"]

ROLES = ("system", "user", "assistant", "tool")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # newer transformers save the template here, not in tokenizer_config.json

# The built-in template of the tiny random-weight models (`hkv serve tiny-deepseek-v4`): plain ASCII
# markers that `hkv.engine.text.tiny_tokenizer` encodes at any vocabulary size, e.g.
# "<s><|system|>Be brief.\n<|user|>Hi\n<|assistant|>".
TINY_CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _jinja2():
    """The `jinja2` module, imported on first use (an optional dependency)."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as e:  # pragma: no cover - the text and test extras install it
        raise ImportError("chat templates need jinja2: pip install 'hkv[text]' (or pip install jinja2)") from e
    return jinja2


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    """transformers' `tojson` filter: json.dumps keeping non-ASCII characters by default."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    """A template's `raise_exception(message)`: the template refuses its input."""
    raise _jinja2().exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _generation_extension():
    """A jinja2 extension that parses `{% generation %}...{% endgeneration %}` (transformers marks the
    assistant's tokens with it) and renders the body unchanged."""
    jinja2 = _jinja2()

    class GenerationBlocks(jinja2.ext.Extension):
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return GenerationBlocks


def _compile(source: str, where: str):
    """The compiled jinja2 template of `source`; a ValueError naming `where` and the line for bad syntax."""
    jinja2 = _jinja2()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _generation_extension()]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"{where}: the chat template is not valid jinja2 (line {e.lineno}: {e.message})") from e


def _content(i: int, message: Mapping[str, Any]) -> str | None:
    """messages[i]'s content as a string (text parts joined by newlines); None only where allowed."""
    content = message.get("content")
    if content is None:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            return None
        raise ValueError(f"messages[{i}].content is missing; it must be a string or a list of text parts")
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
        raise ValueError(
            f"messages[{i}].content must be a string or a list of {{'type': 'text', 'text': ...}} parts, "
            f"got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ValueError(
                f"messages[{i}].content[{j}] must be a {{'type': 'text', 'text': ...}} dict, got {part!r:.60}"
            )
        if part.get("type") != "text":
            raise ValueError(
                f"messages[{i}].content[{j}].type={part.get('type')!r}: only 'text' parts are supported "
                "(this server serves text-only models)"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}].content[{j}].text must be a string, got {part.get('text')!r:.60}")
        texts.append(part["text"])
    return "\n".join(texts)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and normalise their content to strings.

    Args:
        messages: a non-empty list of dicts, each with `role` (one of `ROLES`) and `content` (a string,
            or a list of `{"type": "text", "text": str}` parts; None allowed only for an assistant message
            with `tool_calls`). Other keys are kept.

    Returns:
        New dicts (the input is not changed), each content a string (parts joined by newlines) or None.

    Raises:
        ValueError: naming the bad message's index and field, e.g. `messages[1].role='robot' must be one
            of ('system', 'user', 'assistant', 'tool')`.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must hold at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r} must be one of {ROLES}")
        out.append({**m, "content": _content(i, m)})
    return out


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A jinja2 chat template with the special tokens it may use.

    Args:
        source: the template's jinja2 source (compiled at construction: bad syntax is a ValueError).
        bos_token: the value of the template's `bos_token` variable (None renders as "").
        eos_token: the value of `eos_token` (None renders as "").
        origin: where the template came from, for error messages (a file path, "built-in").

    Raises:
        ValueError: the source is not a string or not valid jinja2 (naming `origin` and the line).
    """

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    origin: str = "chat template"
    _compiled: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"{self.origin}: a chat template must be a non-empty string, got {self.source!r:.60}")
        for name in ("bos_token", "eos_token"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{self.origin}: {name}={value!r} must be a string or None")
        object.__setattr__(self, "_compiled", _compile(self.source, self.origin))

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text of a conversation.

        Args:
            messages: the conversation (see `check_messages`).
            add_generation_prompt: end with the marker that starts the assistant's reply.
            **kwargs: further template variables (e.g. `tools`, `documents`, a template's own switches);
                they may override `bos_token` / `eos_token`.

        Returns:
            The rendered prompt string (encode it with the model's tokenizer).

        Raises:
            ValueError: a bad message (index and field named), or the template refused the conversation
                (its `raise_exception` message, e.g. "Conversation roles must alternate").
        """
        jinja2 = _jinja2()
        msgs = check_messages(messages)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        try:
            return self._compiled.render(messages=msgs, add_generation_prompt=bool(add_generation_prompt), **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"{self.origin}: the chat template refused the messages: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:  # e.g. None + str in the template
            raise ValueError(f"{self.origin}: the chat template failed on the messages: {type(e).__name__}: {e}") from e

    def encode(
        self, codec: TextCodec, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **kwargs
    ) -> list[int]:
        """The prompt token ids of a conversation: `render`, then tokenized as transformers'
        `apply_chat_template(tokenize=True)` does, without the tokenizer's own special tokens (the
        template writes BOS itself when the model wants one, so it is never doubled).

        Args:
            codec: the model's tokenizer.
            messages, add_generation_prompt, **kwargs: as for `render`.

        Returns:
            The token ids.

        Raises:
            ValueError: as `render`, or the conversation renders to no tokens.
        """
        text = self.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        ids = list(codec.tokenizer.encode(text, add_special_tokens=False).ids)
        if not ids:
            raise ValueError(f"{self.origin}: the messages render to {text!r:.60}, which encodes to no tokens")
        return ids

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], *, origin: str = TOKENIZER_CONFIG_FILE, name: str = "default"
    ) -> ChatTemplate | None:
        """The template of a tokenizer_config.json's contents.

        Args:
            config: the parsed tokenizer_config.json: `chat_template` (a string, or a list of
                `{"name", "template"}`), `bos_token` and `eos_token` (a string or `{"content": str}`).
            origin: the file it came from (for error messages).
            name: which template of a list to take.

        Returns:
            The template, or None when `config` has no `chat_template`.

        Raises:
            ValueError: a malformed `chat_template`, no template called `name` in the list, or a bad
                special token.
        """
        raw = config.get("chat_template")
        if raw is None:
            return None
        source = _pick(raw, origin, name)
        bos = token_string(config.get("bos_token"), "bos_token", origin)
        eos = token_string(config.get("eos_token"), "eos_token", origin)
        return cls(source, bos_token=bos, eos_token=eos, origin=origin)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, *, name: str = "default") -> ChatTemplate | None:
        """The chat template of a Hugging Face checkpoint (or tokenizer) folder.

        Reads `folder/chat_template.jinja` when present, else `chat_template` from
        `folder/tokenizer_config.json`; the special tokens come from tokenizer_config.json either way.

        Args:
            folder: the checkpoint folder.
            name: which template to take when tokenizer_config.json holds a list of named templates.

        Returns:
            The template, or None when the folder has none.

        Raises:
            FileNotFoundError: `folder` is not a directory.
            ValueError: an unreadable or malformed file (naming it).
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
        cfg_path = folder / TOKENIZER_CONFIG_FILE
        config = read_json(cfg_path) if cfg_path.is_file() else {}
        jinja_path = folder / TEMPLATE_FILE
        if jinja_path.is_file():
            try:
                source = jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read {jinja_path}: {e}") from e
            config = {**config, "chat_template": source}
            return cls.from_config(config, origin=str(jinja_path), name=name)
        return cls.from_config(config, origin=str(cfg_path), name=name)


def _pick(raw: Any, origin: str, name: str) -> str:
    """The template source of a `chat_template` value: a string, or the `name` entry of a list."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise ValueError(
            f"{origin}: chat_template must be a string or a list of {{'name', 'template'}}, got {type(raw).__name__}"
        )
    named = {}
    for i, entry in enumerate(raw):
        if not (
            isinstance(entry, Mapping) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)
        ):
            raise ValueError(
                f"{origin}: chat_template[{i}] must be {{'name': str, 'template': str}}, got {entry!r:.80}"
            )
        named[entry["name"]] = entry["template"]
    if name not in named:
        raise ValueError(f"{origin}: no chat template named {name!r}; the file has {sorted(named)}")
    return named[name]


def tiny_chat_template(bos_token: str | None = "<s>", eos_token: str | None = "</s>") -> ChatTemplate:
    """The built-in template of the tiny random-weight models (`TINY_CHAT_TEMPLATE`).

    Args:
        bos_token, eos_token: the special tokens (`hkv.engine.text.tiny_tokenizer`'s by default).

    Returns:
        The template: `<s><|system|>...\\n<|user|>...\\n<|assistant|>`.
    """
    return ChatTemplate(TINY_CHAT_TEMPLATE, bos_token=bos_token, eos_token=eos_token, origin="built-in tiny template")
