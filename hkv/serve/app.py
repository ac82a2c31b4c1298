"""`create_app`: an OpenAI-compatible HTTP server (FastAPI) over one `hkv.Engine`.

    app = create_app(engine, model_name="tiny-gemma3", chat_template=template)
    uvicorn.run(app, host="127.0.0.1", port=8000)          # what `hkv serve` does

Endpoints: `GET /health` (200 while the engine is driven and accepting), `GET /v1/models`,
`POST /v1/completions`, `POST /v1/chat/completions` (OpenAI schemas, `stream` as server-sent events
ending in `data: [DONE]`), `GET /metrics` (Prometheus text). Every request is queued into the one
engine, whose driver thread batches them continuously (`hkv.serve.driver`). Errors carry the OpenAI
error body `{"error": {"message", "type", "param", "code"}}`: 400 for bad input (a pydantic
validation error, a range `hkv.SamplingParams` refuses, a bad message, too long a prompt), 404 for
another model's name, 429 when more than `max_queue` choices wait or run, 503 while shutting down.

A client that disconnects cancels its request as soon as its connection closes (a stream's through
Starlette, a plain request's through a listener of its own; `request.is_disconnected()` is checked
every `DISCONNECT_POLL` seconds besides). On shutdown (uvicorn's SIGTERM handling) the
server stops accepting, lets running requests finish (`drain_timeout`), stops the driver and closes
the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from hkv import CacheCapacityError, Generation, RequestCancelledError
from hkv.engine.chat import ChatTemplate
from hkv.engine.text import TextCodec

from .driver import ChoiceUpdate, EngineDriver, Ticket
from .metrics import EngineStatsCollector, ServeMetrics, engine_reading
from .params import Job, ServedModel, chat_job, completion_job
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest
from .responses import Responder, TokenLogprob, sse

__all__ = ["DISCONNECT_POLL", "ClientGone", "create_app"]

DISCONNECT_POLL = 0.5  # seconds between disconnection checks while a plain request waits
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def create_app(
    engine: Any,
    *,
    model_name: str,
    tokenizer: TextCodec | None = None,
    chat_template: ChatTemplate | None = None,
    max_queue: int = 256,
    drain_timeout: float = 30.0,
    scrape_timeout: float = 10.0,
    close_engine: bool = True,
) -> FastAPI:
    """An OpenAI-compatible app serving `engine`.

    Args:
      engine: an `hkv.Engine` or `hkv.MeshEngine`, built with the served tokenizer (its token outputs
        carry the text); the app's driver thread is the only one that may step it while it runs.
      model_name: the name clients send as `model` (and `/v1/models` lists).
      tokenizer: the served `TextCodec` (None: the engine's `tokenizer`).
      chat_template: renders `/v1/chat/completions` messages (None: that endpoint answers 400).
      max_queue: the most choices (prompts x n) waiting or running at once; more answers 429.
      drain_timeout: seconds shutdown waits for running requests before cancelling them.
      scrape_timeout: seconds `/metrics` waits for a step to end to read the engine's figures.
      close_engine: close the engine when the app shuts down.
    Returns:
      the FastAPI app; its lifespan starts the driver thread and stops it (drained) at shutdown.
    Raises:
      ValueError: no tokenizer, or a bad `max_queue`.
    """
    codec = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
    if codec is None:
        raise ValueError("create_app needs a tokenizer: build the engine with tokenizer=... or pass tokenizer=")
    served = ServedModel(model_name, codec, chat_template, engine.layout.config.max_context, engine.model.vocab_size)
    registry = CollectorRegistry()
    metrics = ServeMetrics(registry)
    driver = EngineDriver(engine, max_queue=max_queue, metrics=metrics)
    read = lambda: driver.call(lambda: engine_reading(engine), timeout=scrape_timeout)
    registry.register(EngineStatsCollector(read, lambda: driver.active))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        driver.start()
        try:
            yield
        finally:
            await asyncio.to_thread(driver.stop, drain_timeout)
            if close_engine:
                await asyncio.to_thread(engine.close)

    app = FastAPI(title="hkv", summary="OpenAI-compatible serving over hkv.Engine", lifespan=lifespan)
    app.state.driver, app.state.served, app.state.registry, app.state.metrics = driver, served, registry, metrics
    _add_error_handlers(app, metrics)
    _add_routes(app, driver, served, registry)
    return app


def _endpoint(request: Request) -> str:
    return ENDPOINTS.get(request.url.path, "other")


def _add_error_handlers(app: FastAPI, metrics: ServeMetrics) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        metrics.rejected.labels(_endpoint(request), str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        got = f" (got {first['input']!r:.60})" if "input" in first and param else ""
        err = ApiError(f"{param or 'body'}: {first.get('msg')}{got}", param=param)
        return await api_error(request, err)


def _add_routes(app: FastAPI, driver: EngineDriver, served: ServedModel, registry: CollectorRegistry) -> None:
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if driver.alive:
            return JSONResponse({"status": "ok"})
        why = driver.broken or "shutting down"
        return JSONResponse(ApiError(why, status=503, type="server_error").body(), status_code=503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served.name, "object": "model", "created": started, "owned_by": "hkv"}
        return {"object": "list", "data": [{**card, "max_model_len": served.max_context}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await asyncio.to_thread(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _answer(request, driver, served, lambda: completion_job(body, served))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _answer(request, driver, served, lambda: chat_job(body, served))


async def _answer(request: Request, driver: EngineDriver, served: ServedModel, make: Callable[[], Job]) -> Response:
    """Check, submit, and answer (streamed or whole) one request."""
    job = make()
    ticket = driver.submit(job, asyncio.get_running_loop())
    responder = Responder(job, served.name, served.codec)
    if job.stream:
        return StreamingResponse(_stream(ticket, request, driver, responder), media_type="text/event-stream")
    try:
        gens = await _collect(ticket, request)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
    finally:
        driver.cancel(ticket)  # (no-op for finished choices)
    return JSONResponse(responder.body(gens))


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects. (The body has been read: the next ASGI message the server
    sends this request is the disconnection.)"""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _updates(ticket: Ticket, request: Request, *, watch: bool) -> AsyncIterator[ChoiceUpdate]:
    """The ticket's updates until every choice finished; `ClientGone` when the client disconnects.

    watch: listen for the disconnection (a plain request; a stream's is Starlette's to notice, which
    cancels the stream). Either way `request.is_disconnected()` is checked every `DISCONNECT_POLL` s.
    """
    left = ticket.job.choices
    gone = asyncio.ensure_future(_disconnected(request)) if watch else None
    try:
        while left:
            get = asyncio.ensure_future(ticket.queue.get())
            waits = {get} if gone is None else {get, gone}
            done, _ = await asyncio.wait(waits, timeout=DISCONNECT_POLL, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()  # (asyncio.Queue keeps an item a cancelled get did not take)
                if (gone is not None and gone.done()) or await request.is_disconnected():
                    raise ClientGone()
                continue
            update = get.result()
            left -= update.finished
            yield update
    finally:
        if gone is not None:
            gone.cancel()


def _engine_error(error: BaseException) -> ApiError:
    """The API error of a choice that failed in the engine."""
    if isinstance(error, CacheCapacityError):
        return ApiError(f"the request does not fit the engine's cache: {error}", param="max_tokens")
    if isinstance(error, RequestCancelledError):
        return ApiError("the request was cancelled (the server is shutting down)", status=503, type="server_error")
    return ApiError(f"the engine failed: {type(error).__name__}: {error}", status=500, type="server_error")


async def _collect(ticket: Ticket, request: Request) -> dict[int, Generation]:
    """Every choice's `Generation` (a failed choice raises its `ApiError`)."""
    gens = {}
    async for u in _updates(ticket, request, watch=True):
        if u.error is not None:
            raise _engine_error(u.error)
        if u.generation is not None:
            gens[u.index] = u.generation
    return gens


async def _stream(ticket: Ticket, request: Request, driver: EngineDriver, responder: Responder) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer: each choice's text deltas (with logprobs when
    asked), its finish reason, the usage chunk when asked, then `[DONE]`. A choice's last chunk adds
    whatever of its final text the token events did not carry, so the streamed text is the final text."""
    job, texts, gens = ticket.job, {}, {}
    try:
        if responder.chat:
            for i in range(job.choices):
                yield sse(responder.role_chunk(i))
        async for u in _updates(ticket, request, watch=False):
            if u.error is not None:
                yield sse(_engine_error(u.error).body())
                break
            before = texts.get(u.index, "")
            text = "".join(o.text or "" for o in u.outputs)
            finish = None
            if u.generation is not None:
                gens[u.index], finish = u.generation, u.generation.finish_reason
                full = u.generation.text or ""
                if full.startswith(before + text):
                    text = full[len(before) :]
            tokens = TokenLogprob.of_outputs(u.outputs)
            if text or finish or (tokens and job.logprobs is not None):
                yield sse(responder.chunk(u.index, text, tokens, offset=len(before), finish=finish))
            texts[u.index] = before + text
        else:
            if job.include_usage:
                yield sse(responder.usage_chunk(gens))
        yield sse("[DONE]")
    except ClientGone:
        return
    finally:
        driver.cancel(ticket)
