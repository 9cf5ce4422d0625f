"""``treeattn bench serve``: request traffic replayed against a running server.

Three traffics (:data:`TRAFFICS`), each a list of :class:`TraceRequest` with Poisson arrival
times (:func:`poisson_arrivals`), everything drawn from ``seed``:

``pat-trace``
    PAT's conversation trace. Each record has ``input_length``, ``output_length`` and
    ``hash_ids`` (one id per 512-token prompt block; equal ids are shared prefix blocks). As in
    PAT's evaluation, a prompt is built from one deterministic block of random token ids per hash
    id (equal ids give equal tokens), cut to ``input_length``, after PAT's three-level system
    prompt (:data:`PAT_SYSTEM_PROMPT`); greedy, one choice (:func:`build_requests`). Decode
    batches of this trace share little of their KV (~17% at 3 req/s on an H200).
``sampling``
    best-of-N and RL rollouts through the API: ``n`` = 8-16 sampled choices (temperature 1) of a
    2-4K-token prompt of random ids, each request its own prompt (:func:`sampling_requests`);
    the ``n`` choices share their prompt's KV.
``agents``
    many users behind one deployment's system prompt: PAT's three levels (46 / 348 / 2123
    tokens over 8 locations x 4 languages, fixed by ``system_seed``) and a short user message,
    greedy, one choice (:func:`agent_requests`).

Every request streams its outputs with ``ignore_eos``, so each choice produces exactly its
``max_tokens`` and runs are comparable. Measured on the client (:func:`summarize`): TTFT, the
time from sending a request to its first token (any choice); TPOT, per *choice stream*:
``(time of its last token - time of its first) / (its tokens - 1)``, so a request of ``n``
choices adds ``n`` samples to the TPOT statistics (its choices are decoded in the same steps, so
they are close); request latency, from sending to the end of the stream (all choices); output
throughput, the tokens of every choice of the completed requests over the wall time.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["TRAFFICS", "PAT_SYSTEM_PROMPT", "TraceRequest", "load_trace", "build_requests", "arrival_times",
           "poisson_arrivals", "sampling_requests", "agent_requests", "check_traffic", "make_requests", "replay",
           "summarize", "server_snapshot", "server_delta", "provenance", "bench_serve"]

log = logging.getLogger(__name__)

#: The traffics :func:`bench_serve` sends (``treeattn bench serve --traffic``); see the module doc.
TRAFFICS = ("pat-trace", "sampling", "agents")

# second words of the seeds of each traffic's draws, so that no two traffics draw the same ids
_SAMPLING_KEY, _AGENTS_KEY, _SYSTEM_KEY = 1 << 43, 1 << 44, 1 << 41


@dataclass(frozen=True)
class TraceRequest:
    """One request to send: prompt token ids, output length (per choice), arrival time (s), number
    of choices ``n``, sampling ``temperature`` (0: greedy) and the server's sampling ``seed``."""

    prompt: list
    max_tokens: int
    arrival: float
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None


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


