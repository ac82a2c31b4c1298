"""`load_model`: a served model, its tokenizer and its chat template, from a checkpoint folder or a
built-in tiny model.

    loaded = load_model("tiny-deepseek-v4")          # random weights, no download: tests, demos
    loaded = load_model("/ckpt/gemma-3-1b-it", dtype="bfloat16")
    engine = hkv.Engine(loaded.model, hkv.CacheConfig(...), tokenizer=loaded.tokenizer)

A checkpoint folder is recognised by its `config.json`'s `model_type`: "deepseek_v4"
(`models.deepseek_v4.load`) or "gemma3_text" / "gemma3" (`models.gemma3.load`). Its tokenizer is read
from the folder's tokenizer.json / tokenizer_config.json (`TextCodec.from_pretrained`) unless
`tokenizer=` names another folder or tokenizer.json, and its chat template from the same folder
(`ChatTemplate.from_pretrained`; None when it has none). The built-in models (`TINY_MODELS`) are
`models.deepseek_v4.init(tiny_config(), seed=0)` and `models.gemma3.init(tiny_config(), seed=0)` with
`hkv.engine.text.tiny_tokenizer` of their vocabulary and the built-in tiny chat template.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from hkv.engine.chat import ChatTemplate, tiny_chat_template
from hkv.engine.options import text_codec
from hkv.engine.text import TextCodec, tiny_tokenizer

__all__ = ["DTYPES", "FAMILIES", "TINY_MODELS", "LoadedModel", "load_model"]

TINY_MODELS = {"tiny-deepseek-v4": "deepseek_v4", "tiny-gemma3": "gemma3"}  # built-in name -> family
FAMILIES = {"deepseek_v4": "deepseek_v4", "gemma3_text": "gemma3", "gemma3": "gemma3"}  # model_type -> family
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: float32 for the tiny models, bfloat16 for checkpoints


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve.

    Attributes:
      model: the Flax NNX model (an `hkv.CachedModel`).
      tokenizer: its `TextCodec`.
      chat_template: its `ChatTemplate` (None: the checkpoint has none).
      name: the name clients use (`model` in requests).
      family: "deepseek_v4" or "gemma3".
      source: the checkpoint folder, or the built-in model's name.
    """

    model: Any
    tokenizer: TextCodec
    chat_template: ChatTemplate | None
    name: str
    family: str
    source: str


def _dtype(dtype: Any, default: str) -> Any:
    """A floating jnp dtype from "auto" / None (the default), a name in `DTYPES`, or a dtype."""
    if dtype is None or dtype == "auto":
        dtype = default
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r} is not a dtype; use one of {DTYPES}") from None
    if not jnp.issubdtype(d, jnp.floating):
        raise ValueError(f"dtype={dtype!r} must be a floating dtype, one of {DTYPES}")
    return d


def _accepted() -> str:
    return f"a built-in model ({', '.join(TINY_MODELS)}) or a checkpoint folder with a config.json"


def _model_type(folder: Path) -> str:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{str(folder)!r} has no config.json; MODEL must be {_accepted()}")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {cfg_path}: {e}") from e
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type not in FAMILIES:
        raise ValueError(f"{cfg_path}: model_type={model_type!r} is not served; hkv serves {sorted(FAMILIES)}")
    return model_type


def _tokenizer_and_template(folder: Path | None, tokenizer: Any, vocab_size: int):
    """The codec and chat template: from `tokenizer` (a codec, folder or tokenizer.json) when given,
    else from the checkpoint folder."""
    if tokenizer is None and folder is not None and not (folder / "tokenizer.json").is_file():
        raise ValueError(
            f"{str(folder)!r} has no tokenizer.json: pass tokenizer= (--tokenizer) a folder holding one, or its path"
        )
    source = folder if tokenizer is None else tokenizer
    codec = text_codec(source, vocab_size)
    template_dir = Path(source) if isinstance(source, (str, os.PathLike)) else None
    if template_dir is not None and not template_dir.is_dir():
        template_dir = template_dir.parent  # a tokenizer.json path: its folder
    template = ChatTemplate.from_pretrained(template_dir) if template_dir is not None else None
    if template is None and folder is not None and template_dir != folder:
        template = ChatTemplate.from_pretrained(folder)
    return codec, template


def _load_checkpoint(folder: Path, dtype: Any, progress: Callable[[str], None] | None) -> tuple[Any, str]:
    family = FAMILIES[_model_type(folder)]
    if family == "deepseek_v4":
        from models import deepseek_v4

        return deepseek_v4.load(folder, dtype=_dtype(dtype, "bfloat16"), progress=progress), family
    from models import gemma3

    return gemma3.load(folder, dtype=_dtype(dtype, "bfloat16")), family


def _tiny(name: str, dtype: Any) -> Any:
    if TINY_MODELS[name] == "deepseek_v4":
        from models import deepseek_v4

        return deepseek_v4.init(deepseek_v4.tiny_config(), seed=0, dtype=_dtype(dtype, "float32"))
    from models import gemma3

    return gemma3.init(gemma3.tiny_config(), seed=0, dtype=_dtype(dtype, "float32"))


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: Any = None,
    tokenizer: TextCodec | str | os.PathLike | None = None,
    served_model_name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load a model to serve, with its tokenizer and chat template.

    Args:
      name_or_path: a built-in model name (`TINY_MODELS`) or a checkpoint folder.
      dtype: the weights' dtype: "auto" / None (float32 for the tiny models, bfloat16 for
        checkpoints), "float32", "bfloat16", "float16" or a jnp dtype.
      tokenizer: another tokenizer than the model's: a `TextCodec`, a folder holding tokenizer.json
        (its chat template is used when it has one), or a tokenizer.json path.
      served_model_name: the name clients use (default: `name_or_path` as given).
      progress: receives one-line messages while a checkpoint loads.
    Returns:
      the `LoadedModel`.
    Raises:
      ValueError: an unknown name or a folder without config.json (the message lists what is
        accepted), an unserved model_type, a missing tokenizer, a bad dtype, a malformed checkpoint,
        tokenizer or chat template.
    """
    name = os.fspath(name_or_path)
    say = progress or (lambda _msg: None)
    if name in TINY_MODELS:
        say(f"building {name} (random weights, seed 0)")
        model = _tiny(name, dtype)
        codec = tiny_tokenizer(model.vocab_size) if tokenizer is None else text_codec(tokenizer, model.vocab_size)
        template = tiny_chat_template(codec.bos_token, None)
        if tokenizer is not None and isinstance(tokenizer, (str, os.PathLike)) and Path(tokenizer).is_dir():
            template = ChatTemplate.from_pretrained(tokenizer) or template
        return LoadedModel(model, codec, template, served_model_name or name, TINY_MODELS[name], name)
    folder = Path(name)
    if not folder.is_dir():
        raise ValueError(f"unknown model {name!r}: MODEL must be {_accepted()}")
    _model_type(folder)  # (a clear error before any weight is read)
    say(f"loading {folder}")
    model, family = _load_checkpoint(folder, dtype, progress)
    codec, template = _tokenizer_and_template(folder, tokenizer, model.vocab_size)
    return LoadedModel(model, codec, template, served_model_name or name, family, str(folder))
