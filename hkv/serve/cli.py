"""The `hkv` command line: serve a model over HTTP, generate from the terminal, inspect a disk tier.

    hkv serve MODEL [--host 127.0.0.1 --port 8000 --slots 8 --max-context 2048 --mesh 2x4 ...]
    hkv generate MODEL --prompt TEXT [--max-tokens 64 --temperature 0 --seed S --chat]
    hkv store verify|stats PATH ...          (hkv.store.cli, unchanged)

MODEL is a built-in random-weight model (`tiny-deepseek-v4`, `tiny-gemma3`: no download) or a
checkpoint folder (`hkv.serve.loading.load_model`). `serve` loads the model, builds an `hkv.Engine`
(over a device mesh with `--mesh`), compiles its steps (`--no-warmup` skips that), then serves the
OpenAI API (`hkv.serve.app`) until SIGTERM or Ctrl-C, which stop accepting, let running requests
finish (`--drain-timeout`), close the engine and exit (0 after SIGTERM, 130 after Ctrl-C). Progress
goes to stderr. `generate` streams one completion to stdout. `serve` needs the `serve` extra
(`pip install 'hkv[serve]'`); `generate` and `store` do not.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from hkv.engine.compiled import abandon_background
from hkv.store.cli import main as store_main

from .loading import DTYPES, TINY_MODELS, LoadedModel, load_model

__all__ = ["build_parser", "main", "parse_mesh"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _say(msg: str) -> None:
    print(f"hkv: {msg}", file=sys.stderr, flush=True)


def parse_mesh(text: str | None) -> Any:
    """A `jax.sharding.Mesh` ("data", "model") from "D" or "DxM" over the first D*M of `jax.devices()`
    (None: no mesh).

    Raises:
      ValueError: a malformed shape, or more devices than there are.
    """
    if not text:
        return None
    import jax
    import numpy as np
    from jax.sharding import Mesh

    parts = text.lower().split("x")
    if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--mesh {text!r} must be DATA or DATAxMODEL with positive integers, e.g. 2x4")
    data, model = int(parts[0]), int(parts[1]) if len(parts) == 2 else 1
    devices = jax.devices()
    if data * model > len(devices):
        raise ValueError(
            f"--mesh {text} needs {data * model} devices; there are {len(devices)} ({devices[0].platform})"
        )
    return Mesh(np.array(devices[: data * model]).reshape(data, model), ("data", "model"))


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help=f"a checkpoint folder, or a built-in model: {', '.join(TINY_MODELS)}")
    p.add_argument(
        "--tokenizer", metavar="PATH", help="a folder holding tokenizer.json, or its path (default: MODEL's)"
    )
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="weights' dtype (auto: float32 tiny, bfloat16 else)")
    p.add_argument("--max-context", type=int, default=2048, metavar="N", help="tokens per sequence (prompt + output)")


def build_parser() -> argparse.ArgumentParser:
    """The `hkv` argument parser (`store` is parsed by `hkv.store.cli`)."""
    parser = argparse.ArgumentParser(
        prog="hkv", description="hkv: KV cache and serving engine for hybrid-attention LLMs."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser(
        "serve", help="serve MODEL with the OpenAI API", description="Serve MODEL with an OpenAI-compatible API."
    )
    _model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument("--served-model-name", metavar="NAME", help="the name clients send as `model` (default: MODEL)")
    s.add_argument("--slots", type=int, default=8, metavar="N", help="sequences decoded together (default 8)")
    s.add_argument("--disk", metavar="PATH", help="a disk tier for evicted prefix blocks (hkv.DiskTier)")
    s.add_argument("--mesh", metavar="DxM", help="serve from DATA x MODEL devices, e.g. 2x4 (hkv.MeshEngine)")
    s.add_argument("--max-queue", type=int, default=256, metavar="N", help="most requests waiting or running (429)")
    s.add_argument("--prefill-chunk", type=int, default=32, metavar="N", help="prompt tokens per prefill step")
    s.add_argument("--decode-steps", type=int, default=8, metavar="N", help="tokens per decode dispatch")
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="S", help="seconds to finish requests on exit")
    s.add_argument("--no-warmup", action="store_true", help="compile steps at first use, not before serving")
    s.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    g = sub.add_parser("generate", help="stream one completion to stdout", description="Generate from MODEL.")
    _model_args(g)
    g.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt (a user message with --chat)")
    g.add_argument("--max-tokens", type=int, default=64, metavar="N", help="most new tokens (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default) is greedy")
    g.add_argument("--seed", type=int, default=None, metavar="S", help="seed of a sampled generation")
    g.add_argument("--chat", action="store_true", help="render the prompt with the model's chat template")
    sub.add_parser("store", help="inspect a disk tier store (hkv store --help)", add_help=False)
    return parser


def _load(args: argparse.Namespace, name: str | None = None) -> LoadedModel:
    _say(f"loading {args.model}")
    t = time.perf_counter()
    loaded = load_model(args.model, dtype=args.dtype, tokenizer=args.tokenizer, served_model_name=name, progress=_say)
    _say(f"loaded {loaded.family} model {loaded.source} in {time.perf_counter() - t:.1f}s")
    return loaded


def _engine(loaded: LoadedModel, *, slots: int, max_context: int, mesh=None, disk=None, **kwargs) -> Any:
    import hkv

    config = hkv.CacheConfig(slots=slots, max_context=max_context)
    tier = hkv.DiskTier(disk) if disk else None
    return hkv.Engine(loaded.model, config, mesh=mesh, tokenizer=loaded.tokenizer, disk=tier, model_id=loaded.name,
                      **kwargs)  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> int:
    """`hkv serve`: load, build, warm up, serve until SIGTERM / Ctrl-C."""
    import uvicorn

    from .app import create_app

    loaded = _load(args, args.served_model_name)
    mesh = parse_mesh(args.mesh)
    engine = _engine(loaded, slots=args.slots, max_context=args.max_context, mesh=mesh, disk=args.disk,
                     prefill_chunk=args.prefill_chunk, decode_steps=args.decode_steps)  # fmt: skip
    where = f" over a {args.mesh} mesh" if mesh is not None else ""
    _say(f"engine: {args.slots} slots x {args.max_context} tokens{where}")
    if not args.no_warmup:
        _say("compiling the engine's steps (warm-up)")
        t = time.perf_counter()
        engine.warmup()
        _say(f"warmed up in {time.perf_counter() - t:.1f}s")
    app = create_app(engine, model_name=loaded.name, tokenizer=loaded.tokenizer, chat_template=loaded.chat_template,
                     max_queue=args.max_queue, drain_timeout=args.drain_timeout)  # fmt: skip
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout)  # fmt: skip
    server = uvicorn.Server(config)
    stopped_by: list[int] = []
    # uvicorn re-raises the signal that stopped it once it has shut down: recorded here, it ends the
    # process with an exit code rather than the signal's default action
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _frame: stopped_by.append(s))
    _say(f"serving {loaded.name} on http://{args.host}:{args.port}/v1 (SIGTERM or Ctrl-C to stop)")
    server.run()
    abandon_background()  # the store's queued compiles would hold the exit for minutes
    _say("stopped")
    return EXIT_INTERRUPTED if signal.SIGINT in stopped_by else EXIT_OK


def cmd_generate(args: argparse.Namespace) -> int:
    """`hkv generate`: stream one completion of --prompt to stdout."""
    import hkv

    loaded = _load(args)
    engine = _engine(loaded, slots=1, max_context=args.max_context)
    codec = loaded.tokenizer
    if args.chat:
        if loaded.chat_template is None:
            raise ValueError(f"{loaded.name} has no chat template: drop --chat")
        ids = loaded.chat_template.encode(codec, [{"role": "user", "content": args.prompt}])
    else:
        (ids,) = codec.encode([args.prompt])
    sampling = hkv.SamplingParams(temperature=args.temperature, seed=args.seed, stop_token_ids=codec.eos_token_ids)
    handle = engine.submit(ids, args.max_tokens, sampling=sampling)
    printed = ""
    for event in handle.events():
        printed += event.text or ""
        sys.stdout.write(event.text or "")
        sys.stdout.flush()
    gen = handle.result()
    rest = (gen.text or "")[len(printed) :] if (gen.text or "").startswith(printed) else ""
    sys.stdout.write(rest + "\n")
    sys.stdout.flush()
    _say(f"{len(gen.tokens)} tokens, finish_reason={gen.finish_reason}")
    engine.close()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Run the `hkv` command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["store"]:
        return store_main(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or an argparse usage error (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        return cmd_serve(args) if args.command == "serve" else cmd_generate(args)
    except (ValueError, FileNotFoundError) as e:  # bad MODEL, tokenizer, mesh, sizes: a message, not a trace
        print(f"hkv: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
