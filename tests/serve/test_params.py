"""hkv.serve.params and hkv.serve.responses without a server: OpenAI request -> prompts, budgets and
hkv.SamplingParams, each refusal an ApiError naming the request field; logprob token texts."""

import pytest

from hkv.engine.chat import ChatTemplate, tiny_chat_template
from hkv.engine.text import tiny_tokenizer
from hkv.serve.params import ServedModel, chat_job, completion_job
from hkv.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from hkv.serve.responses import token_bytes, token_text

CODEC = tiny_tokenizer(512)
SERVED = ServedModel("m", CODEC, tiny_chat_template(), max_context=64, vocab_size=512)
USER = [{"role": "user", "content": "Hi"}]


def completion(**kw):
    return completion_job(CompletionRequest(**{"model": "m", "prompt": "Hello", **kw}), SERVED)


def chat(**kw):
    return chat_job(ChatCompletionRequest(**{"model": "m", "messages": USER, **kw}), SERVED)


def refused(fn, **kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(**kw)
    return e.value


def test_openai_defaults():
    job = completion()
    assert job.max_tokens == [16] and job.sampling.temperature == 1.0 and job.sampling.top_p == 1.0
    assert job.sampling.n == 1 and job.logprobs is None and not job.stream
    assert job.sampling.stop_token_ids == CODEC.eos_token_ids  # end-of-sequence ends a request
    assert completion(ignore_eos=True).sampling.stop_token_ids == ()
    assert completion(stop_token_ids=[7]).sampling.stop_token_ids == (7, *CODEC.eos_token_ids)


def test_prompt_forms():
    (ids,) = CODEC.encode(["Hello"])
    assert completion().prompts == [ids]
    assert completion(prompt=["a", "b"]).prompts == CODEC.encode(["a", "b"])
    assert completion(prompt=[5, 6, 7]).prompts == [[5, 6, 7]]
    assert completion(prompt=[[5], [6, 7]]).prompts == [[5], [6, 7]]
    job = completion(prompt=["a", "b"], n=3)
    assert job.n == 3 and job.choices == 6


def test_chat_renders_the_template_and_defaults_to_the_context_left():
    job = chat()
    ids = tiny_chat_template().encode(CODEC, USER)
    assert job.prompts == [ids] and job.max_tokens == [64 - len(ids)]
    assert chat(max_completion_tokens=5).max_tokens == [5]
    assert chat(logprobs=True).logprobs == 0 and chat(logprobs=True, top_logprobs=4).sampling.logprobs == 4


@pytest.mark.parametrize(
    ("kw", "param", "message"),
    [
        ({"max_tokens": -1}, "max_tokens", "max_tokens=-1 must be an integer >= 1"),
        ({"max_tokens": 0}, "max_tokens", "must be an integer >= 1"),
        ({"max_tokens": 61}, "max_tokens", "length is 64 tokens. However, you requested 65 tokens (4 in the prompt"),
        ({"temperature": -1}, "temperature", "temperature=-1.0 must"),
        ({"top_p": 0}, "top_p", "top_p"),
        ({"n": 0}, "n", "n=0"),
        ({"seed": -3}, "seed", "seed=-3"),
        ({"logprobs": 50}, "logprobs", "logprobs=50"),
        ({"presence_penalty": 3}, "presence_penalty", "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias"),
        ({"prompt": []}, "prompt", "non-empty"),
        ({"prompt": ""}, "prompt", "prompt 0 is empty"),
        ({"prompt": [1, 999]}, "prompt", "token id 999 must lie in [0, 512)"),
        ({"echo": True}, "echo", "echo"),
        ({"suffix": "x"}, "suffix", "suffix"),
        ({"best_of": 3}, "best_of", "best_of=3"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only with stream=true"),
    ],
)
def test_completion_refusals_name_the_field(kw, param, message):
    e = refused(completion, **kw)
    assert (e.status, e.param, e.type) == (400, param, "invalid_request_error")
    assert message in e.message
    assert e.body() == {"error": {"message": e.message, "type": "invalid_request_error", "param": param, "code": None}}


@pytest.mark.parametrize(
    ("kw", "param", "message"),
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages[0].role='robot'"),
        ({"messages": [{"role": "user"}]}, "messages", "messages[0].content is missing"),
        ({"messages": [{"role": "user", "content": "x" * 80}]}, "messages", "leaves no room for a completion"),
        ({"tools": [{"type": "function"}]}, "tools", "tools"),
        ({"tool_choice": "auto"}, "tool_choice", "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format", "response_format"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
        ({"logprobs": True, "top_logprobs": 30}, "top_logprobs", "top_logprobs=30"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens", "not both"),
    ],
)
def test_chat_refusals_name_the_field(kw, param, message):
    e = refused(chat, **kw)
    assert (e.status, e.param) == (400, param) and message in e.message


def test_unknown_model_is_404_and_no_template_is_400():
    e = refused(completion, model="gpt-4")
    assert (e.status, e.param, e.code) == (404, "model", "model_not_found") and "`gpt-4` does not exist" in e.message
    bare = ServedModel("m", CODEC, None, max_context=64, vocab_size=512)
    with pytest.raises(ApiError, match="has no chat template") as e:
        chat_job(ChatCompletionRequest(model="m", messages=USER), bare)
    assert e.value.param == "messages"


def test_chat_template_kwargs_reach_the_template():
    served = ServedModel("m", CODEC, ChatTemplate("{{ greeting }}{{ messages[0]['content'] }}"), 64, 512)
    req = ChatCompletionRequest(model="m", messages=USER, chat_template_kwargs={"greeting": "Yo "})
    assert chat_job(req, served).prompts == CODEC.encode(["Yo Hi"])


def test_token_texts_of_partial_characters():
    ids = CODEC.encode(["é€ the"])[0]
    assert [token_text(CODEC, i) for i in ids] == ["é", "bytes:\\xe2", "bytes:\\x82", "bytes:\\xac", " the"]
    assert b"".join(token_bytes(CODEC, i) for i in ids) == "é€ the".encode()
    assert token_text(CODEC, 1) == "<s>" and token_text(CODEC, 600) == "<token_id:600>"
