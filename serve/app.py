"""The HTTP face of the engine: OpenAI-compatible routes on FastAPI (served by uvicorn or Ray Serve).

  POST /v1/chat/completions   messages -> the bundle's chat template; stream or not
  POST /v1/completions        prompt text (or token ids); stream or not
  GET  /v1/models             the one model this server runs (its id: the bundle's directory name)
  GET  /health                200 while the engine's worker is alive
  GET  /metrics               Prometheus text format (serve/metrics.py)

Streaming uses server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; with
`stream_options.include_usage` a last chunk carries the usage. A request with n choices is n jobs; their
chunks are sent as they come, each with its choice's index. A client that disconnects cancels its jobs.
"""
from __future__ import annotations

import asyncio
import json
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..runtime.generator import check_speculation
from .engine import BatchEngine, Engine, EngineConfig, Event, Job, QueueFull, SerialEngine
from .protocol import (Choice, RequestError, chunk_body, completion_body, error_body, parse_request, usage,
                       usage_chunk)


@dataclass
class ServerConfig:
    bundle: str
    backend: str = "cpu"
    threads: int | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    model_id: str | None = None  # default: the bundle's directory name
    history_tokens: int = 0  # > 0: prompt lookup also drafts from earlier completions (runtime/output_history.py)
    sampling_defaults: dict = field(default_factory=dict)  # what requests that leave a sampling field out get
    # batch bundles: make the row step sessions that lone requests use when one first needs them, not at start
    lazy_row_steps: bool = False

    @property
    def model(self) -> str:
        return self.model_id or os.path.basename(os.path.normpath(self.bundle))


def load_engine(config: ServerConfig) -> Engine:
    """Load the bundle and start the worker (errors are SpecedgeErrors: the CLI prints them)."""
    from ..runtime.generator import Generator

    from ..graphs.manifest import load_manifest
    from ..runtime.batch import BatchGenerator

    batched = load_manifest(config.bundle).target.dims.batch > 1
    gen = (BatchGenerator if batched else Generator).load(config.bundle, backend=config.backend,
                                                           threads=config.threads, history_tokens=config.history_tokens)
    try:
        check_speculation(gen.manifest, gen.draft is not None, config.engine.proposer, config.engine.gamma)
        # Sessions are created on first use; create the default configuration's now, not in a request.
        if batched:
            gen.runner.eager_row_steps = not config.lazy_row_steps
            gen.runner.warm(config.engine.gamma if config.engine.proposer != "none" else 0)
            return BatchEngine(gen, config.engine, config.model)
        gen.warm(config.engine.proposer, config.engine.gamma)
        return SerialEngine(gen, config.engine, config.model)
    except BaseException:
        gen.close()
        raise


