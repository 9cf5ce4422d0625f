"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of a :class:`Scheduler`.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` as server-sent events),
``GET /v1/models``, ``GET /health`` (the scheduler's counters; ``?decode_times_since=N`` adds the
wall and GPU times of decode steps ``N`` on, :meth:`Scheduler.decode_times`) and ``GET /metrics``
(Prometheus, with ``prometheus-client``).
Each request gets an asyncio queue that the engine thread feeds through
``loop.call_soon_threadsafe``. A client that disconnects is aborted before the engine's next step,
which frees its KV pages: a stream's generator is cancelled by Starlette, a non-streaming request
has a task watching its connection. On SIGTERM / SIGINT the server answers 503 to new requests,
gives running ones ``shutdown_grace`` seconds to finish, cancels the rest and exits.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from treeattn.serve.protocol import (
    GenerationRequest,
    ProtocolError,
    error_body,
    parse_chat,
    parse_completion,
    usage_body,
)
from treeattn.serve.parallel import ReplicatedScheduler
from treeattn.serve.scheduler import QueueFull, Scheduler

__all__ = ["create_app", "ServerThread", "run_server"]

log = logging.getLogger(__name__)

#: seconds between checks that a non-streaming client is still connected
_POLL_S = 0.05
#: ``Retry-After`` of a 429 (seconds): a queue slot frees when a running request ends
_RETRY_AFTER_S = 1
#: what a non-streaming request's watcher puts in its queue when the client has gone
_GONE = object()


class _Lifecycle:
    """Per-app switch: ``draining`` once the server got its shutdown signal."""

    def __init__(self):
        self.draining = False


