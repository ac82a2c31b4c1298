"""hkv.serve: an OpenAI-compatible HTTP server and the `hkv` command line over `hkv.Engine`.

    from hkv.serve import create_app, load_model
    loaded = load_model("tiny-gemma3")                      # or a checkpoint folder
    engine = hkv.Engine(loaded.model, hkv.CacheConfig(slots=8, max_context=2048), tokenizer=loaded.tokenizer)
    app = create_app(engine, model_name=loaded.name, chat_template=loaded.chat_template)

Modules: `loading` (models, tokenizers, chat templates), `protocol` (the OpenAI request bodies),
`params` (request -> `hkv.SamplingParams` and prompts), `driver` (the engine's driver thread and the
bridge into asyncio), `responses` (response bodies and stream chunks), `metrics` (Prometheus),
`app` (the FastAPI app), `cli` (`hkv serve`, `hkv generate`, `hkv store`). The server needs the
`serve` extra (fastapi, uvicorn); `create_app` is imported on first use so that `load_model` and the
command line's other commands work without it. Layering: hkv.serve may import models, hkv,
hkv.engine, hkv.core and hkv.store; nothing in hkv imports it (tests/test_layering.py).
"""

from __future__ import annotations

from typing import Any

from .loading import TINY_MODELS, LoadedModel, load_model

__all__ = ["TINY_MODELS", "LoadedModel", "create_app", "load_model"]


def __getattr__(name: str) -> Any:
    if name == "create_app":  # (needs fastapi: the `serve` extra)
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