def create_app(config: ServerConfig, engine: Engine | None = None):
    """The FastAPI app. Without `engine`, the app loads one at startup and closes it at shutdown (how each
    Ray Serve replica gets its own generator)."""
    state = {"engine": engine}

    @asynccontextmanager
    async def lifespan(app):
        owned = state["engine"] is None
        if owned:
            state["engine"] = await asyncio.to_thread(load_engine, config)
        try:
            yield
        finally:
            if owned:
                await asyncio.to_thread(state["engine"].close)

    app = FastAPI(title="specedge", lifespan=lifespan)
    model = config.model

    @app.exception_handler(Exception)
    async def internal(request, exc):  # a bug fails its request, not the server
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.get("/health")
    async def health():
        eng = state["engine"]
        alive = eng is not None and eng._worker.is_alive()
        return JSONResponse({"status": "ok" if alive else "unavailable"}, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "specedge"}]}

    @app.get("/metrics")
    async def metrics():
        eng = state["engine"]
        return PlainTextResponse(eng.metrics.exposition(eng.pending), media_type="text/plain; version=0.0.4")

    async def complete(request: Request, chat: bool):
        eng: Engine = state["engine"]
        try:
            body = json.loads(await request.body())
        except ValueError:
            eng.metrics.count_request("invalid")
            return error(400, "the request body is not valid JSON")
        try:
            req = parse_request(body, chat, model, config.sampling_defaults)
            jobs = eng.submit(req, asyncio.get_running_loop())
        except RequestError as e:
            eng.metrics.count_request("invalid")
            return JSONResponse(e.body(), status_code=e.status)
        except QueueFull as e:
            return error(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        if req.stream:
            return StreamingResponse(_sse(jobs, model), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(jobs, model, request)

    async def _collect(jobs: list[Job], model: str, request: Request):
        choices, done = [], []
        try:
            for job in jobs:  # they run side by side (batch rows) or one after another; their events wait
                parts, logprobs = [], []
                while True:
                    try:
                        ev: Event = await asyncio.wait_for(job.events.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return Response(status_code=499)  # nobody reads it; the jobs are cancelled below
                        continue
                    if ev.kind == "text":
                        parts.append(ev.text)
                        logprobs += ev.logprobs or []
                    elif ev.kind == "error":
                        kind = "server_error" if ev.status >= 500 else "invalid_request_error"
                        return error(ev.status, ev.text, kind)
                    else:
                        choices.append(Choice("".join(parts), ev.finish, logprobs))
                        done.append(ev)
                        break
            return completion_body(jobs[0].request, model, choices, _usage(jobs[0], done), _extra(done))
        finally:
            for job in jobs:
                job.cancel()  # a no-op for those that finished

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


def error(status: int, message: str, kind: str = "invalid_request_error", **kw) -> JSONResponse:
    return JSONResponse(error_body(message, kind, kw.get("param"), kw.get("code")), status_code=status,
                        headers=kw.get("headers"))


def _usage(job: Job, done: list[Event]) -> dict:
    """The prompt once, the completion tokens of every choice; cached tokens as the first choice found them."""
    return usage(len(job.prompt_ids), sum(ev.stats.new_tokens for ev in done), done[0].stats.reused_tokens)


def _extra(done: list[Event]) -> dict:
    """specedge's own numbers: rounds and drafts summed over the choices, times from the first."""
    s = done[0].stats
    return {"proposer": s.proposer, "gamma": s.gamma, "rounds": sum(ev.stats.rounds for ev in done),
            "proposed": sum(ev.stats.proposed for ev in done), "accepted": sum(ev.stats.accepted for ev in done),
            "reused_prompt_tokens": s.reused_tokens, "ttft_ms": round(s.ttft_ms, 3),
            "tokens_per_s": round(s.tokens_per_s, 3)}


async def _sse(jobs: list[Job], model: str):
    def data(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    req = jobs[0].request
    merged: asyncio.Queue = asyncio.Queue()  # (choice index, event) of every job, in arrival order

    async def forward(index: int, job: Job) -> None:
        while True:
            ev = await job.events.get()
            merged.put_nowait((index, ev))
            if ev.kind != "text":
                return

    tasks = [asyncio.create_task(forward(k, job)) for k, job in enumerate(jobs)]
    done: dict[int, Event] = {}
    try:
        if req.chat:
            for k in range(len(jobs)):
                yield data(chunk_body(req, model, "", None, first=True, index=k))
        while len(done) < len(jobs):
            k, ev = await merged.get()
            if ev.kind == "text":
                yield data(chunk_body(req, model, ev.text, None, logprobs=ev.logprobs, index=k))
            elif ev.kind == "error":  # the status line is gone: OpenAI-style error event, then the end
                yield data(error_body(ev.text, "server_error" if ev.status >= 500 else "invalid_request_error"))
                return
            else:
                done[k] = ev
                yield data(chunk_body(req, model, None, ev.finish, index=k))
        if req.include_usage:
            yield data(usage_chunk(req, model, _usage(jobs[0], [done[k] for k in range(len(jobs))])))
        yield "data: [DONE]\n\n"
    finally:  # also when the client disconnects: Starlette cancels this generator
        for job, task in zip(jobs, tasks):
            job.cancel()
            task.cancel()


def serve_forever(config: ServerConfig, host: str, port: int) -> int:
    """`specedge serve`: load first (a bad bundle is a one-line error before any socket opens), then bind (an
    address in use is a one-line error before "serving" is announced), then run."""
    import uvicorn

    engine = load_engine(config)
    try:
        sock = listen(host, port)
    except BaseException:
        engine.close()
        raise
    app = create_app(config, engine)
    port = sock.getsockname()[1]  # the one the system chose for --port 0
    print(f"specedge: serving {config.model} on http://{host}:{port}/v1 ({engine.gen.target.dims.context}-token "
          f"context, proposer {config.engine.proposer}, gamma {config.engine.gamma})", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
    return 0


def listen(host: str, port: int):
    """A socket bound to (host, port) and listening, for the server. Bound here rather than by uvicorn, which
    announces nothing useful when it cannot bind (it logs the error after our "serving" line) and never returns
    for a port out of range."""
    import socket

    from ..errors import ServeError

    if not 0 <= port <= 65535:
        raise ServeError(f"--port must be in 0..65535, not {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise ServeError(f"cannot listen on {host}: {e.strerror or e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart over TIME_WAIT
        sock.bind(address)
        # Listening now, before "serving" is announced: a client that connects before uvicorn's loop starts
        # waits in the backlog instead of being refused (seen in CI under load).
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
