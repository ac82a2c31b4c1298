"""hkv.engine.text: TextCodec (encode / decode / from_pretrained), StopStrings (streaming detokenization
with stop strings), tiny_tokenizer."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkv.engine.text import TINY_MIN_VOCAB, StopStrings, TextCodec, TextDelta, tiny_tokenizer

CODEC = tiny_tokenizer(128)


def stream(codec, ids, stop=(), **kw):
    """Feed ids one at a time; (pieces fed out, finish delta, the StopStrings)."""
    s = StopStrings(codec, stop, **kw)
    pieces = []
    for t in ids:
        d = s.feed(t)
        pieces.append(d.text)
        if d.stopped:
            break
    return pieces, s.finish(), s


def token_of(codec, piece):
    """The single token id of `piece` (asserts it is one token)."""
    (ids,) = codec.encode([piece])
    assert len(ids) == 1, (piece, ids)
    return ids[0]


# --- tiny_tokenizer / TextCodec ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [TINY_MIN_VOCAB, 128, 300, 512, 1000])
def test_tiny_tokenizer_ids_fill_vocab(n):
    codec = CODEC if n == 128 else tiny_tokenizer(n)
    assert codec.vocab_size == n
    assert sorted(codec.tokenizer.get_vocab(with_added_tokens=True).values()) == list(range(n))
    assert codec.eos_token_ids == (2,) and codec.bos_token_id == 1
    text = "Hello the world, STOP é€😀!\n"
    (ids,) = codec.encode([text])
    assert all(0 <= i < n for i in ids) and codec.decode(ids) == text


def test_tiny_tokenizer_is_deterministic_and_merges():
    a, b = tiny_tokenizer(128), tiny_tokenizer(128)
    assert a.tokenizer.to_str() == b.tokenizer.to_str()
    (ids,) = CODEC.encode([" the STOP"])
    assert [CODEC.tokenizer.id_to_token(i) for i in ids] == ["Ġthe", "Ġ", "STOP"]
    with pytest.raises(ValueError, match="vocab_size=50 must be an int >= 108"):
        tiny_tokenizer(50)


def test_round_trip_batch():
    texts = ["", "a", "The quick brown fox — ü is here", "é€😀 mixed\nlines", "x" * 300]
    ids = CODEC.encode(texts)
    assert len(ids) == len(texts) and all(isinstance(i, int) for row in ids for i in row)
    for t, row in zip(texts, ids, strict=True):
        if "ü" not in t and "—" not in t:  # bytes outside the 128-token vocabulary become <unk>
            assert CODEC.decode(row) == t
    big = tiny_tokenizer(300)  # every byte is in the vocabulary: everything round-trips
    for t, row in zip(texts, big.encode(texts), strict=True):
        assert big.decode(row) == t
    assert CODEC.decode(np.array(ids[3])) == texts[3]  # numpy ids are accepted


def test_bos_added_once():
    codec = tiny_tokenizer(128, add_bos=True)
    assert codec.encode(["hi", ""]) == [[1, *CODEC.encode(["hi"])[0]], [1]]
    assert codec.encode(["<s>hi"])[0].count(1) == 1  # already there: not doubled
    assert codec.decode(codec.encode(["hi"])[0]) == "hi"
    assert codec.decode([1, *CODEC.encode(["hi"])[0], 2], skip_special_tokens=False) == "<s>hi</s>"


@pytest.mark.parametrize(
    "texts, match",
    [
        ("hello", r"texts must be a list of strings, got str"),
        (["a", 3], r"texts\[1\] must be a str, got int: 3"),
        (["a", "b", None], r"texts\[2\] must be a str, got NoneType"),
        ([b"x"], r"texts\[0\] must be a str, got bytes"),
    ],
)
def test_encode_rejects_bad_input(texts, match):
    with pytest.raises(ValueError, match=match):
        CODEC.encode(texts)


@pytest.mark.parametrize(
    "ids, match",
    [
        ([5, 128], r"ids\[1\]=128 must lie in \[0, vocab_size=128\)"),
        ([-1], r"ids\[0\]=-1 must lie"),
        ([4, 2.0], r"ids\[1\]=2.0 must be an int token id"),
        (["a"], r"ids\[0\]='a' must be an int"),
    ],
)
def test_decode_rejects_bad_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        CODEC.decode(ids)


def test_from_pretrained_round_trip(tmp_path):
    codec = tiny_tokenizer(200, add_bos=True)
    assert codec.save(tmp_path / "ckpt") == tmp_path / "ckpt"
    back = TextCodec.from_pretrained(tmp_path / "ckpt")
    assert (back.vocab_size, back.eos_token_ids, back.bos_token_id, back.add_bos) == (200, (2,), 1, True)
    texts = ["round trip é€😀", "STOP the"]
    assert back.encode(texts) == codec.encode(texts)
    assert TextCodec.from_file(tmp_path / "ckpt" / "tokenizer.json").encode(texts) == CODEC.encode(texts)


def test_from_pretrained_reads_hf_configs(tmp_path):
    CODEC.tokenizer.save(str(tmp_path / "tokenizer.json"))  # no tokenizer_config.json: no BOS, no EOS
    plain = TextCodec.from_pretrained(tmp_path)
    assert (plain.eos_token_ids, plain.bos_token_id, plain.add_bos) == ((), None, False)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "</s>", "lstrip": False}, "bos_token": "<s>", "add_bos_token": True})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    codec = TextCodec.from_pretrained(str(tmp_path))
    assert codec.eos_token_ids == (2, 0) and codec.encode(["a"])[0][0] == 1
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    with pytest.raises(ValueError, match=r"eos_tokens\[0\]='<\|end\|>' is not a token of this tokenizer"):
        TextCodec.from_pretrained(tmp_path)


def test_from_pretrained_without_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json in .*" + tmp_path.name):
        TextCodec.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"does not exist \(looked for tokenizer\.json\)"):
        TextCodec.from_pretrained(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match="cannot read tokenizer"):
        TextCodec.from_pretrained(tmp_path)


# --- StopStrings --------------------------------------------------------------------------------------


def test_no_stop_string_finish_returns_everything():
    text = "Hello the world é€😀\n"
    (ids,) = CODEC.encode([text])
    pieces, fin, s = stream(CODEC, ids)
    assert "".join(pieces) + fin.text == text and s.text == text
    assert fin == TextDelta(fin.text, False, len(ids))
    assert s.finish() == TextDelta("", False, len(ids))  # idempotent
    with pytest.raises(RuntimeError, match="after finish"):
        s.feed(3)


def test_stop_string_split_across_tokens_is_excluded():
    (ids,) = CODEC.encode(["Hello world END and more"])  # "END" is three tokens: E, N, D
    n_end = len(CODEC.encode(["Hello world END"])[0])
    pieces, fin, s = stream(CODEC, ids, stop=["END"])
    assert s.stopped and s.stop_string == "END"
    assert "".join(pieces) == "Hello world " == s.text and fin == TextDelta("", True, n_end)
    assert s.consumed == n_end  # up to and including the token "D" that completed it
    s = StopStrings(CODEC, ["END"])
    assert s.feed(ids[:n_end]) == TextDelta("Hello world ", True, n_end)
    assert s.feed(ids[n_end:]) == TextDelta("", True, n_end)  # after a stop further ids are ignored


def test_stop_string_included_on_request():
    (ids,) = CODEC.encode(["abc STOP def"])
    _, _, s = stream(CODEC, ids, stop=["STOP"], include_stop=True)
    assert s.text == "abc STOP" and s.consumed == len(CODEC.encode(["abc STOP"])[0])


def test_feed_many_ids_at_once_counts_consumed():
    (ids,) = CODEC.encode(["one two\nthree four"])
    s = StopStrings(CODEC, ["\n"])
    d = s.feed(ids)
    assert d == TextDelta("one two", True, len(CODEC.encode(["one two\n"])[0]))
    assert ids[: d.consumed][-1] == token_of(CODEC, "\n")


def test_text_held_back_while_it_could_become_a_stop_string():
    s = StopStrings(CODEC, ["STOP!"])
    outs = [s.feed(token_of(CODEC, p)).text for p in ["a", " ", "S", "T", "O"]]
    assert outs == ["a", " ", "", "", ""]  # "STO" could still become "STOP!"
    d = s.feed(token_of(CODEC, "x"))  # "STOx" cannot: released at once
    assert d == TextDelta("STOx", False, 6)
    s.feed([token_of(CODEC, "S"), token_of(CODEC, "T")])
    assert s.finish() == TextDelta("ST", False, 8)  # finish releases a partial stop string
    assert s.text == "a STOxST"


def test_overlapping_stop_strings_first_completed_wins():
    (ids,) = CODEC.encode(["xabcd"])
    _, _, s = stream(CODEC, ids, stop=["abcd", "bc"])
    assert (s.text, s.stop_string, s.consumed) == ("xa", "bc", 4)
    d = StopStrings(CODEC, ["abcd", "bc"]).feed(ids)  # the same result when fed at once
    assert (d.text, d.consumed) == ("xa", 4)


def test_multibyte_characters_never_emit_broken_replacement():
    text = "é€😀 and € again😀"
    (ids,) = CODEC.encode([text])
    assert len(ids) > len(text)  # € and 😀 are split across byte tokens
    pieces, fin, s = stream(CODEC, ids)
    assert all("\ufffd" not in p for p in pieces) and fin.text == ""
    assert "".join(pieces) == text
    euro = CODEC.encode(["€"])[0]
    assert len(euro) == 3
    s = StopStrings(CODEC)
    assert [s.feed(t).text for t in euro] == ["", "", "€"]


def test_stop_string_with_multibyte_characters():
    (ids,) = CODEC.encode(["price 5€ then more"])
    n = len(CODEC.encode(["price 5€"])[0])
    _, _, s = stream(CODEC, ids, stop=["€"])
    assert s.text == "price 5" and s.consumed == n  # completed by the last of €'s three byte tokens
    _, _, s = stream(CODEC, ids, stop=["5€ t"])
    assert s.text == "price " and s.consumed == len(CODEC.encode(["price 5€ t"])[0])


def test_invalid_bytes_released_as_replacement_once_followed():
    lead = CODEC.encode(["€"])[0][0]  # a 3-byte lead byte alone
    s = StopStrings(CODEC)
    assert s.feed(lead).text == ""  # could still be the start of a character
    assert s.feed(token_of(CODEC, "A")).text == "\ufffdA"
    s = StopStrings(CODEC)
    s.feed(lead)
    assert s.finish().text == "\ufffd"  # finish flushes a partial character as U+FFFD


def test_special_tokens_skipped_and_bad_ids_rejected():
    s = StopStrings(CODEC, ["</s>"])
    assert s.feed([1, token_of(CODEC, "a"), 2]) == TextDelta("a", False, 3)  # BOS / EOS are not text
    with pytest.raises(ValueError, match=r"ids\[1\]=128 must lie in \[0, vocab_size=128\)"):
        s.feed([3, 128])
    with pytest.raises(ValueError, match=r"id=-5 must lie"):
        s.feed(-5)
    with pytest.raises(ValueError, match=r"stop\[1\] must be a non-empty str, got ''"):
        StopStrings(CODEC, ["a", ""])
    with pytest.raises(ValueError, match=r"stop must be a list of strings, got the string 'END'"):
        StopStrings(CODEC, "END")


def _sentencepiece_like():
    """A word-level tokenizer with SentencePiece's Metaspace pre-tokenizer and decoder, which strips
    the leading space of the text it decodes ("▁fox" alone decodes to "fox")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "▁the", "▁quick", "▁fox", "▁jumps", "▁over", "▁dog", "é", "▁"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return TextCodec(tok, eos_tokens=["</s>"])


