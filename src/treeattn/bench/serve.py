"""``treeattn bench serve``: replay PAT's conversation trace against a running server.

Each trace record has ``input_length``, ``output_length`` and ``hash_ids`` (one id per 512-token
prompt block; equal ids are shared prefix blocks). As in PAT's evaluation, a prompt is built from
one deterministic block of random token ids per hash id (equal ids give equal tokens), cut to
``input_length``, after PAT's three-level system prompt (:data:`PAT_SYSTEM_PROMPT`). Requests arrive as a Poisson process of the given rate (or at the trace's own
timestamps) and stream their outputs, so that TTFT (time to the first token), TPOT (time per
output token after the first) and request latency can be measured on the client.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["TraceRequest", "load_trace", "build_requests", "arrival_times", "replay", "summarize",
           "bench_serve"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceRequest:
    """One request to send: prompt token ids, output length and arrival time (s)."""

    prompt: list
    max_tokens: int
    arrival: float


def load_trace(path, limit: int | None = None) -> list:
    """The first ``limit`` records (all when None) of a JSON-lines trace."""
    out = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                out.append(json.loads(line))
    return out


#: PAT's conversation workload puts the Meta-AI system instruction (pat/system_prompt.template)
#: before every trace prompt, its {LOCATION} and {LANGUAGE} fields drawn at random: a three-level
#: shared prefix of 46, 348 and 2123 tokens (Llama-3 tokenizer, PAT Sec. 8.1). Level 2 depends on
#: the location, level 3 on location and language; we draw them from 8 locations x 4 languages.
PAT_SYSTEM_PROMPT = {"levels": (46, 348, 2123), "locations": 8, "languages": 4}


def system_prompt_ids(rng: np.random.Generator, *, vocab_size: int, seed: int, spec: dict) -> np.ndarray:
    """Token ids of one request's system prompt: each level's ids are drawn with a seed made of
    the choices above it, so requests with the same location (and language) share them."""
    loc, lang = int(rng.integers(spec["locations"])), int(rng.integers(spec["languages"]))
    keys = ([], [loc], [loc, lang])
    return np.concatenate([np.random.default_rng([seed, 1 << 41, lvl, *key]).integers(0, vocab_size, n)
                           for lvl, (n, key) in enumerate(zip(spec["levels"], keys))])


def build_requests(trace: list, *, vocab_size: int, arrivals: np.ndarray, block_tokens: int = 512,
                   seed: int = 0, max_input_len: int | None = None, max_output_len: int | None = None,
                   max_model_len: int | None = None, system_prompt: dict | None = None) -> list:
    """Prompts of the trace records: block ``h`` is ``block_tokens`` random ids drawn with seed
    ``(seed, h)``; tokens beyond the blocks are drawn per request. With ``system_prompt`` (e.g.
    :data:`PAT_SYSTEM_PROMPT`) each prompt starts with a multi-level system prompt
    (:func:`system_prompt_ids`). Trace inputs (``max_input_len``) and outputs are capped (inputs
    keep their leading, shared blocks) so that prompt plus output fits ``max_model_len``."""
    blocks: dict = {}
    sys_rng = np.random.default_rng([seed, 1 << 42])

    def block(h: int) -> np.ndarray:
        if h not in blocks:
            blocks[h] = np.random.default_rng([seed, h]).integers(0, vocab_size, block_tokens)
        return blocks[h]

    out = []
    for i, (rec, t) in enumerate(zip(trace, arrivals)):
        n_in, n_out = int(rec["input_length"]), max(1, int(rec["output_length"]))
        if max_output_len is not None:
            n_out = min(n_out, max_output_len)
        head = (system_prompt_ids(sys_rng, vocab_size=vocab_size, seed=seed, spec=system_prompt)
                if system_prompt else np.zeros(0, np.int64))
        if max_input_len is not None:
            n_in = min(n_in, max_input_len)
        if max_model_len is not None:
            n_in = min(n_in, max_model_len - n_out - head.size)
        n_in = max(1, n_in)
        ids = np.concatenate([block(int(h)) for h in rec["hash_ids"]] or [np.zeros(0, np.int64)])
        if ids.size < n_in:
            extra = np.random.default_rng([seed, 1 << 40, i]).integers(0, vocab_size, n_in - ids.size)
            ids = np.concatenate((ids, extra))
        out.append(TraceRequest(np.concatenate((head, ids[:n_in])).tolist(), n_out, float(t)))
    return out


def arrival_times(trace: list, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times (s): a Poisson process of ``rate`` requests/s, or the trace's own
    ``timestamp`` (ms, from the first) when ``rate <= 0``."""
    if rate <= 0:
        ts = np.asarray([r.get("timestamp", 0) for r in trace], dtype=np.float64) / 1e3
        return ts - (ts.min() if ts.size else 0.0)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(trace))
    return np.concatenate(([0.0], np.cumsum(gaps)[:-1])) if len(trace) else gaps