class _Gate:
    """ASGI middleware in front of ``/v1``: 503 while draining, and with an API key 401 for a
    request without ``Authorization: Bearer <key>`` (``/health`` and ``/metrics`` stay open).
    Pure ASGI (not ``BaseHTTPMiddleware``), so that the endpoints still see disconnects."""

    def __init__(self, app, *, lifecycle: _Lifecycle, api_key: str | None):
        self.app, self.lifecycle = app, lifecycle
        self._want = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if self.lifecycle.draining:
                resp = JSONResponse(error_body("the server is shutting down", "server_error", code="shutting_down"),
                                    status_code=503)
                return await resp(scope, receive, send)
            if self._want is not None:
                got = Headers(scope=scope).get("authorization", "").encode()
                if not hmac.compare_digest(got, self._want):
                    resp = JSONResponse(error_body("invalid or missing API key (send 'Authorization: Bearer "
                                                   "<key>')", "invalid_request_error", code="invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                    return await resp(scope, receive, send)
        await self.app(scope, receive, send)


#: upper bounds (s) of the step-time histograms' buckets
_STEP_BUCKETS = (.001, .002, .003, .004, .005, .006, .008, .01, .0125, .015, .02, .025, .03, .04, .05, .075, .1,
                 .25, .5, 1, 2.5)


class _Metrics:
    """Prometheus metrics of one app, in its own registry: the scheduler's gauges and counters
    read at scrape time, the server's latency histograms and finish counters, and the step-time
    histograms the scheduler feeds after every step (:attr:`Scheduler.step_listeners`)."""

    def __init__(self, scheduler: Scheduler):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.ttft = Histogram("treeattn_time_to_first_token_seconds", "time from submission to the first token",
                              registry=self.registry,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.tpot = Histogram("treeattn_time_per_output_token_seconds", "mean time between a request's steps",
                              registry=self.registry,
                              buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.finished = Counter("treeattn_request_finished", "choices finished, by finish reason "
                                "(stop, length; abort: client gone; error)", ["finish_reason"],
                                registry=self.registry)
        self.step_wall = {
            "decode": Histogram("treeattn_decode_step_seconds", "wall time of a decode step (between two "
                                "waits for sampled tokens, no prefill between them)", registry=self.registry,
                                buckets=_STEP_BUCKETS),
            "prefill": Histogram("treeattn_prefill_step_seconds", "wall time of a step that prefilled (between "
                                 "two waits for sampled tokens; it holds a decode step too)",
                                 registry=self.registry, buckets=_STEP_BUCKETS)}
        self.step_gpu = Histogram("treeattn_decode_step_gpu_seconds", "GPU time of a decode step (its forward "
                                  "pass and sampling, CUDA events; none on a CPU)", registry=self.registry,
                                  buckets=_STEP_BUCKETS)
        self.registry.register(_SchedulerCollector(scheduler))
        scheduler.step_listeners.append(self.observe_step)

    def observe_step(self, kind: str, wall_s: float, gpu_s: float | None) -> None:
        self.step_wall[kind].observe(wall_s)
        if gpu_s is not None:
            self.step_gpu.observe(gpu_s)

    def render(self) -> tuple:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _SchedulerCollector:
    """The scheduler's state as Prometheus metrics (read on the engine thread at scrape time)."""

    def __init__(self, scheduler: Scheduler):
        c = scheduler.engine.model.config
        self.scheduler = scheduler
        itemsize = scheduler.engine.pool.k_cache(0).element_size()
        self.kv_bytes_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, queued = self.scheduler.stats(), self.scheduler.num_queued
        prompt = s["prefix_hit_tokens"] + s["prefill_tokens"]
        yield GaugeMetricFamily("treeattn_num_requests_waiting", "requests waiting for admission", value=queued)
        yield GaugeMetricFamily("treeattn_num_requests_running", "requests being decoded", value=s["running"])
        yield GaugeMetricFamily("treeattn_kv_pages_used", "KV pages in use (requests and cached prefixes)",
                                value=s["num_pages"] - s["free_pages"])
        yield GaugeMetricFamily("treeattn_kv_pages_total", "KV pages of the pool", value=s["num_pages"])
        yield GaugeMetricFamily("treeattn_prefix_cache_hit_rate", "prompt tokens found in the prefix cache / "
                                "prompt tokens", value=s["prefix_hit_tokens"] / prompt if prompt else 0.0)
        yield CounterMetricFamily("treeattn_prompt_tokens", "prompt tokens admitted (cached or prefilled)",
                                  value=prompt)
        yield CounterMetricFamily("treeattn_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache",
                                  value=s["prefix_hit_tokens"])
        yield CounterMetricFamily("treeattn_generation_tokens", "tokens decoded", value=s["decoded_tokens"])
        yield CounterMetricFamily("treeattn_preemptions", "requests preempted for KV pages", value=s["preemptions"])
        yield CounterMetricFamily(
            "treeattn_kv_read_saved_bytes", "KV bytes prefix-aware attention did not read: shared tokens "
            "read once per step instead of once per query (visible - unique KV tokens)",
            value=(s["kv_visible_tokens"] - s["kv_unique_tokens"]) * self.kv_bytes_per_token)


class _Choice:
    """The text, tokens and log-probabilities of one choice, assembled from its events.

    Text deltas never split a character and, while the choice runs, hold back the characters
    that could start a stop string; a stop string and what follows it are cut from the text.
    """

    def __init__(self, tokenizer, stops: tuple, offset: int = 0):
        self.tok, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids, self.text, self.sent, self.finish = [], "", 0, None
        self.lps: list = []            # (token, logprob, top) of every returned token
        self.cum = 0.0                 # cumulative logprob, with the stopping token's
        self.offset = offset           # text offset of the next token (completions' logprobs)

    def add(self, ev) -> None:
        if ev.token is not None:
            self.ids.append(ev.token)
            if ev.logprob is not None:
                self.lps.append((ev.token, ev.logprob, ev.top))
        if ev.logprob is not None:
            self.cum += ev.logprob
        self.finish = ev.finish

    def refresh(self) -> None:
        if self.tok is None:
            return
        text = self.tok.decode(self.ids)
        if self.finish == "stop" and self.stops:
            cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
            text = text[: min(cuts)] if cuts else text
        self.text = text

    def delta(self) -> str:
        """Text not sent yet that can be sent now."""
        self.refresh()
        end = len(self.text)
        if self.finish is None:
            end -= self.hold
            while end > self.sent and self.text[end - 1] == "\ufffd":     # an incomplete UTF-8 sequence
                end -= 1
        out = self.text[self.sent: max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out


def _token_str(tokenizer, t: int) -> str:
    return tokenizer.decode([t]) if tokenizer is not None else f"token_id:{t}"


def _completion_logprobs(tokenizer, entries: list, ch: _Choice) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, lp, top in entries:
        s = _token_str(tokenizer, tok)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({_token_str(tokenizer, t): v for t, v in top} if top else None)
        out["text_offset"].append(ch.offset)
        ch.offset += len(s)
    return out


def _chat_logprobs(tokenizer, entries: list) -> dict:
    def item(t, v):
        s = _token_str(tokenizer, t)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}
    return {"content": [{**item(tok, lp), "top_logprobs": [item(t, v) for t, v in top]} for tok, lp, top in entries]}


def create_app(scheduler: Scheduler, *, model_name: str, tokenizer=None, max_model_len: int,
               chat_template=None, api_key: str | None = None, metrics: bool | None = None) -> FastAPI:
    """The FastAPI app serving ``scheduler``'s engine under the name ``model_name``.

    Parameters
    ----------
    scheduler : Scheduler
        Started by the caller.
    tokenizer : tokenizers.Tokenizer, optional
        Text prompts, ``text`` outputs and stop strings need it (token ids work without).
    max_model_len : int
        Longest prompt plus ``max_tokens`` accepted; capped at what the KV pool holds for one
        request (:meth:`Scheduler.max_request_len`), which ``/v1/models`` advertises.
    chat_template : ChatTemplate, optional
        ``/v1/chat/completions`` needs it (:meth:`~treeattn.serve.chat.ChatTemplate.from_pretrained`).
    api_key : str, optional
        Every ``/v1`` request must send ``Authorization: Bearer <api_key>``.
    metrics : bool, optional
        Serve ``/metrics`` (needs ``prometheus-client``); None: when it is installed.
    """
    app = FastAPI(title="treeattn", version="0.1.0")
    lifecycle = _Lifecycle()
    app.state.lifecycle = lifecycle
    app.add_middleware(_Gate, lifecycle=lifecycle, api_key=api_key)
    vocab = scheduler.engine.model.config.vocab_size
    max_model_len = min(max_model_len, scheduler.max_request_len())
    created = int(time.time())
    meter = None
    if metrics is not False:
        try:
            meter = _Metrics(scheduler)
        except ImportError:
            if metrics:
                raise ImportError("/metrics needs prometheus-client (pip install 'treeattn[serve]')") from None
            log.warning("prometheus-client is not installed: no /metrics")

    def fits(prompt_len: int, max_tokens: int, n: int) -> bool:
        return scheduler.pages_needed(prompt_len, max_tokens, n) <= scheduler.capacity_pages

    @app.get("/health")
    async def health(decode_times_since: int | None = Query(None, ge=0)) -> dict:
        out = {"status": "ok", **await asyncio.to_thread(scheduler.stats)}
        if decode_times_since is not None:
            out["decode_times"] = await asyncio.to_thread(scheduler.decode_times, decode_times_since)
        return out

    if meter is not None:
        @app.get("/metrics")
        async def prometheus() -> Response:
            body, ctype = await asyncio.to_thread(meter.render)
            return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "treeattn", "max_model_len": max_model_len,
                                            "vocab_size": vocab}]}

    async def serve(request: Request, parse, chat: bool) -> Response:
        try:
            raw = await request.body()
        except ClientDisconnect:
            return Response(status_code=499)
        try:
            req = parse(raw)
        except ProtocolError as e:
            return JSONResponse(error_body(str(e), e.kind, e.param), status_code=e.status)
        return await _generate(request, req, chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, lambda raw: parse_completion(
            raw, model_name=model_name, tokenizer=tokenizer, vocab_size=vocab, max_model_len=max_model_len,
            fits=fits), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, lambda raw: parse_chat(
            raw, model_name=model_name, tokenizer=tokenizer, chat_template=chat_template, vocab_size=vocab,
            max_model_len=max_model_len, fits=fits), chat=True)

    async def _generate(request: Request, req: GenerationRequest, chat: bool) -> Response:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:                       # the event loop is gone (shutdown)
                log.debug("dropped an event of a request whose loop closed")

        t_submit = time.perf_counter()
        try:
            rid = scheduler.submit(req.prompt_ids, req.params, emit)
        except QueueFull as e:
            return JSONResponse(error_body(str(e), "rate_limit_error", code="queue_full"), status_code=429,
                                headers={"Retry-After": str(_RETRY_AFTER_S)})
        name = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        now = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        echo = tokenizer.decode(req.prompt_ids) if req.echo and tokenizer is not None else ""
        choices = [_Choice(tokenizer, req.params.stop, len(echo)) for _ in range(req.params.n)]
        timing = {"first": None, "last": None, "steps": 0}

        def apply(events) -> list:
            """Fold a step's events into the choices; returns the indices it touched, in order."""
            t = time.perf_counter()
            if timing["first"] is None:
                timing["first"] = t
                if meter is not None:
                    meter.ttft.observe(t - t_submit)
            timing["last"], timing["steps"] = t, timing["steps"] + 1
            touched = []
            for ev in events:
                choices[ev.choice].add(ev)
                if ev.choice not in touched:
                    touched.append(ev.choice)
            return touched

        def finished(reasons) -> None:
            if meter is None:
                return
            for r in reasons:
                meter.finished.labels(r).inc()
            if timing["steps"] > 1:
                meter.tpot.observe((timing["last"] - timing["first"]) / (timing["steps"] - 1))

        def usage(chosen) -> dict:
            return usage_body(len(req.prompt_ids), sum(len(c.ids) for c in chosen))

        def logprobs_of(ch: _Choice, entries: list):
            if req.logprobs is None:
                return None
            return _chat_logprobs(tokenizer, entries) if chat else _completion_logprobs(tokenizer, entries, ch)

        if req.stream:
            def chunk(body_choices: list, extra: dict | None = None) -> str:
                body = {"id": name, "object": f"{obj}.chunk" if chat else obj, "created": now, "model": model_name,
                        "choices": body_choices}
                if req.include_usage:
                    body["usage"] = None
                body.update(extra or {})
                return f"data: {json.dumps(body)}\n\n"

            async def sse():
                done = False
                try:
                    if chat:           # the role first, as OpenAI streams it
                        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None} for i in range(req.n)])
                    elif echo:
                        yield chunk([{"index": i, "text": echo, "token_ids": [], "logprobs": None,
                                      "finish_reason": None} for i in range(req.n)])
                    seen, seen_lp = [0] * req.n, [0] * req.n
                    while any(c.finish is None for c in choices):
                        event = await queue.get()
                        if isinstance(event, str):
                            yield f"data: {json.dumps(error_body(event, 'server_error'))}\n\n"
                            finished(["error"])
                            done = True
                            return
                        out = []
                        for i in apply(event):
                            c = choices[i]
                            ids, entries = c.ids[seen[i]:], c.lps[seen_lp[i]:]
                            seen[i], seen_lp[i] = len(c.ids), len(c.lps)
                            text = c.delta()
                            if chat:
                                out.append({"index": i, "delta": {"content": text} if text or c.finish is None
                                            else {}, "logprobs": logprobs_of(c, entries), "finish_reason": c.finish})
                            else:
                                out.append({"index": i, "text": text, "token_ids": ids,
                                            "logprobs": logprobs_of(c, entries), "finish_reason": c.finish})
                        yield chunk(out)
                    finished([c.finish for c in choices])
                    if req.include_usage:
                        yield chunk([], {"usage": usage(choices)})
                    done = True
                    yield "data: [DONE]\n\n"
                finally:
                    if not done:
                        scheduler.abort(rid)
                        finished(["abort"])
            return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(_POLL_S)
            queue.put_nowait(_GONE)

        watcher = asyncio.create_task(watch())
        done = False
        try:
            while any(c.finish is None for c in choices):
                event = await queue.get()
                if event is _GONE:
                    log.info("client of request %d disconnected", rid)
                    return Response(status_code=499)
                if isinstance(event, str):
                    done = True
                    finished(["error"])
                    return JSONResponse(error_body(event, "server_error"), status_code=500)
                apply(event)
            done = True
        finally:
            watcher.cancel()
            if not done:
                scheduler.abort(rid)
                finished(["abort"])
        finished([c.finish for c in choices])
        ranked = choices
        if len(choices) > req.n:        # best_of: the n samples of highest cumulative logprob
            ranked = sorted(choices, key=lambda c: -c.cum)[: req.n]
        body_choices = []
        for i, c in enumerate(ranked):
            c.refresh()
            lp = logprobs_of(c, c.lps)
            if chat:
                body_choices.append({"index": i, "message": {"role": "assistant", "content": c.text},
                                     "logprobs": lp, "finish_reason": c.finish})
            else:
                body_choices.append({"index": i, "text": echo + c.text, "token_ids": c.ids, "logprobs": lp,
                                     "finish_reason": c.finish})
        return JSONResponse({"id": name, "object": obj, "created": now, "model": model_name,
                             "choices": body_choices, "usage": usage(choices)})

    return app