def system_prompt_ids(rng: np.random.Generator, *, vocab_size: int, seed: int, spec: dict,
                      tag: int = _SYSTEM_KEY) -> np.ndarray:
    """Token ids of one request's system prompt: the location and language come from ``rng``; each
    level's ids are drawn with a seed made of ``seed``, ``tag`` and the choices above it, so
    requests with the same location (and language) share them."""
    loc, lang = int(rng.integers(spec["locations"])), int(rng.integers(spec["languages"]))
    keys = ([], [loc], [loc, lang])
    return np.concatenate([np.random.default_rng([seed, tag, lvl, *key]).integers(0, vocab_size, n)
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


def poisson_arrivals(rate: float, *, seed: int = 0, count: int | None = None,
                     duration: float | None = None) -> np.ndarray:
    """Arrival times (s, float64, ascending, the first at 0) of a Poisson process of ``rate``
    requests/s: the first ``count``, and of those the ones before ``duration``. The gaps are drawn
    in order from one generator, so a longer ``duration`` only appends arrivals."""
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0, got {rate}")
    if count is None and duration is None:
        raise ValueError("poisson_arrivals needs a count or a duration")
    if count is None:
        lam = rate * duration                      # 10 standard deviations above the mean count
        count = int(lam + 10 * np.sqrt(lam) + 20)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, count)
    t = np.concatenate(([0.0], np.cumsum(gaps)[:-1])) if count else gaps
    return t if duration is None else t[t < duration]


def arrival_times(trace: list, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times (s) of the trace's records: a Poisson process of ``rate`` requests/s, or the
    trace's own ``timestamp`` (ms, from the first) when ``rate <= 0``."""
    if rate <= 0:
        ts = np.asarray([r.get("timestamp", 0) for r in trace], dtype=np.float64) / 1e3
        return ts - (ts.min() if ts.size else 0.0)
    return poisson_arrivals(rate, seed=seed, count=len(trace))


def _range(name: str, lo_hi, lo: int = 1, hi: int | None = None) -> tuple[int, int]:
    """``lo_hi`` as an inclusive (min, max) pair of ints within [lo, hi]; a ValueError names it."""
    try:
        a, b = (int(x) for x in lo_hi)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (min, max) pair of integers, got {lo_hi!r}") from None
    if not lo <= a <= b or (hi is not None and b > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be min <= max within {bound}, got {lo_hi!r}")
    return a, b


def _fit(n_in: int, n_out: int, head: int, max_model_len: int | None) -> tuple[int, int]:
    """Prompt (less ``head`` tokens) and output lengths cut so that all fits ``max_model_len``:
    the output first keeps room for one prompt token past the head."""
    if max_model_len is None:
        return n_in, n_out
    if max_model_len < head + 2:
        raise ValueError(f"max_model_len {max_model_len} leaves no room after a {head}-token shared prompt")
    n_out = min(n_out, max_model_len - head - 1)
    return min(n_in, max_model_len - head - n_out), n_out


def sampling_requests(arrivals, *, vocab_size: int, seed: int = 0, n=(8, 16), prompt_len=(2048, 4096),
                      output_len=(128, 512), temperature: float = 1.0,
                      max_model_len: int | None = None) -> list:
    """The ``sampling`` traffic: per arrival, ``n`` choices of one prompt of random ids.

    Parameters
    ----------
    arrivals : array of float, shape (R,)
        Arrival times (s), e.g. :func:`poisson_arrivals`.
    vocab_size : int
        Prompt ids are drawn from ``[0, vocab_size)``.
    seed : int
        Request ``i`` draws its ``n``, prompt length, output length, prompt ids and the server's
        sampling seed from ``(seed, i)``: the same seed gives the same requests, every request its
        own prompt.
    n, prompt_len, output_len : (int, int)
        Inclusive ranges, drawn uniformly per request (``n`` at most 64, the server's limit).
    temperature : float
        Of every request (> 0: sampled).
    max_model_len : int, optional
        Prompt plus output are cut to fit it (the output first keeps one prompt token).

    Returns
    -------
    list of TraceRequest, in arrival order.
    """
    n, prompt_len, output_len = (_range("n", n, 1, 64), _range("prompt_len", prompt_len),
                                 _range("output_len", output_len))
    if not temperature > 0:
        raise ValueError(f"the sampling traffic needs a temperature > 0, got {temperature}")
    out = []
    for i, t in enumerate(np.asarray(arrivals, dtype=np.float64)):
        rng = np.random.default_rng([seed, _SAMPLING_KEY, i])
        k, n_in, n_out = (int(rng.integers(a, b + 1)) for a, b in (n, prompt_len, output_len))
        n_in, n_out = _fit(n_in, n_out, 0, max_model_len)
        prompt = rng.integers(0, vocab_size, n_in).tolist()
        out.append(TraceRequest(prompt, n_out, float(t), n=k, temperature=float(temperature),
                                seed=int(rng.integers(1 << 62))))
    return out


def agent_requests(arrivals, *, vocab_size: int, seed: int = 0, system_seed: int = 0,
                   system_prompt: dict = PAT_SYSTEM_PROMPT, user_len=(50, 300), output_len=(100, 400),
                   max_model_len: int | None = None) -> list:
    """The ``agents`` traffic: per arrival, a system prompt (:func:`system_prompt_ids`) and a user
    message of random ids; one greedy choice.

    Parameters
    ----------
    arrivals : array of float, shape (R,)
        Arrival times (s).
    vocab_size : int
        Ids are drawn from ``[0, vocab_size)``.
    seed : int
        Request ``i`` draws its location, language, lengths and user message from ``(seed, i)``.
    system_seed : int
        Seed of the system prompt's ids: the deployment's prompt, the same for every ``seed``, so
        that runs with other seeds find it in the server's prefix cache as real traffic does.
    system_prompt : dict
        Level lengths, locations and languages (:data:`PAT_SYSTEM_PROMPT`).
    user_len, output_len : (int, int)
        Inclusive ranges, drawn uniformly per request.
    max_model_len : int, optional
        User message and output are cut so that everything fits it.

    Returns
    -------
    list of TraceRequest, in arrival order.
    """
    user_len, output_len = _range("user_len", user_len), _range("output_len", output_len)
    head = sum(int(x) for x in system_prompt["levels"])
    out = []
    for i, t in enumerate(np.asarray(arrivals, dtype=np.float64)):
        rng = np.random.default_rng([seed, _AGENTS_KEY, i])
        # tagged apart from pat-trace's system prompts, which are drawn with the run's seed
        sys_ids = system_prompt_ids(rng, vocab_size=vocab_size, seed=system_seed, spec=system_prompt,
                                    tag=_AGENTS_KEY + 1)
        n_in, n_out = (int(rng.integers(a, b + 1)) for a, b in (user_len, output_len))
        n_in, n_out = _fit(n_in, n_out, head, max_model_len)
        prompt = np.concatenate((sys_ids, rng.integers(0, vocab_size, n_in))).tolist()
        out.append(TraceRequest(prompt, n_out, float(t)))
    return out


_OPTIONS = {"sampling": {"n", "prompt_len", "output_len", "temperature"},
            "agents": {"user_len", "output_len", "system_seed"}}


def check_traffic(traffic: str, *, rate: float, duration: float | None = None, max_requests: int | None = None,
                  trace_path=None, max_input_len: int | None = None, max_output_len: int | None = None,
                  system_prompt: dict | None = PAT_SYSTEM_PROMPT, options: dict | None = None) -> None:
    """Raise a ValueError naming the problem when :func:`make_requests` cannot build this run
    (checked before any request is built or sent)."""
    options = options or {}
    if traffic not in TRAFFICS:
        raise ValueError(f"unknown traffic {traffic!r}; expected one of {', '.join(TRAFFICS)}")
    if traffic == "pat-trace":
        if options:
            raise ValueError(f"the pat-trace traffic takes no options, got {sorted(options)}")
        if trace_path is None:
            raise ValueError("the pat-trace traffic needs a trace file")
        return
    if trace_path is not None or max_input_len is not None or max_output_len is not None:
        raise ValueError(f"a trace file, max_input_len and max_output_len belong to pat-trace, not to "
                         f"{traffic} (whose lengths are its options)")
    if not rate > 0:
        raise ValueError(f"the {traffic} traffic needs a request rate > 0, got {rate}")
    if duration is None and max_requests is None:
        raise ValueError(f"the {traffic} traffic needs a duration or a number of requests")
    if traffic == "agents" and system_prompt is None:
        raise ValueError("the agents traffic needs a system prompt")
    bad = sorted(set(options) - _OPTIONS[traffic])
    if bad:
        raise ValueError(f"unknown {traffic} options {bad}; expected some of {sorted(_OPTIONS[traffic])}")
    for k in ("n", "prompt_len", "output_len", "user_len"):
        if k in options:
            _range(k, options[k], 1, 64 if k == "n" else None)
    if "temperature" in options and not options["temperature"] > 0:
        raise ValueError(f"the sampling traffic needs a temperature > 0, got {options['temperature']}")


def make_requests(traffic: str, *, vocab_size: int, rate: float, seed: int = 0, duration: float | None = None,
                  max_requests: int | None = None, max_model_len: int | None = None, trace_path=None,
                  block_tokens: int = 512, max_input_len: int | None = None, max_output_len: int | None = None,
                  system_prompt: dict | None = PAT_SYSTEM_PROMPT, options: dict | None = None) -> list:
    """The requests of one run of ``traffic`` (:data:`TRAFFICS`) arriving within ``duration``
    seconds (and at most ``max_requests``) at ``rate`` requests/s.

    ``pat-trace`` uses ``trace_path``, ``block_tokens``, ``max_input_len``, ``max_output_len`` and
    ``system_prompt`` (None: the trace prompts alone; :func:`build_requests`), and ``rate <= 0``
    replays the trace's timestamps. ``sampling`` and ``agents`` take ``options``, keyword
    arguments of :func:`sampling_requests` and :func:`agent_requests` (``agents`` also takes
    ``system_prompt``), and need ``rate > 0`` and a ``duration`` or ``max_requests``
    (:func:`check_traffic`).
    """
    check_traffic(traffic, rate=rate, duration=duration, max_requests=max_requests, trace_path=trace_path,
                  max_input_len=max_input_len, max_output_len=max_output_len, system_prompt=system_prompt,
                  options=options)
    if traffic == "pat-trace":
        trace = load_trace(trace_path, max_requests)
        arrivals = arrival_times(trace, rate, seed)
        keep = len(trace) if duration is None else int(np.searchsorted(arrivals, duration, side="left"))
        return build_requests(trace[:keep], vocab_size=vocab_size, arrivals=arrivals[:keep],
                              block_tokens=block_tokens, seed=seed, max_input_len=max_input_len,
                              max_output_len=max_output_len, max_model_len=max_model_len,
                              system_prompt=system_prompt)
    arrivals = poisson_arrivals(rate, seed=seed, count=max_requests, duration=duration)
    if traffic == "sampling":
        return sampling_requests(arrivals, vocab_size=vocab_size, seed=seed, max_model_len=max_model_len,
                                 **(options or {}))
    return agent_requests(arrivals, vocab_size=vocab_size, seed=seed, max_model_len=max_model_len,
                          system_prompt=system_prompt, **(options or {}))


def _verify(url: str) -> bool:
    """httpx's ``verify``: plain http needs no certificates (loading them costs ~0.15 s a client)."""
    return not url.startswith("http://")


async def _send(client, model: str, req: TraceRequest, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    start = time.perf_counter()
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": req.temperature,
            "stream": True, "ignore_eos": True}
    if req.n != 1:
        body["n"] = req.n
    if req.seed is not None:
        body["seed"] = req.seed
    res = {"ok": False, "ttft": None, "latency": None, "tokens": 0, "status": None, "error": None,
           "prompt_tokens": len(req.prompt), "choices": req.n, "tpot": []}
    got = [0] * req.n                  # tokens, first and last token time of every choice stream
    first, last = [None] * req.n, [None] * req.n
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
                now = time.perf_counter()
                for c in chunk["choices"]:
                    k, i = len(c.get("token_ids", [])), c.get("index", 0)
                    if not k:
                        continue
                    if res["ttft"] is None:
                        res["ttft"] = now - start
                    if first[i] is None:
                        first[i] = now
                    got[i], last[i] = got[i] + k, now
        res["latency"] = time.perf_counter() - start
        res["tokens"] = sum(got)
        res["tpot"] = [(b - a) / (k - 1) for a, b, k in zip(first, last, got) if k > 1]
        res["ok"] = all(k == req.max_tokens for k in got)
        if not res["ok"]:
            res["error"] = f"got {sorted(set(got))} of {req.max_tokens} tokens per choice"
    except Exception as e:  # a failed request is counted, not fatal
        res["tokens"] = sum(got)
        res["error"] = f"{type(e).__name__}: {e}"
    return res


def _cancelled(req: TraceRequest) -> dict:
    return {"ok": False, "ttft": None, "latency": None, "tokens": 0, "status": None,
            "error": "cancelled at the deadline", "prompt_tokens": len(req.prompt), "choices": req.n, "tpot": []}


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
    async with httpx.AsyncClient(base_url=url, timeout=t, limits=limits, verify=_verify(url)) as client:
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


def _stats(values, *, scale: float = 1e3) -> dict:
    a = np.asarray([v for v in values if v is not None], dtype=np.float64) * scale
    if not a.size:
        return {"mean_ms": None, "p50_ms": None, "p99_ms": None}
    return {"mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)),
            "p99_ms": float(np.percentile(a, 99))}


def summarize(results: list, wall: float) -> dict:
    """Counts, throughput and TTFT / TPOT / latency statistics (ms) of :func:`replay`'s results.

    Only completed requests count in the statistics and throughputs. TTFT and latency have one
    sample a request, TPOT one a choice stream (see the module doc); ``output_throughput`` is
    tokens/s summed over every choice, ``request_throughput`` requests/s.
    """
    ok = [r for r in results if r["ok"]]
    errors = sorted({str(r["error"]) for r in results if not r["ok"]})
    out_tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
            "rejected_429": sum(r["status"] == 429 for r in results), "duration_s": wall,
            "choices": sum(r.get("choices", 1) for r in ok), "output_tokens": out_tokens,
            "request_throughput": len(ok) / wall if wall else 0.0,
            "output_throughput": out_tokens / wall if wall else 0.0,
            "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
            "ttft": _stats(r["ttft"] for r in ok), "tpot": _stats(x for r in ok for x in r["tpot"]),
            "latency": _stats(r["latency"] for r in ok), "errors": errors[:5]}


def server_snapshot(url: str, *, client=None, since: dict | None = None) -> dict | None:
    """A treeattn server's counters: its ``GET /health`` payload, plus ``kv_read_saved_bytes`` from
    ``GET /metrics`` where it serves one. None from a server without ``/health``. ``client``: an
    ``httpx.Client`` to reuse (a new one costs an SSL context). ``since``: an earlier snapshot; the
    payload then holds ``decode_times``, the wall and GPU times of the decode steps since it."""
    import httpx

    if client is None:
        with httpx.Client(timeout=60, verify=_verify(url)) as c:
            return server_snapshot(url, client=c, since=since)
    params = {}
    if since and "decode_steps" in since:
        params["decode_times_since"] = since["decode_steps"]
    try:
        r = client.get(f"{url}/health", params=params)
        out = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if out is None:
        return None
    try:
        r = client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return out
    for line in r.text.splitlines() if r.status_code == 200 else ():
        if line.startswith("treeattn_kv_read_saved_bytes"):    # Prometheus adds _total to counters
            out["kv_read_saved_bytes"] = float(line.split()[-1])
    return out


def server_delta(before: dict | None, after: dict | None) -> dict:
    """Server-side counters of one run: differences of two :func:`server_snapshot` payloads.

    Derived: ``mean_batch`` (sequences per step); ``kv_io_saving``, ``1 - kv_unique_tokens /
    kv_visible_tokens``, the share of decode attention's KV reads that reading each shared token
    once saves (an upper bound of what prefix-aware attention can save); ``prefix_hit_rate``,
    prompt tokens found in the prefix cache over prompt tokens admitted; ``decode_step_ms``, the
    mean wall time between device waits without a prefill; ``prefill_share``, the share of the
    timed wall time that prefills took, each prefill interval less one ``decode_step_ms``. From
    ``after``'s ``decode_times`` (:func:`server_snapshot` with ``since``): ``decode_step_wall``
    and ``decode_step_gpu``, the mean / p50 / p99 wall and GPU ms of the run's decode steps (GPU:
    those that have a GPU time, ``decode_gpu_steps`` of them; none on a CPU), and
    ``decode_wall_over_gpu``, their wall time over their GPU time (the engine's host target:
    at most 1.10).
    """
    if not before or not after:
        return {}
    out = {}
    for k in ("steps", "preemptions", "decoded_tokens", "prefix_hit_tokens", "prefill_tokens", "plan_ms",
              "kv_visible_tokens", "kv_unique_tokens", "prefill_ms", "prefill_steps", "decode_ms",
              "decode_steps", "decode_gpu_steps", "kv_read_saved_bytes"):
        if k in before and k in after:
            out[k] = after[k] - before[k]
    if out.get("steps"):
        out["mean_batch"] = out.get("decoded_tokens", 0) / out["steps"]
    if out.get("kv_visible_tokens"):
        out["kv_io_saving"] = 1.0 - out["kv_unique_tokens"] / out["kv_visible_tokens"]
    prompt = out.get("prefix_hit_tokens", 0) + out.get("prefill_tokens", 0)
    if prompt:
        out["prefix_hit_rate"] = out["prefix_hit_tokens"] / prompt
    if "decode_ms" in out and out["steps"] > out["prefill_steps"]:
        step = out["decode_step_ms"] = out["decode_ms"] / (out["steps"] - out["prefill_steps"])
        total = out["prefill_ms"] + out["decode_ms"]
        out["prefill_share"] = max(0.0, out["prefill_ms"] - out["prefill_steps"] * step) / total
    times = after.get("decode_times")
    if times:
        wall, gpu = np.asarray(times["wall_ms"], dtype=np.float64), times["gpu_ms"]
        timed = np.asarray([g is not None for g in gpu], dtype=bool)
        out["decode_step_wall"] = _stats(wall, scale=1.0)
        out["decode_step_gpu"] = _stats(gpu, scale=1.0)
        if timed.any():
            out["decode_wall_over_gpu"] = float(wall[timed].sum() / sum(g for g in gpu if g is not None))
    if "strategies" in after:
        b = before.get("strategies", {})
        out["strategies"] = {k: v - b.get(k, 0) for k, v in after["strategies"].items() if v - b.get(k, 0)}
    for k in ("max_batch_seen", "num_pages", "free_pages", "cached_blocks"):
        if k in after:
            out[k] = after[k]
    return out


def provenance(device: str | None = None) -> dict:
    """Device, library versions and commit of this host: :func:`treeattn.bench.timing.provenance`
    on CUDA, the same keys elsewhere (``TREEATTN_COMMIT`` overrides ``git``)."""
    import torch

    if (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
        from treeattn.bench.timing import provenance as cuda_provenance
        return cuda_provenance()
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    commit = os.environ.get("TREEATTN_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=True, cwd=str(Path(__file__).parent)).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {"device": f"cpu ({platform.processor() or platform.machine()})", "torch": torch.__version__,
            "triton": tv, "python": platform.python_version(), "commit": commit}


def bench_serve(trace_path=None, *, url: str, rate: float, traffic: str = "pat-trace",
                duration: float | None = None, max_requests: int | None = None, block_tokens: int = 512,
                seed: int = 0, max_input_len: int | None = None, max_output_len: int | None = None,
                timeout: float = 600.0, progress: bool = True, deadline: float | None = None,
                system_prompt: dict | None = PAT_SYSTEM_PROMPT, options: dict | None = None,
                server_stats: bool = True) -> dict:
    """Send one run of ``traffic`` at ``rate`` to the server at ``url`` and summarise it.

    The requests are :func:`make_requests`' (``trace_path`` and the pat-trace options, or the
    sampling / agents ``options``); only those arriving within ``duration`` seconds (and the
    first ``max_requests``) are sent. The model's name, vocabulary and length limit come from
    ``GET /v1/models``. Requests not done ``deadline`` seconds after the first arrival are
    cancelled and count as failed. With ``server_stats``, the summary's ``server`` holds the
    server's own counters over the run (:func:`server_delta`; empty from a server without
    ``/health``).
    """
    import httpx

    if traffic == "pat-trace" and trace_path is None:
        from treeattn.tree import find_shared
        trace_path = find_shared() / "workloads" / "pat" / "conversation_trace.jsonl"
    check_traffic(traffic, rate=rate, duration=duration, max_requests=max_requests, trace_path=trace_path,
                  max_input_len=max_input_len, max_output_len=max_output_len, system_prompt=system_prompt,
                  options=options)
    with httpx.Client(timeout=60, verify=_verify(url)) as client:
        info = client.get(f"{url}/v1/models").json()["data"][0]
        requests = make_requests(traffic, vocab_size=int(info["vocab_size"]), rate=rate, seed=seed,
                                 duration=duration, max_requests=max_requests,
                                 max_model_len=info.get("max_model_len"), trace_path=trace_path,
                                 block_tokens=block_tokens, max_input_len=max_input_len,
                                 max_output_len=max_output_len, system_prompt=system_prompt, options=options)
        log.info("sending %d %s requests at %s req/s to %s", len(requests), traffic,
                 rate if rate > 0 else "trace timestamps", url)
        before = server_snapshot(url, client=client) if server_stats else None
        results, wall = asyncio.run(replay(url, requests, model=info["id"], timeout=timeout, progress=progress,
                                           deadline=deadline))
        after = server_snapshot(url, client=client) if server_stats else None
    summary = summarize(results, wall)
    summary.update(traffic=traffic, rate=rate, seed=seed, url=url, model=info["id"],
                   cancelled=sum(r["error"] == "cancelled at the deadline" for r in results))
    if traffic == "pat-trace":
        summary.update(trace=str(trace_path), block_tokens=block_tokens, system_prompt=system_prompt)
    else:
        summary.update(options=dict(options or {}),
                       **({"system_prompt": system_prompt} if traffic == "agents" else {}))
    if server_stats:
        summary["server"] = server_delta(before, after)
    return summary
