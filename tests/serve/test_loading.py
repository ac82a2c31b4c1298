"""hkv.serve.loading: built-in tiny models and checkpoint folders (family from config.json's model_type,
tokenizer and chat template from the folder), each refusal a ValueError saying what is accepted."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from hkv.engine.chat import TINY_CHAT_TEMPLATE
from hkv.engine.text import tiny_tokenizer
from hkv.serve import TINY_MODELS, load_model
from models import deepseek_v4, gemma3
from models.deepseek_v4.checkpoint import write_safetensors

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def write_checkpoint(folder, family: str, *, tokenizer: bool = True, template: str | None = CHATML):
    """A checkpoint folder of the tiny model of `family` (its seed-0 random weights, as the built-in
    model has them), with the tiny tokenizer and a chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    mod = deepseek_v4 if family == "deepseek_v4" else gemma3
    cfg = mod.tiny_config()
    hf = cfg.to_hf_dict() if family == "deepseek_v4" else cfg.to_hf()
    (folder / "config.json").write_text(json.dumps(hf))
    write_safetensors(folder / "model.safetensors", mod.random_tensors(cfg, 0))
    if tokenizer:
        tiny_tokenizer(cfg.vocab_size).save(folder)
        if template is not None:
            path = folder / "tokenizer_config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template}))
    return folder


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_built_in_tiny_models(name):
    loaded = load_model(name)
    assert loaded.name == loaded.source == name and loaded.family == TINY_MODELS[name]
    assert loaded.tokenizer.vocab_size == loaded.model.vocab_size
    assert loaded.chat_template.source == TINY_CHAT_TEMPLATE
    assert loaded.chat_template.render([{"role": "user", "content": "Hi"}]) == "<s><|user|>Hi\n<|assistant|>"
    assert load_model(name, served_model_name="mine").name == "mine"


def test_dtype():
    assert {x.dtype for x in leaves(load_model("tiny-gemma3", dtype="bfloat16").model) if x.ndim == 2} == {
        np.dtype("bfloat16")
    }
    with pytest.raises(ValueError, match=r"dtype='int8' must be a floating dtype"):
        load_model("tiny-gemma3", dtype="int8")


@pytest.mark.parametrize("family", ["gemma3", "deepseek_v4"])
def test_checkpoint_folder_loads_its_family_tokenizer_and_template(tmp_path, family):
    folder = write_checkpoint(tmp_path / "ckpt", family)
    loaded = load_model(folder, dtype="float32")
    tiny = load_model(f"tiny-{family.replace('_', '-')}")
    assert loaded.family == family and loaded.name == str(folder) and loaded.source == str(folder)
    assert all(np.array_equal(a, b) for a, b in zip(leaves(loaded.model), leaves(tiny.model), strict=True))
    assert loaded.tokenizer.encode(["the end"]) == tiny.tokenizer.encode(["the end"])
    assert loaded.chat_template.source == CHATML
    assert {x.dtype for x in leaves(load_model(folder).model) if x.ndim == 2} >= {np.dtype("bfloat16")}  # auto


def test_checkpoint_tokenizer_from_elsewhere(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", "gemma3", tokenizer=False)
    with pytest.raises(ValueError, match=r"has no tokenizer\.json: pass tokenizer="):
        load_model(folder)
    tok = tmp_path / "tok"
    tiny_tokenizer(512).save(tok)
    loaded = load_model(folder, tokenizer=tok)
    assert loaded.tokenizer.vocab_size == 512 and loaded.chat_template is None  # neither folder has a template
    assert load_model(folder, tokenizer=tok / "tokenizer.json").tokenizer.vocab_size == 512


def test_refusals_say_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model 'llama-7b': MODEL must be a built-in model \(tiny-deepseek"):
        load_model("llama-7b")
    with pytest.raises(ValueError, match=r"has no config\.json; MODEL must be a built-in model"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"model_type='llama' is not served; hkv serves \['deepseek_v4', 'gemma3'"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        load_model(tmp_path)
    big = tmp_path / "big"
    tiny_tokenizer(1000).save(big)
    with pytest.raises(ValueError, match="the tokenizer has 1000 token ids but the model's vocabulary has 512"):
        load_model("tiny-gemma3", tokenizer=big)