async def _send(client, model: str, req: TraceRequest, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    start = time.perf_counter()
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    res = {"ok": False, "ttft": None, "latency": None, "tokens": 0, "status": None, "error": None,
           "prompt_tokens": len(req.prompt)}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            res["status"] = r.status_code
            if r.status_code != 200:
                res["error"] = (await r.aread()).decode(errors="replace")[:200]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res["error"] = chunk["error"]["message"]
                    return res
                got = sum(len(c.get("token_ids", [])) for c in chunk["choices"])
                if got and res["ttft"] is None:
                    res["ttft"] = time.perf_counter() - start
                res["tokens"] += got
        res["latency"] = time.perf_counter() - start
        res["ok"] = res["tokens"] == req.max_tokens
        if not res["ok"]:
            res["error"] = f"got {res['tokens']} of {req.max_tokens} tokens"
    except Exception as e:  # a failed request is counted, not fatal
        res["error"] = f"{type(e).__name__}: {e}"
    return res


def _cancelled(req: TraceRequest) -> dict:
    return {"ok": False, "ttft": None, "latency": None, "tokens": 0, "status": None,
            "error": "cancelled at the deadline", "prompt_tokens": len(req.prompt)}


async def replay(url: str, requests: list, *, model: str, timeout: float = 600.0,
                 progress: bool = True, deadline: float | None = None) -> tuple[list, float]:
    """Send ``requests`` at their arrival times (streaming) and wait for all; returns the
    per-request results (in order) and the wall time. Requests still unfinished ``deadline``
    seconds after the first arrival are cancelled (their connections closed, which aborts them on
    the server) and count as failed."""
    import httpx
    from tqdm.auto import tqdm

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    t = httpx.Timeout(timeout, connect=min(timeout, 30.0), pool=None)
    async with httpx.AsyncClient(base_url=url, timeout=t, limits=limits) as client:
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
        t0 = time.perf_counter()

        async def one(req):
            r = await _send(client, model, req, t0)
            bar.update(1)
            return r
        tasks = [asyncio.ensure_future(one(r)) for r in requests]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=deadline)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
        bar.close()
    results = [t.result() if not t.cancelled() else _cancelled(r) for t, r in zip(tasks, requests)]
    return results, wall


def _stats(values) -> dict:
    a = np.asarray([v for v in values if v is not None], dtype=np.float64) * 1e3
    if not a.size:
        return {"mean_ms": None, "p50_ms": None, "p99_ms": None}
    return {"mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)),
            "p99_ms": float(np.percentile(a, 99))}


def summarize(results: list, wall: float) -> dict:
    """Counts, throughput and TTFT / TPOT / latency statistics (ms) of :func:`replay`'s results."""
    ok = [r for r in results if r["ok"]]
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    errors = sorted({str(r["error"]) for r in results if not r["ok"]})
    return {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
            "rejected_429": sum(r["status"] == 429 for r in results), "duration_s": wall,
            "request_throughput": len(ok) / wall if wall else 0.0,
            "output_throughput": sum(r["tokens"] for r in ok) / wall if wall else 0.0,
            "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
            "ttft": _stats(r["ttft"] for r in ok), "tpot": _stats(tpot),
            "latency": _stats(r["latency"] for r in ok), "errors": errors[:5]}


def bench_serve(trace_path, *, url: str, rate: float, duration: float | None = None,
                max_requests: int | None = None, block_tokens: int = 512, seed: int = 0,
                max_input_len: int | None = None, max_output_len: int | None = None,
                timeout: float = 600.0, progress: bool = True, deadline: float | None = None,
                system_prompt: dict | None = PAT_SYSTEM_PROMPT) -> dict:
    """Replay the trace at ``rate`` against the server at ``url`` and summarise (see module doc;
    ``system_prompt``: see :func:`build_requests`, None for the trace prompts alone).

    Only requests arriving within ``duration`` seconds (and the first ``max_requests``) are sent;
    the model's name, vocabulary and length limit come from ``GET /v1/models``. Requests not done
    ``deadline`` seconds after the first arrival are cancelled and count as failed.
    """
    import httpx

    info = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    trace = load_trace(trace_path, max_requests)
    arrivals = arrival_times(trace, rate, seed)
    keep = len(trace) if duration is None else int(np.searchsorted(arrivals, duration, side="left"))
    requests = build_requests(trace[:keep], vocab_size=int(info["vocab_size"]), arrivals=arrivals[:keep],
                              block_tokens=block_tokens, seed=seed, max_input_len=max_input_len,
                              max_output_len=max_output_len, max_model_len=info.get("max_model_len"),
                              system_prompt=system_prompt)
    log.info("replaying %d requests of %s at %s req/s against %s", len(requests), Path(trace_path).name,
             rate if rate > 0 else "trace timestamps", url)
    results, wall = asyncio.run(replay(url, requests, model=info["id"], timeout=timeout, progress=progress,
                                       deadline=deadline))
    summary = summarize(results, wall)
    summary.update(trace=str(trace_path), rate=rate, url=url, model=info["id"], block_tokens=block_tokens,
                   system_prompt=system_prompt,
                   cancelled=sum(r["error"] == "cancelled at the deadline" for r in results))
    return summary
