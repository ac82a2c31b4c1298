"""The text layer: text in, text out over hkv's token-id engine, with a `tokenizers` tokenizer.json.

Token ids stay the core interface (`Engine.generate`); this module only converts at the edges:

    TextCodec        wraps a `tokenizers.Tokenizer`: encode prompts, decode ids, BOS / EOS settings.
                     `TextCodec.from_pretrained(folder)` reads a checkpoint folder's tokenizer.json.
    StopStrings      incremental detokenizer for streaming, with stop strings: feed generated ids,
                     get the text that is safe to emit; reports where a stop string ended generation.
    TextDelta        what `StopStrings.feed` / `finish` return.
    tiny_tokenizer   a deterministic in-memory byte-level BPE tokenizer for tests and demos.

`tokenizers` is an optional dependency (`pip install 'hkv[text]'`); it is imported when a tokenizer is
built or read, not when this module is imported.

Stop strings (see `StopStrings`): the output is cut before the stop string (the stop string itself is
excluded, like vLLM's default; `include_stop=True` keeps it), and `consumed` counts the token ids up to
and including the one whose text completed the stop string — `ids[:consumed]` is what a caller keeps.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode writes for bytes that are not (yet) a character
CONTEXT_TOKENS = 6  # prompt ids `StopStrings` decodes before the first generated one (as TGI's 5)


def _tokenizers():
    """The `tokenizers` module, imported on first use (it is an optional dependency)."""
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ImportError(
            "hkv.engine.text needs the `tokenizers` library: pip install 'hkv[text]' (or pip install tokenizers)"
        ) from e
    return tokenizers


def token_string(value: Any, what: str, source: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, {"content": str, ...}, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{source}: {what} must be a string, {{'content': string}} or null, got {value!r}")


def read_json(path: Path) -> dict:
    """A JSON object from a file (`ValueError` naming the file when unreadable or not an object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


# Input errors are ValueErrors naming the bad value, across hkv (hence the TRY004 exemptions below).


def _check_id(value: Any, what: str, vocab_size: int) -> int:
    """`value` as an int token id in [0, vocab_size), or a ValueError naming it."""
    try:
        i = operator.index(value)
    except TypeError:
        raise ValueError(f"{what}={value!r} must be an int token id") from None
    if not 0 <= i < vocab_size:
        raise ValueError(f"{what}={i} must lie in [0, vocab_size={vocab_size})")
    return i


class TextCodec:
    """A `tokenizers.Tokenizer` with the settings generation needs: BOS on encode, EOS ids, vocab size.

    Args:
        tokenizer: the `tokenizers.Tokenizer` to wrap.
        bos_token: the beginning-of-sequence token (a token string in the vocabulary), or None.
        eos_tokens: end-of-sequence token strings (each must be in the vocabulary).
        eos_token_ids: further end-of-sequence token ids (e.g. generation_config.json's eos_token_id).
        add_bos: prepend `bos_token`'s id to every encoded prompt that does not already start with it
            (the tokenizer.json's own post-processor may already add it; it is never doubled).

    Raises:
        ValueError: a token string not in the vocabulary, an id outside [0, vocab_size), or add_bos
            without a bos_token.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        eos_token_ids: Sequence[int] = (),
        add_bos: bool = False,
    ):
        self._tok = tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        self.bos_token = bos_token
        self.bos_token_id = self._id_of(bos_token, "bos_token") if bos_token is not None else None
        if add_bos and self.bos_token_id is None:
            raise ValueError("add_bos=True needs a bos_token, got bos_token=None")
        self.add_bos = bool(add_bos)
        if isinstance(eos_tokens, str):
            eos_tokens = (eos_tokens,)
        ids = [self._id_of(t, f"eos_tokens[{i}]") for i, t in enumerate(eos_tokens)]
        for i, t in enumerate(eos_token_ids):
            ids.append(self._check_id(t, f"eos_token_ids[{i}]"))
        self._eos = tuple(dict.fromkeys(ids))  # ordered, without duplicates

    def _id_of(self, token: str, what: str) -> int:
        i = self._tok.token_to_id(token) if isinstance(token, str) else None
        if i is None:
            raise ValueError(f"{what}={token!r} is not a token of this tokenizer")
        return i

    def _check_id(self, value: Any, what: str) -> int:
        return _check_id(value, what, self._vocab_size)

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        *,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        eos_token_ids: Sequence[int] = (),
        add_bos: bool = False,
    ) -> TextCodec:
        """Read a tokenizer.json file.

        Args:
            path: the tokenizer.json file.
            bos_token, eos_tokens, eos_token_ids, add_bos: as for `TextCodec`.

        Returns:
            The codec.

        Raises:
            FileNotFoundError: `path` is not a file.
            ValueError: the file is not a tokenizer `tokenizers` can read, or a bad setting.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        try:
            tok = _tokenizers().Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"cannot read tokenizer {str(path)!r}: {e}") from e
        return cls(tok, bos_token=bos_token, eos_tokens=eos_tokens, eos_token_ids=eos_token_ids, add_bos=add_bos)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> TextCodec:
        """Read a checkpoint folder's tokenizer, the way Hugging Face folders lay it out.

        Reads `folder/tokenizer.json` (required). Optional, when present:
          * `tokenizer_config.json`: `bos_token`, `eos_token` (a string or {"content": string}) and
            `add_bos_token` (bool, default false);
          * `generation_config.json`: `eos_token_id` (an int or a list of ints), added to the EOS ids.
        Nothing else in those files is read (no chat template, no normalization flags).

        Args:
            folder: the checkpoint folder.

        Returns:
            The codec.

        Raises:
            FileNotFoundError: the folder does not exist or has no tokenizer.json.
            ValueError: a config file is unreadable or names a token that is not in the tokenizer.
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist (looked for {TOKENIZER_FILE})")
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {str(folder)!r}: the text layer needs a `tokenizers` tokenizer.json "
                f"(looked for {str(path)!r}); pass token ids to Engine.generate instead"
            )
        bos, eos, add_bos, eos_ids = None, [], False, []
        cfg_path = folder / TOKENIZER_CONFIG_FILE
        if cfg_path.is_file():
            cfg = read_json(cfg_path)
            bos = token_string(cfg.get("bos_token"), "bos_token", str(cfg_path))
            e = token_string(cfg.get("eos_token"), "eos_token", str(cfg_path))
            eos = [e] if e is not None else []
            add_bos = cfg.get("add_bos_token", False)
            if not isinstance(add_bos, bool):
                raise ValueError(f"{cfg_path}: add_bos_token must be true or false, got {add_bos!r}")
            add_bos = add_bos and bos is not None
        gen_path = folder / GENERATION_CONFIG_FILE
        if gen_path.is_file():
            e = read_json(gen_path).get("eos_token_id")
            eos_ids = [] if e is None else list(e) if isinstance(e, list) else [e]
        try:
            return cls.from_file(path, bos_token=bos, eos_tokens=eos, eos_token_ids=eos_ids, add_bos=add_bos)
        except ValueError as err:
            raise ValueError(f"{str(folder)!r}: {err}") from err

    def save(self, folder: str | os.PathLike) -> Path:
        """Write `tokenizer.json` and `tokenizer_config.json` into `folder` (created if missing), so
        that `TextCodec.from_pretrained(folder)` reads this codec back.

        tokenizer_config.json holds `bos_token`, `eos_token` (the first EOS id's token) and
        `add_bos_token`; further EOS ids are not written (HF folders keep them in generation_config.json).

        Args:
            folder: the folder to write into; existing files of those two names are replaced.

        Returns:
            The folder.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(folder / TOKENIZER_FILE))
        eos = self._tok.id_to_token(self._eos[0]) if self._eos else None
        cfg = {"bos_token": self.bos_token, "eos_token": eos, "add_bos_token": self.add_bos}
        (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        return folder

    @property
    def tokenizer(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """One more than the largest token id of the tokenizer (added tokens included)."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence token ids (possibly empty), in configuration order."""
        return self._eos

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (the tokenizer's own special tokens, then BOS if `add_bos`).

        Args:
            texts: a list (or tuple) of strings; a bare string is refused (it is not a batch).

        Returns:
            One list of int token ids per text.

        Raises:
            ValueError: `texts` is a string or not a sequence, or texts[i] is not a str.
        """
        if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
            got = f"{type(texts).__name__}: {texts!r:.60}"
            raise ValueError(f"texts must be a list of strings, got {got}")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(f"texts[{i}] must be a str, got {type(t).__name__}: {t!r:.60}")
        out = [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=True)]
        if self.add_bos:
            out = [ids if ids[:1] == [self.bos_token_id] else [self.bos_token_id, *ids] for ids in out]
        return out

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """The text of a token id sequence (undecodable bytes become U+FFFD).

        Args:
            ids: token ids (ints, numpy ints, a 1-D numpy array).
            skip_special_tokens: leave special tokens (BOS, EOS, ...) out of the text.

        Returns:
            The text.

        Raises:
            ValueError: ids[i] is not an int or is outside [0, vocab_size).
        """
        checked = [self._check_id(t, f"ids[{i}]") for i, t in enumerate(ids)]
        return self._decode(checked, skip_special_tokens)

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


@dataclasses.dataclass(frozen=True)
class TextDelta:
    """What `StopStrings.feed` / `StopStrings.finish` return.

    Attributes:
        text: the newly emitted text (possibly empty): append it to what was emitted before.
        stopped: a stop string has been found; generation should end (nothing more will be emitted).
        consumed: token ids consumed since the stream began; once stopped, up to and including the
            token whose text completed the stop string (ids fed after it are not consumed).
    """

    text: str
    stopped: bool
    consumed: int


class StopStrings:
    """Incremental detokenization with stop strings: feed generated token ids, emit text as it becomes
    final.

    Detokenization decodes a small window of the ids and diffs it against the window's already-read
    part (the "prefix offset / read offset" scheme of HF text-generation-inference), so each token
    costs O(1) decoding and decoders that depend on context (a leading space) stay right. Text that
    ends in U+FFFD — bytes of a character split across tokens — is held back until the character is
    complete, so a multi-byte character is never emitted as a broken U+FFFD; genuinely invalid bytes
    are emitted as U+FFFD once a later character (or `finish`) shows they are not a partial one. For
    byte-level tokenizers the concatenation of all emitted text equals `codec.decode(ids)`.

    Stop strings: after each token the not-yet-emitted text is searched for every stop string; the
    one that completes first (earliest end; among those, the longest) ends the stream. The final text
    is everything before it — the stop string is excluded (vLLM's default) unless `include_stop` —
    and text after it is dropped. While the tail of the text could still grow into a stop string it
    is held back, and released as soon as it cannot (or by `finish`).

    Args:
        codec: the `TextCodec` to decode with.
        stop: the stop strings (non-empty str each); empty for plain streaming.
        include_stop: keep the stop string at the end of the final text.
        skip_special_tokens: leave special tokens (BOS, EOS, ...) out of the text.
        vocab_size: ids accepted by `feed`: [0, vocab_size). None: the codec's vocab_size. A model
            whose vocabulary is padded past its tokenizer's (DeepSeek-V4) can generate ids the
            tokenizer has no token for: pass the model's vocab_size and those ids decode to no text
            (as `tokenizers` decodes them).
        context: the ids the stream continues (the prompt; its last `CONTEXT_TOKENS` are used), decoded
            before the first generated id and not emitted. Decoders that strip the leading space of
            a text (SentencePiece's Metaspace / Strip) would drop the space of the first generated
            word without it: " fox" after a prompt read "fox", and a stop string " fox" was missed.
            Ignored when those ids do not decode to whole characters.

    Raises:
        ValueError: stop is a bare string, stop[i] is not a non-empty str, or vocab_size is smaller
            than the codec's.
    """

    def __init__(
        self,
        codec: TextCodec,
        stop: Sequence[str] = (),
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        vocab_size: int | None = None,
        context: Sequence[int] = (),
    ):
        if vocab_size is not None and (
            isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < codec.vocab_size
        ):
            msg = f"vocab_size={vocab_size!r} must be None or an int >= the tokenizer's {codec.vocab_size}"
            raise ValueError(msg)
        if isinstance(stop, str):
            msg = f"stop must be a list of strings, got the string {stop!r} (write [{stop!r}])"
            raise ValueError(msg)
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty str, got {s!r}")
        self.codec = codec
        self._vocab = codec.vocab_size if vocab_size is None else vocab_size
        self.stop = tuple(dict.fromkeys(stop))
        self.include_stop = include_stop
        self._skip = skip_special_tokens
        self._hold_max = max((len(s) for s in self.stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (a character boundary)
        self._read = 0  # ids[prefix:read] decode to the first `_prefix_len` chars of the window's text
        self._prefix_len = 0
        self._released = 0  # chars of the window's text past `_prefix_len` already handed on
        self._pending = ""  # decoded text not yet emitted (held back: could start a stop string)
        self._emitted: list[str] = []
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the stream
        self.consumed = 0
        self._finished = False
        ctx = list(context)[-CONTEXT_TOKENS:]
        ctx = [_check_id(t, f"context[{len(context) - len(ctx) + i}]", self._vocab) for i, t in enumerate(ctx)]
        ctx_text = self.codec._decode(ctx, self._skip) if ctx else ""
        if ctx_text and not ctx_text.endswith(_REPLACEMENT):  # whole characters: the window starts there
            self._ids, self._read, self._prefix_len = ctx, len(ctx), len(ctx_text)

    @property
    def text(self) -> str:
        """All text emitted so far (after a stop or `finish`: the final text)."""
        return "".join(self._emitted)

    def feed(self, ids: int | Iterable[int]) -> TextDelta:
        """Consume generated token ids (one id or several, in order) and return the newly final text.

        Args:
            ids: a token id or an iterable of token ids.

        Returns:
            The `TextDelta`: text to emit now, whether a stop string was found, ids consumed in all.
            After a stop, further ids are ignored (empty text, `consumed` unchanged).

        Raises:
            ValueError: an id is not an int in [0, vocab_size).
            RuntimeError: the stream was already finished (`finish`).
        """
        if self._finished:
            raise RuntimeError("StopStrings.feed after finish(): start a new StopStrings for a new stream")
        many = isinstance(ids, Iterable)
        ids = list(ids) if many else [ids]
        checked = [_check_id(t, f"ids[{i}]" if many else "id", self._vocab) for i, t in enumerate(ids)]
        out = []
        for t in checked:
            if self.stopped:
                break
            self._ids.append(t)
            self.consumed += 1
            out.append(self._advance(self._next_piece(), final=False))
        return TextDelta("".join(out), self.stopped, self.consumed)

    def finish(self) -> TextDelta:
        """End the stream: flush the text held back (a partial character becomes U+FFFD; a partial
        stop string is plain text now). Calling it again returns empty text.

        Returns:
            The `TextDelta` with the remaining text; `stopped` is true if a stop string was found
            (possibly in the flushed text).
        """
        if self._finished or self.stopped:
            self._finished = True
            return TextDelta("", self.stopped, self.consumed)
        self._finished = True
        window = self.codec._decode(self._ids[self._prefix :], self._skip)
        piece = window[self._prefix_len + self._released :]
        return TextDelta(self._advance(piece, final=True), self.stopped, self.consumed)

    def _next_piece(self) -> str:
        """Newly decodable text after appending an id (held while it ends in a partial character)."""
        window = self.codec._decode(self._ids[self._prefix :], self._skip)
        stable = window.rstrip(_REPLACEMENT)
        start = self._prefix_len + self._released
        if len(stable) <= start:
            return ""
        piece = stable[start:]
        if len(stable) == len(window):  # ends on a whole character: move the window on
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_len = len(self.codec._decode(self._ids[self._prefix : self._read], self._skip))
            self._released = 0
        else:
            self._released += len(piece)
        return piece

    def _advance(self, piece: str, *, final: bool) -> str:
        """Add decoded text; return the part that is safe to emit (cut at a stop string)."""
        if not piece and not (final and self._pending):
            return ""
        pending = self._pending + piece
        hit = None  # (end, -len, stop string)
        for s in self.stop:
            i = pending.find(s)
            if i >= 0 and (hit is None or (i + len(s), -len(s)) < hit[:2]):
                hit = (i + len(s), -len(s), s)
        if hit is not None:
            end, neg_len, s = hit
            out = pending[: end if self.include_stop else end + neg_len]
            self.stopped, self.stop_string, self._pending = True, s, ""
        else:
            hold = 0 if final else self._held(pending)
            out, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        if out:
            self._emitted.append(out)
        return out

    def _held(self, pending: str) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of some stop string."""
        for k in range(min(self._hold_max, len(pending)), 0, -1):
            tail = pending[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


def check_stop_strings(stop) -> tuple[str, ...]:
    """Stop strings (any iterable of non-empty strings, or None) as a tuple; `ValueError` otherwise."""
    if stop is None:
        return ()
    if isinstance(stop, str) or not isinstance(stop, Iterable):
        raise ValueError(f"stop={stop!r} must be a list of non-empty strings (or None)")
    stop = tuple(stop)  # once: a generator would be used up by the check below and read empty after
    if any(not isinstance(x, str) or not x for x in stop):
        raise ValueError(f"stop={stop!r} must be a list of non-empty strings (or None)")
    return stop


def encode_texts(codec: TextCodec, texts) -> list[list[int]]:
    """Check and encode text prompts.

    Args:
      codec: the engine's tokenizer; texts: a non-empty list of strings.
    Returns:
      each text's token ids.
    Raises:
      ValueError: naming the bad value (a text that encodes to no tokens included).
    """
    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
        raise ValueError(f"texts must be a non-empty list of strings; got {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"texts[{i}] is a {type(text).__name__}; it must be a string")
    encoded = codec.encode(list(texts))
    for i, (text, p) in enumerate(zip(texts, encoded, strict=True)):
        if not p:
            raise ValueError(
                f"texts[{i}]={text!r:.60} encodes to no tokens (this tokenizer adds no BOS); every prompt "
                "needs >= 1 token"
            )
    return encoded


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of `tokenizers`' ByteLevel)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


TINY_SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: unknown, BOS, EOS
TINY_MULTIBYTE = "é€😀"  # the non-ASCII characters the smallest tiny vocabulary can spell (2, 3, 4 bytes)
_TINY_MERGES = (  # in ByteLevel characters: "Ġ" is a space
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("in", "g"),
    ("e", "r"),
    ("a", "n"),
    ("o", "n"),
    ("r", "e"),
    ("Ġ", "a"),
    ("Ġ", "s"),
    ("e", "n"),
    ("o", "r"),
    ("Ġ", "w"),
    ("S", "T"),
    ("O", "P"),
    ("ST", "OP"),
    ("Ã", "©"),  # é (2 bytes) as one token
    ("ð", "Ł"),  # the first 2 of 😀's 4 bytes as one token
    ("e", "s"),
)


def _tiny_base() -> list[str]:
    m = bytes_to_unicode()
    base = [m[b] for b in range(32, 127)] + [m[10]] + [m[b] for b in TINY_MULTIBYTE.encode()]
    return list(dict.fromkeys(base))


TINY_MIN_VOCAB = len(TINY_SPECIALS) + len(_tiny_base())  # 108


def tiny_tokenizer(vocab_size: int = 128, *, add_bos: bool = False) -> TextCodec:
    """A small deterministic byte-level BPE tokenizer, built in memory (no file, no download), whose
    ids are exactly 0 .. vocab_size-1 — for tests and demos with tiny random-weight models.

    Vocabulary, in id order: `<unk>` 0, `<s>` 1 (BOS), `</s>` 2 (EOS); one token per printable ASCII
    character and newline, and per byte of "é€😀" (so those characters are split across tokens);
    then merges (" the", "ing", "STOP", "é" as one token, ...) as long as they fit; from 279 tokens
    on, the remaining bytes (every text then encodes without `<unk>`); then two-letter merges ("aa",
    "ab", ...); then special `<extra_i>` tokens. Other bytes encode as `<unk>` while they do not fit.

    Args:
        vocab_size: the number of token ids, at least TINY_MIN_VOCAB (108); 128 matches hkv's tiny
            model configurations.
        add_bos: prepend `<s>` when encoding.

    Returns:
        The codec (EOS `</s>`, BOS `<s>`); `codec.save(folder)` writes it as a checkpoint folder's
        tokenizer.

    Raises:
        ValueError: vocab_size is not an int >= TINY_MIN_VOCAB.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < TINY_MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int >= {TINY_MIN_VOCAB} (the tiny tokenizer's base)")
    tk = _tokenizers()
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS)}
    for t in _tiny_base():
        vocab[t] = len(vocab)
    merges = []

    def merge(a: str, b: str) -> None:
        if len(vocab) < vocab_size and a + b not in vocab:
            merges.append((a, b))
            vocab[a + b] = len(vocab)

    for a, b in _TINY_MERGES:
        merge(a, b)
    for c in bytes_to_unicode().values():
        if len(vocab) < vocab_size and c not in vocab:
            vocab[c] = len(vocab)
    letters = "abcdefghijklmnopqrstuvwxyz"
    for a in letters:
        for b in letters:
            merge(a, b)
    extras = [f"<extra_{i}>" for i in range(vocab_size - len(vocab))]
    tok = tk.Tokenizer(tk.models.BPE(vocab, merges, unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens([*TINY_SPECIALS, *extras])
    return TextCodec(tok, bos_token="<s>", eos_tokens=("</s>",), add_bos=add_bos)