class _Server(uvicorn.Server):
    """uvicorn that answers 503 to new requests from the moment it is told to exit, and calls
    ``before_exit`` once it has shut down, before it re-raises the signal it shut down for (whose
    default action ends the process)."""

    def __init__(self, config: uvicorn.Config, lifecycle: _Lifecycle | None, before_exit=None):
        super().__init__(config)
        self._lifecycle = lifecycle
        self._before_exit = before_exit

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:
                if self._before_exit is not None:
                    self._before_exit()

    def handle_exit(self, sig, frame) -> None:
        self.drain()
        super().handle_exit(sig, frame)

    def drain(self) -> None:
        """Refuse new requests (503) and shut down: running ones get the graceful-shutdown
        timeout to finish, then are cancelled (which aborts them in the scheduler)."""
        if self._lifecycle is not None:
            self._lifecycle.draining = True
        self.should_exit = True


def _lifecycle_of(app) -> _Lifecycle | None:
    state = getattr(app, "state", None)
    return getattr(state, "lifecycle", None)


class ServerThread:
    """uvicorn serving ``app`` from a background thread on a socket bound now (``port=0``: a free
    one); a context manager that stops the server on exit.

    Attributes
    ----------
    url : str
        ``http://host:port``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 shutdown_grace: float = 10.0):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = _Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                             timeout_graceful_shutdown=shutdown_grace), _lifecycle_of(app))
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

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down as on SIGTERM (:meth:`_Server.drain`) and wait for the thread."""
        self.server.drain()
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(scheduler: Scheduler, *, host: str, port: int, model_name: str, tokenizer=None,
               max_model_len: int, log_level: str = "info", chat_template=None, api_key: str | None = None,
               shutdown_grace: float = 10.0) -> None:
    """Serve until SIGTERM / SIGINT, then drain (:meth:`_Server.drain`) and stop the scheduler
    (a :class:`~treeattn.serve.parallel.ReplicatedScheduler` on rank 0: its stop ends every rank's
    loop)."""
    app = create_app(scheduler, model_name=model_name, tokenizer=tokenizer, max_model_len=max_model_len,
                     chat_template=chat_template, api_key=api_key)
    scheduler.start()
    # lifespan off: the app has no startup hooks, and uvicorn's re-raised SIGINT cancelled the
    # lifespan task, which logged a traceback at every Ctrl-C
    # the scheduler stops before a SIGTERM is re-raised: a replicated one tells the other ranks
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                    timeout_graceful_shutdown=shutdown_grace), _lifecycle_of(app),
                     before_exit=scheduler.stop)
    if isinstance(scheduler, ReplicatedScheduler):      # lost its other ranks: nothing left to serve
        scheduler.stop_listeners.append(server.drain)
    try:
        server.run()
    except KeyboardInterrupt:       # uvicorn re-raises the SIGINT it shut down for: a normal exit
        log.info("stopped by SIGINT")
    finally:
        scheduler.stop()
