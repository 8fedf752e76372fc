"""The HTTP side of `kvtrans serve`: FastAPI routes speaking OpenAI's API, run by uvicorn.

Handlers render the prompt, validate, queue the compute on the engine's worker and await its
events. A streaming response starts once the first token exists, so its headers already say
how the history was switched; a client that goes away stops its generation. Errors are
OpenAI error objects: 400 for bad input, 404 for an unknown model or route, 413 for a body over
the limit, 500 for a fault inside a generation.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import threading
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..errors import KvtransError
from .engine import Engine
from .metrics import engine_gauges
from .records import Failed, Finished, Generation, Text
from .protocol import (ChatReply, ChatRequest, CompletionRequest, RequestError, TextReply,
                       error_body, usage, validation_error)

CONVERSATION_HEADER = "x-kvtrans-conversation"
NEXT_MODEL_HEADER = "x-kvtrans-next-model"  # where the conversation goes next: translated ahead
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


def _error_response(e: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status,
                        headers=headers)


def _failure(error: BaseException) -> JSONResponse:
    if isinstance(error, RequestError):
        return _error_response(error)
    return _error_response(RequestError(f"the generation failed: {type(error).__name__}: "
                                        f"{error}", status=500, kind="server_error",
                                        code="generation_failed"))


async def _send_error(send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Refuses a request body over `limit` bytes (413) before the app reads any of it as JSON,
    whether or not the client declared its length."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        too_big = f"the request body is over the server's limit of {self.limit} bytes"
        if declared is not None:
            if not declared.isdigit():
                return await _send_error(send, 400, "Content-Length is not a number",
                                         "invalid_content_length")
            if int(declared) > self.limit:
                return await _send_error(send, 413, too_big, "body_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await _send_error(send, 413, too_big, "body_too_large")
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # what follows the body: a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class CountRequests:
    """kvtrans_requests_total by path and status code, every response included."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            path = scope["path"] if scope["path"] in PATHS else "other"
            self.metrics.inc("kvtrans_requests_total", path=path, code=str(status[0]))


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _event_feed() -> tuple[asyncio.Queue, threading.Event, Callable[[object], None]]:
    """(the queue a generation's events arrive on, the flag that stops it, the `emit` the
    worker thread calls): the worker cannot touch the loop's queue directly, and once the
    loop is gone (the server stopped) nobody reads, so the generation stops."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def emit(event):
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (the server stopped)
            cancelled.set()

    return events, cancelled, emit


async def _first_event(engine: Engine, job: Generation, events: asyncio.Queue, loading: bool,
                       deadline: float):
    """The generation's first event. While its model is `loading`, that must come within
    `deadline` seconds or `asyncio.TimeoutError` is raised, unless the model finished loading
    meanwhile: then the request's own events follow, and are awaited."""
    if not loading:
        return await events.get()
    try:
        return await asyncio.wait_for(events.get(), deadline)
    except asyncio.TimeoutError:
        if engine.waits_for_load(job.model):
            raise
        return await events.get()  # loaded: what follows is the request's own


def _still_loading(engine: Engine, model: str) -> JSONResponse:
    """The 503 a request gets when its model's weights took past the deadline: loading goes on,
    and Retry-After says when a retry finds the model loaded."""
    seconds = engine.load_soon(model)  # a retry finds it loaded
    return _error_response(
        RequestError(f"the model {model!r} is loading (about {seconds:.0f} s): retry "
                     "after the time Retry-After gives", status=503, kind="server_error",
                     code="model_loading"),
        headers={"retry-after": str(max(1, math.ceil(seconds)))})


def _used(done: Finished) -> dict:
    """The reply's usage: tokens reused or translated count as cached prompt tokens."""
    h = done.history
    return usage(done.prompt_tokens, done.completion_tokens,
                 h.tokens_reused + h.tokens_translated)


async def _whole_reply(events: asyncio.Queue, cancelled: threading.Event, reply):
    """A non-streaming response: the generation's text once it finished, or its failure."""
    pieces = []
    try:
        while not isinstance(event := await events.get(), (Finished, Failed)):
            pieces.append(event.text)
    except asyncio.CancelledError:
        cancelled.set()
        raise
    if isinstance(event, Failed):
        return _failure(event.error)
    report = event.history.fields()
    return JSONResponse(reply.full("".join(pieces), event.reason, _used(event), report),
                        headers=event.history.headers())


def _streamed_reply(events: asyncio.Queue, cancelled: threading.Event, reply,
                    include_usage: bool, headers: dict) -> StreamingResponse:
    """A streaming response: server-sent chunks as the text comes, a failure as an error
    object, then [DONE]; a client that leaves stops the generation."""

    async def chunks():
        try:
            if (opening := reply.first_chunk()) is not None:
                yield _sse(opening)
            while True:
                event = await events.get()
                if isinstance(event, Text):
                    yield _sse(reply.chunk(event.text))
                elif isinstance(event, Finished):
                    report = event.history.fields()
                    yield _sse(reply.chunk(finish=event.reason, kvtrans=report))
                    if include_usage:
                        yield _sse(reply.usage_chunk(_used(event), report))
                    break
                elif isinstance(event, Failed):
                    body = _failure(event.error).body
                    yield _sse(json.loads(body))
                    break
            yield _sse("[DONE]")
        finally:
            cancelled.set()  # a client that left stops its generation

    return StreamingResponse(chunks(), media_type="text/event-stream",
                             headers={**headers, "cache-control": "no-cache"})