def test_a_stream_continues_its_context_so_a_leading_space_is_kept():
    """With the prompt as context, the first generated word keeps its leading space under a decoder
    that strips it (it read "fox jumps" and a stop string " fox" at the start was missed), and the
    streamed text is what decoding prompt + output adds to the prompt's text."""
    sp = _sentencepiece_like()
    (prompt,) = sp.encode(["the quick"])
    out = [5, 6, 7, 3, 8]  # " fox jumps over the dog"
    s = StopStrings(sp, context=prompt)
    streamed = "".join(s.feed(t).text for t in out) + s.finish().text
    whole = sp.decode(prompt + out)
    assert streamed == whole[len(sp.decode(prompt)) :] == " fox jumps over the dog"
    assert StopStrings(sp, [" fox"], context=prompt).feed(out) == TextDelta("", True, 1)
    assert StopStrings(sp, [" over"], context=prompt).feed(out) == TextDelta(" fox jumps", True, 3)
    # only the last CONTEXT_TOKENS ids are decoded; a context that ends inside a character is ignored
    assert StopStrings(sp, context=[3] * 1000 + prompt).feed(out).text == " fox jumps over the dog"
    small = tiny_tokenizer(TINY_MIN_VOCAB)  # é is two byte tokens there
    e1, e2 = small.encode(["é"])[0]
    s = StopStrings(small, context=[token_of(small, "a"), e1])  # ends inside é: decodes as "a\ufffd"
    assert s.feed([e2]).text == "" and s.finish().text == "\ufffd"  # as without context
    with pytest.raises(ValueError, match=r"context\[1\]=999 must lie in \[0, vocab_size=11\)"):
        StopStrings(sp, context=[3, 999])


