"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of a :class:`Scheduler`.

``POST /v1/completions`` (``stream`` as server-sent events), ``GET /v1/models`` and
``GET /health``. Each request gets an asyncio queue that the engine thread feeds through
``loop.call_soon_threadsafe``; a client that disconnects (stream closed, or a non-streaming
request whose connection drops) is aborted, which frees its KV pages.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from treeattn.serve.protocol import ProtocolError, chunk_body, completion_body, error_body, parse_completion
from treeattn.serve.scheduler import QueueFull, Scheduler

__all__ = ["create_app", "ServerThread", "run_server"]

log = logging.getLogger(__name__)

#: seconds between checks that a non-streaming client is still connected
_POLL_S = 0.25


class _Text:
    """Incremental detokenization of one choice (text deltas that never split a character)."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.text = tokenizer, [], ""

    def add(self, ids: list, final: bool) -> str:
        self.ids.extend(ids)
        if self.tok is None:
            return ""
        full = self.tok.decode(self.ids)
        if full.endswith("\ufffd") and not final:
            return ""                                   # an incomplete UTF-8 sequence
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta


def create_app(scheduler: Scheduler, *, model_name: str, tokenizer=None, max_model_len: int) -> FastAPI:
    """The FastAPI app serving ``scheduler``'s engine under the name ``model_name``.

    Parameters
    ----------
    scheduler : Scheduler
        Started by the caller.
    tokenizer : tokenizers.Tokenizer, optional
        Text prompts and ``text`` outputs need it (token ids work without).
    max_model_len : int
        Longest prompt plus ``max_tokens`` accepted.
    """
    app = FastAPI(title="treeattn", version="0.1.0")
    vocab = scheduler.engine.model.config.vocab_size
    created = int(time.time())

    def fits(prompt_len: int, max_tokens: int, n: int) -> bool:
        return scheduler.pages_needed(prompt_len, max_tokens, n) <= scheduler.capacity_pages

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **await asyncio.to_thread(scheduler.stats)}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "treeattn", "max_model_len": max_model_len,
                                            "vocab_size": vocab}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            raw = await request.body()
        except ClientDisconnect:
            return Response(status_code=499)
        try:
            req = parse_completion(raw, model_name=model_name, tokenizer=tokenizer,
                                   vocab_size=vocab, max_model_len=max_model_len, fits=fits)
        except ProtocolError as e:
            return JSONResponse(error_body(str(e), e.kind, e.param), status_code=e.status)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:                       # the event loop is gone (shutdown)
                log.debug("dropped an event of a request whose loop closed")

        try:
            rid = scheduler.submit(req.prompt_ids, req.params, emit)
        except QueueFull as e:
            return JSONResponse(error_body(str(e), "rate_limit_error", code="queue_full"), status_code=429)
        name = f"cmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        texts = [_Text(tokenizer) for _ in range(req.params.n)]
        finish = [None] * req.params.n

        def apply(events) -> list:
            deltas = []
            for i, tok, fin in events:
                ids = [] if tok is None else [tok]
                finish[i] = fin
                deltas.append((i, texts[i].add(ids, fin is not None), ids, fin))
            return deltas

        if req.stream:
            async def sse():
                done = False
                try:
                    while None in finish:
                        event = await queue.get()
                        if isinstance(event, str):
                            yield f"data: {json.dumps(error_body(event, 'server_error'))}\n\n"
                            return
                        yield f"data: {json.dumps(chunk_body(name, now, model_name, apply(event)))}\n\n"
                    done = True
                    yield "data: [DONE]\n\n"
                finally:
                    if not done:
                        scheduler.abort(rid)
            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        done = False
        try:
            while None in finish:
                try:
                    event = await asyncio.wait_for(queue.get(), _POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        log.info("client of request %d disconnected", rid)
                        return Response(status_code=499)
                    continue
                if isinstance(event, str):
                    return JSONResponse(error_body(event, "server_error"), status_code=500)
                apply(event)
            done = True
        finally:
            if not done:
                scheduler.abort(rid)
        choices = [(t.text, t.ids, f) for t, f in zip(texts, finish)]
        return JSONResponse(completion_body(name, now, model_name, choices, len(req.prompt_ids)))

    return app


class ServerThread:
    """uvicorn serving ``app`` from a background thread on a socket bound now (``port=0``: a free
    one); a context manager that stops the server on exit.

    Attributes
    ----------
    url : str
        ``http://host:port``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="treeattn-http", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > end or not self._thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(scheduler: Scheduler, *, host: str, port: int, model_name: str, tokenizer=None,
               max_model_len: int, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM), then stop the scheduler."""
    app = create_app(scheduler, model_name=model_name, tokenizer=tokenizer, max_model_len=max_model_len)
    scheduler.start()
    try:
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level)).run()
    except KeyboardInterrupt:       # uvicorn re-raises the SIGINT it shut down for: a normal exit
        log.info("stopped by SIGINT")
    finally:
        scheduler.stop()