async def _respond(engine: Engine, job: Generation, reply, stream: bool, include_usage: bool):
    """Queue `job` on the engine's worker and answer once its first event exists, so a
    stream's headers already say how the history was switched."""
    events, cancelled, emit = _event_feed()
    deadline = engine.config.load_deadline
    loading = engine.waits_for_load(job.model) and math.isfinite(deadline)
    try:
        engine.submit(job, emit, cancelled)
    except RuntimeError:  # the worker has shut down
        return _error_response(RequestError("the server is shutting down", status=503,
                                            kind="server_error", code="shutting_down"))
    try:  # its weights are read first: a deadline, then a 503 to retry after
        first = await _first_event(engine, job, events, loading, deadline)
    except asyncio.TimeoutError:
        cancelled.set()
        return _still_loading(engine, job.model)
    except asyncio.CancelledError:
        cancelled.set()
        raise
    if isinstance(first, Failed):
        return _failure(first.error)
    headers = first.history.headers()
    if not stream:
        return await _whole_reply(events, cancelled, reply)
    return _streamed_reply(events, cancelled, reply, include_usage, headers)


def create_app(engine: Engine) -> FastAPI:
    """The ASGI app over `engine`; its shutdown finishes the queued work and stops the worker."""

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.close)

    app = FastAPI(title="kvtrans serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    fingerprint = f"kvtrans-{'-'.join(engine.models)}"

    @app.exception_handler(RequestError)
    async def refused(request: Request, e: RequestError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return _error_response(validation_error(e.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}
        return _error_response(RequestError(message.get(e.status_code, str(e.detail)),
                                            status=e.status_code))

    @app.get("/health")
    async def health():
        if engine.broken is not None:  # sharded, and a process is gone: nothing can be served
            return JSONResponse({"status": "broken", "reason": engine.broken}, status_code=503)
        return {"status": "ok", "models": list(engine.models), "queued": engine.queue_depth}

    @app.get("/v1/models")
    async def models():
        return {"object": "list",
                "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kvtrans",
                          "context_length": engine.context[name],
                          "kvtrans": {"resident": engine.residency.is_resident(name)}}
                         for name in engine.models]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(engine_gauges(engine)),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        body.check()
        messages = [m.for_template() for m in body.messages]
        prompt = engine.chat_prompt(body.model, messages)
        job = engine.generation(body.model, prompt, body.reply_budget(),
                                temperature=body.temperature, top_p=body.top_p,
                                stop=body.stops(), seed=body.seed,
                                conversation=request.headers.get(CONVERSATION_HEADER),
                                next_model=request.headers.get(NEXT_MODEL_HEADER),
                                boundaries=engine.last_message_start(body.model, messages,
                                                                     prompt))
        return await _respond(engine, job, ChatReply(body.model, fingerprint), body.stream,
                              body.include_usage)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check()
        prompt = engine.text_prompt(body.model, body.prompt)
        job = engine.generation(body.model, prompt, body.reply_budget(),
                                temperature=body.temperature, top_p=body.top_p,
                                stop=body.stops(), seed=body.seed,
                                conversation=request.headers.get(CONVERSATION_HEADER),
                                next_model=request.headers.get(NEXT_MODEL_HEADER))
        return await _respond(engine, job, TextReply(body.model, fingerprint), body.stream,
                              body.include_usage)

    app.add_middleware(BodyLimit, limit=engine.config.max_body_bytes)
    app.add_middleware(CountRequests, metrics=engine.metrics)  # outermost: counts the 413s too
    return app


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before any model loads, so a taken port fails at once."""
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host
                                    else socket.AF_INET, reuse_port=False)
    except OSError as e:
        raise KvtransError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def server(engine: Engine):
    """A uvicorn server for `engine` (not started). Told to stop, it lets in-flight requests
    finish; sharded, for `engine.config.grace` seconds at most: a process of the group that
    died in a collective can leave process 0's compute waiting in it forever (MLX's ring
    backend fails the pending tasks without raising), and `mlx.launch` waits for process 0 to
    end."""
    import uvicorn

    class Bounded(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:  # a daemon: a server that ends in time does not wait
                timer = threading.Timer(engine.config.grace, os._exit, (128 + sig,))
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(create_app(engine), log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=None)
    return (Bounded if engine.config.shard else uvicorn.Server)(config)


def run(engine: Engine, sock: socket.socket) -> None:
    """Serve until SIGTERM or Ctrl-C; in-flight requests finish first."""
    # uvicorn re-raises the signal it shut down on; handled by this no-op, SIGTERM ends in exit 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    server(engine).run(sockets=[sock])