def test_ids_past_the_tokenizer_up_to_the_model_vocab_decode_to_no_text():
    """A model vocabulary padded past the tokenizer's: StopStrings(vocab_size=model's) accepts those
    ids (no text, as `tokenizers` decodes them); past vocab_size they stay an error."""
    a, b = token_of(CODEC, "a"), token_of(CODEC, "b")
    s = StopStrings(CODEC, ["ab"], vocab_size=200)
    assert s.feed([a, 150]) == TextDelta("", False, 2)  # "a" is held back: it could start "ab"
    assert s.feed([199, b]) == TextDelta("", True, 4) and s.text == ""
    plain = StopStrings(CODEC, vocab_size=200)
    assert plain.feed([a, 128, b, 199]).text == "ab" and plain.finish().text == ""
    with pytest.raises(ValueError, match=r"ids\[0\]=200 must lie in \[0, vocab_size=200\)"):
        StopStrings(CODEC, vocab_size=200).feed([200])
    for bad in (100, 12.5, True):
        with pytest.raises(ValueError, match=rf"vocab_size={bad!r} must be None or an int >= the tokenizer's 128"):
            StopStrings(CODEC, vocab_size=bad)


BIG = tiny_tokenizer(300)  # every byte has a token: random ids spell arbitrary (often invalid) UTF-8


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([CODEC, BIG]),
    st.lists(st.integers(0, 127), max_size=40),
    st.lists(st.integers(1, 6), max_size=10),
)
def test_streamed_text_equals_decode(codec, ids, chunks):
    """Without stop strings, emitted pieces + finish() == decode(all ids), however the ids are fed,
    and no piece but the last ends in a partial character."""
    if codec is BIG:
        ids = [i * 2 + (i % 3) for i in ids]  # reach ids up to ~256: lone continuation / lead bytes
    s = StopStrings(codec)
    pieces, i = [], 0
    for c in [*chunks, len(ids)]:
        d = s.feed(ids[i : i + c])
        pieces.append(d.text)
        assert d == TextDelta(d.text, False, min(i + c, len(ids)))
        i += c
        if i >= len(ids):
            break
    fin = s.finish()
    assert "".join(pieces) + fin.text == codec.decode(ids) == s.text


