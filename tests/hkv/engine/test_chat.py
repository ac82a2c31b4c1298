"""hkv.engine.chat: ChatTemplate renders as Hugging Face does (trim/lstrip blocks, raise_exception,
tojson), reads a checkpoint folder's template, and names bad messages and malformed templates."""

import json

import pytest

from hkv.engine.chat import ROLES, TINY_CHAT_TEMPLATE, ChatTemplate, check_messages, tiny_chat_template
from hkv.engine.text import tiny_tokenizer

# ChatML, as Qwen's tokenizer_config.json writes it (one line)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A Llama-2-style template written over several indented lines: trim_blocks drops the newline after each
# block tag and lstrip_blocks the indentation before it, so only the text lines' own newlines remain.
LLAMA_STYLE = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set messages = messages[1:] %}
{% else %}
    {% set system = '' %}
{% endif %}
{% for m in messages %}
    {% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if m['role'] == 'user' %}
[INST] {% if loop.first and system %}<<SYS>>{{ system }}<</SYS>> {% endif %}{{ m['content'] }} [/INST]
    {% else %}
{{ m['content'] }}{{ eos_token }}
    {% endif %}
{% endfor %}
"""
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


def test_chatml_renders_exactly():
    t = ChatTemplate(CHATML)
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    assert t.render(CONVERSATION) == expected
    assert t.render(CONVERSATION, add_generation_prompt=False) == expected.removesuffix("<|im_start|>assistant\n")


def test_trim_and_lstrip_blocks_as_hugging_face():
    t = ChatTemplate(LLAMA_STYLE, bos_token="<s>", eos_token="</s>")
    assert t.render(CONVERSATION, add_generation_prompt=False) == (
        "<s>\n[INST] <<SYS>>You are terse.<</SYS>> Hi [/INST]\nHello.</s>\n[INST] Bye [/INST]\n"
    )


def test_raise_exception_is_a_value_error_with_the_templates_message():
    t = ChatTemplate(LLAMA_STYLE, bos_token="<s>", eos_token="</s>")
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_tojson_keeps_unicode_and_extra_variables_reach_the_template():
    t = ChatTemplate("{{ tools | tojson }}|{{ messages[0]['content'] | tojson(indent=1) }}|{{ flavour }}")
    out = t.render([{"role": "user", "content": "é"}], tools=[{"name": "f€"}], flavour="x")
    assert out == '[{"name": "f€"}]|"é"|x'
    assert json.loads(out.split("|")[0]) == [{"name": "f€"}]


def test_special_tokens_default_to_empty_and_can_be_overridden():
    t = ChatTemplate("[{{ bos_token }}|{{ eos_token }}]")
    assert t.render([{"role": "user", "content": "x"}]) == "[|]"
    assert t.render([{"role": "user", "content": "x"}], bos_token="B") == "[B|]"


def test_generation_blocks_and_loop_controls_parse():
    t = ChatTemplate(
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m['content'] }}{% endgeneration %};{% endfor %}"
    )
    assert t.render(CONVERSATION) == "Hi;Hello.;Bye;"


def test_text_parts_are_joined_with_newlines_and_extra_keys_kept():
    msgs = check_messages(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "n"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            {"role": "tool", "content": "42", "tool_call_id": "1"},
        ]
    )
    assert msgs[0] == {"role": "user", "content": "a\nb", "name": "n"}
    assert msgs[1]["content"] is None and msgs[2]["tool_call_id"] == "1"


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ("hi", r"messages must be a list"),
        ([], r"at least one message"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\]\.role='robot'"),
        ([{"content": "a"}], r"messages\[0\]\.role=None must be one of"),
        ([{"role": "user"}], r"messages\[0\]\.content is missing"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string or a list"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\]\.type='image_url'"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"messages\[0\]\.content\[0\]\.text must be"),
        ([{"role": "user", "content": ["a"]}], r"messages\[0\]\.content\[0\] must be a"),
        ([{"role": "assistant", "content": None}], r"messages\[0\]\.content is missing"),
    ],
)
def test_bad_messages_are_named(messages, error):
    with pytest.raises(ValueError, match=error):
        tiny_chat_template().render(messages)


def test_roles():
    assert ROLES == ("system", "user", "assistant", "tool")


def test_bad_template_syntax_names_the_origin_and_line():
    with pytest.raises(ValueError, match=r"my.json: the chat template is not valid jinja2 \(line 2"):
        ChatTemplate("ok\n{% for %}", origin="my.json")
    with pytest.raises(ValueError, match="must be a non-empty string"):
        ChatTemplate("")


def test_sandbox_refuses_unsafe_attribute_access():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="refused the messages"):
        t.render([{"role": "user", "content": "x"}])


def test_tiny_template_encodes_with_the_tiny_tokenizer():
    t = tiny_chat_template()
    assert t.source == TINY_CHAT_TEMPLATE
    text = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<s><|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    codec = tiny_tokenizer(128)
    (ids,) = codec.encode([text])
    assert ids[0] == codec.bos_token_id and 0 not in ids  # BOS as its special id, no <unk>
    assert codec.decode(ids, skip_special_tokens=False) == text


def _write(folder, **files):
    for name, content in files.items():
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


def test_from_pretrained_reads_tokenizer_config(tmp_path):
    _write(tmp_path, **{"tokenizer_config.json": {"chat_template": CHATML, "bos_token": {"content": "<s>"}}})
    t = ChatTemplate.from_pretrained(tmp_path)
    assert t.source == CHATML and t.bos_token == "<s>" and t.eos_token is None
    assert t.render([{"role": "user", "content": "x"}]).startswith("<|im_start|>user\nx")


def test_from_pretrained_named_templates_take_default(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    _write(tmp_path, **{"tokenizer_config.json": {"chat_template": named, "eos_token": "</s>"}})
    assert ChatTemplate.from_pretrained(tmp_path).render([{"role": "user", "content": "x"}]) == "D</s>"
    assert ChatTemplate.from_pretrained(tmp_path, name="tool_use").source == "T"
    with pytest.raises(ValueError, match=r"no chat template named 'rag'; the file has \['default', 'tool_use'\]"):
        ChatTemplate.from_pretrained(tmp_path, name="rag")


def test_from_pretrained_prefers_chat_template_jinja(tmp_path):
    _write(tmp_path, **{"tokenizer_config.json": {"chat_template": "old", "bos_token": "<b>"}})
    _write(tmp_path, **{"chat_template.jinja": "{{ bos_token }}new"})
    t = ChatTemplate.from_pretrained(tmp_path)
    assert t.render([{"role": "user", "content": "x"}]) == "<b>new" and t.origin.endswith("chat_template.jinja")


def test_from_pretrained_none_without_a_template(tmp_path):
    assert ChatTemplate.from_pretrained(tmp_path) is None
    _write(tmp_path, **{"tokenizer_config.json": {"bos_token": "<s>"}})
    assert ChatTemplate.from_pretrained(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ChatTemplate.from_pretrained(tmp_path / "missing")


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ("[1,", r"cannot read .*tokenizer_config.json"),
        ([1], r"expected a JSON object"),
        ({"chat_template": 7}, r"chat_template must be a string or a list"),
        ({"chat_template": [{"name": "default"}]}, r"chat_template\[0\] must be \{'name': str, 'template': str\}"),
        ({"chat_template": "{% if %}"}, r"tokenizer_config.json: the chat template is not valid jinja2 \(line 1"),
        ({"chat_template": "x", "bos_token": 5}, r"bos_token must be a string"),
    ],
)
def test_from_pretrained_malformed_is_a_named_value_error(tmp_path, config, error):
    _write(tmp_path, **{"tokenizer_config.json": config})
    with pytest.raises(ValueError, match=error):
        ChatTemplate.from_pretrained(tmp_path)


def test_encode_never_doubles_bos():
    """A tokenizer whose post-processor adds BOS, and a template that writes it: one BOS (as
    transformers' apply_chat_template(tokenize=True), which adds no special tokens)."""
    from tokenizers import processors

    codec = tiny_tokenizer(128)
    codec.tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    msgs = [{"role": "user", "content": "Hi"}]
    (plain,) = codec.encode([tiny_chat_template().render(msgs)])
    assert plain[:2] == [1, 1]  # encoding the rendered text as a prompt would double it
    ids = tiny_chat_template().encode(codec, msgs)
    assert ids[0] == 1 and ids[1] != 1 and ids == plain[1:]
    with pytest.raises(ValueError, match="encodes to no tokens"):
        ChatTemplate("{{ '' }}").encode(codec, msgs)