@settings(max_examples=150, deadline=None)
@given(st.text("ab e€", max_size=30), st.lists(st.text("ab e€", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_strings_match_reference(text, stops):
    """The final text is the text before the first stop string to complete; `consumed` is the fewest
    ids whose text contains a stop string; every piece is a prefix-extension of the final text."""
    (ids,) = CODEC.encode([text])
    pieces, fin, s = stream(CODEC, ids, stops)
    hits = [(text.find(x) + len(x), -len(x)) for x in stops if x in text]
    if not hits:
        assert not s.stopped and s.text == text and s.consumed == len(ids)
        return
    end, neg = min(hits)
    assert s.stopped and s.text == text[: end + neg] == "".join(pieces) + fin.text
    n = next(n for n in range(1, len(ids) + 1) if any(x in CODEC.decode(ids[:n]) for x in stops))
    assert s.consumed == n


def test_tokenizers_imported_lazily(monkeypatch):
    import ast
    import inspect
    import sys

    from hkv.engine import text

    top = ast.parse(inspect.getsource(text)).body  # no module-level import of tokenizers (TYPE_CHECKING only)
    names = [a.name for n in top if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names]
    names += [getattr(n, "module", None) for n in top if isinstance(n, ast.ImportFrom)]
    assert "tokenizers" not in names
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"pip install 'hkv\[text\]'"):
        text.tiny_tokenizer()
