"""Online serving on the CPU: the OpenAI-compatible server with a tiny random model on 127.0.0.1
(continuous batching, prefix cache, streaming, errors, queue limit, disconnects, a bounded load
test, trace replay)."""
import asyncio
import json
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from treeattn.engine import Sampler, SamplingController, TreeEngine, TreeModel  # noqa: E402
from treeattn.serve import PrefixCache, Scheduler  # noqa: E402
from treeattn.serve.server import ServerThread, create_app  # noqa: E402

VOCAB = 256
MAX_LEN = 512


def _server(kv_tokens=4096, start=True, **kw):
    engine = TreeEngine(TreeModel.random("tiny"), kv_tokens=kv_tokens, page_size=16, keep_reserved=True)
    sched = Scheduler(engine, block_tokens=16, **kw)
    if start:
        sched.start()
    app = create_app(sched, model_name="tiny", max_model_len=MAX_LEN)
    return sched, ServerThread(app).start()


@pytest.fixture(scope="module")
def server(one_thread):
    sched, srv = _server(max_queue=1024, max_batch=32)
    yield sched, srv
    srv.stop()
    sched.stop()


@pytest.fixture(scope="module")
def offline(one_thread):
    """Greedy continuation of a prompt by the offline engine (a model with the same weights)."""
    engine = TreeEngine(TreeModel.random("tiny"), kv_tokens=4096)

    def run(prompt, k):
        engine.reset()
        out = engine.run(SamplingController([prompt], sampler=Sampler(greedy=True), max_new_tokens=k))
        return out["leaves"][0]["tokens"][len(prompt):]
    return run


def _wait_idle(sched, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = sched.stats()
        if s["running"] == 0 and s["waiting"] == 0 and sched.num_queued == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"the scheduler did not become idle: {sched.stats()}")


def _assert_no_leak(sched):
    _wait_idle(sched)
    sched.flush_cache()
    s = sched.stats()
    assert s["free_pages"] == s["num_pages"], s
    sched.call(sched.engine.pool.check)


async def _complete(client, body):
    """POST a completion (streaming or not); returns (status, token ids per choice, finish reasons)."""
    if not body.get("stream"):
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return r.status_code, None, None
        ch = r.json()["choices"]
        return 200, [c["token_ids"] for c in ch], [c["finish_reason"] for c in ch]
    n = body.get("n", 1)
    ids, fin, done = [[] for _ in range(n)], [None] * n, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, None, None
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    ids[c["index"]] += c["token_ids"]
                    fin[c["index"]] = c["finish_reason"] or fin[c["index"]]
    assert done
    return 200, ids, fin


def _prompts(rng, count, shared=3):
    bases = [rng.integers(0, VOCAB, int(rng.integers(20, 60))).tolist() for _ in range(shared)]
    return [bases[i % shared] + rng.integers(0, VOCAB, int(rng.integers(1, 20))).tolist() for i in range(count)]


def test_models_and_health(server):
    _, srv = server
    m = httpx.get(f"{srv.url}/v1/models", timeout=10).json()
    assert m["data"][0]["id"] == "tiny" and m["data"][0]["vocab_size"] == VOCAB
    h = httpx.get(f"{srv.url}/health", timeout=10).json()
    assert h["status"] == "ok" and h["num_pages"] > 0


def test_greedy_equals_offline_engine(server, offline, rng):
    sched, srv = server
    prompts = _prompts(rng, 8)
    k = 6

    async def go():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            return await asyncio.gather(*(_complete(c, {"prompt": p, "max_tokens": k, "temperature": 0,
                                                        "stream": i % 2 == 1}) for i, p in enumerate(prompts)))
    got = asyncio.run(go())
    for p, (status, ids, fin) in zip(prompts, got):
        assert status == 200 and fin == ["length"]
        assert ids[0] == offline(p, k)
    assert sched.stats()["prefix_hit_tokens"] > 0          # the shared bases were reused


def test_sampling_choices_are_seeded(server):
    _, srv = server
    body = {"prompt": list(range(1, 30)), "max_tokens": 5, "temperature": 0.9, "top_p": 0.95, "n": 3,
            "seed": 11}
    a = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()
    b = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    assert len(a["choices"]) == 3 and all(len(c["token_ids"]) == 5 for c in a["choices"])
    assert a["usage"] == {"prompt_tokens": 29, "completion_tokens": 15, "total_tokens": 44}


@pytest.mark.parametrize("raw", [
    b"{not json", b"[1, 2]", b'{"max_tokens": 4}', b'{"prompt": []}', b'{"prompt": [1, 999]}',
    b'{"prompt": [1, -1]}', b'{"prompt": "text needs a tokenizer"}', b'{"prompt": [1], "max_tokens": 0}',
    b'{"prompt": [1], "max_tokens": "8"}', b'{"prompt": [1], "temperature": -1}',
    b'{"prompt": [1], "top_p": 0}', b'{"prompt": [1], "n": 0}', b'{"prompt": [1], "stream": "yes"}',
    b'{"prompt": [1], "suffix": "x"}', b'{"prompt": [[1], [2]]}', b'{"prompt": [true]}',
    b'{"prompt": [1], "max_tokens": 600}', b'{"prompt": [1], "n": 64, "max_tokens": 400}',
])
def test_bad_requests_get_400(server, raw):
    _, srv = server
    r = httpx.post(f"{srv.url}/v1/completions", content=raw, timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_oversized_prompt_and_unknown_model(server):
    _, srv = server
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1] * MAX_LEN, "max_tokens": 1}, timeout=10)
    assert r.status_code == 400 and "exceeds" in r.json()["error"]["message"]
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1], "model": "gpt-4"}, timeout=10)
    assert r.status_code == 404


def test_queue_limit_gives_429(one_thread):
    sched, srv = _server(start=False, max_queue=2)
    try:
        results = []

        def post():
            results.append(httpx.post(f"{srv.url}/v1/completions", timeout=60,
                                      json={"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}))
        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        end = time.monotonic() + 20
        while sched.num_queued < 2 and time.monotonic() < end:
            time.sleep(0.02)
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=10)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        sched.start()
        for t in threads:
            t.join(30)
        assert [x.status_code for x in results] == [200, 200]
        _assert_no_leak(sched)
    finally:
        srv.stop()
        sched.stop()


def test_disconnected_clients_free_their_pages(server):
    sched, srv = server
    body = {"prompt": list(range(40)), "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data: ")) >= 2
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.5)
    _assert_no_leak(sched)
    assert sched.stats()["steps"] < 600      # both were stopped long before their 400 tokens


def test_load_loses_no_request(server, rng):
    sched, srv = server
    prompts = _prompts(rng, 300, shared=5)
    lengths = rng.integers(1, 5, len(prompts)).tolist()

    async def go():
        sem = asyncio.Semaphore(24)
        async with httpx.AsyncClient(base_url=srv.url, timeout=60,
                                     limits=httpx.Limits(max_connections=32)) as c:
            async def one(i):
                async with sem:
                    return await _complete(c, {"prompt": prompts[i], "max_tokens": lengths[i],
                                               "temperature": 0.7 if i % 3 else 0, "seed": i,
                                               "stream": i % 2 == 0})
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(prompts)))), 90)
    got = asyncio.run(go())
    assert [s for s, _, _ in got] == [200] * len(prompts)
    assert [len(ids[0]) for _, ids, _ in got] == lengths
    _assert_no_leak(sched)


def test_preemption_on_a_small_pool_keeps_greedy_outputs(offline, rng):
    sched, srv = _server(kv_tokens=448, start=False, max_batch=16)
    try:
        prompts = _prompts(rng, 10, shared=2)

        async def go():          # every request waits before the engine starts: the pool must overflow
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                tasks = [asyncio.create_task(_complete(c, {"prompt": p, "max_tokens": 24, "temperature": 0}))
                         for p in prompts]
                end = time.monotonic() + 20
                while sched.num_queued < len(prompts) and time.monotonic() < end:
                    await asyncio.sleep(0.02)
                sched.start()
                return await asyncio.gather(*tasks)
        got = asyncio.run(go())
        assert [s for s, _, _ in got] == [200] * len(prompts)
        for p, (_, ids, _) in zip(prompts, got):
            assert ids[0] == offline(p, 24)
        assert sched.stats()["preemptions"] > 0
        _assert_no_leak(sched)
    finally:
        srv.stop()
        sched.stop()


def test_prefix_cache_shares_pages_and_evicts_lru(one_thread):
    engine = TreeEngine(TreeModel.random("tiny"), kv_tokens=1024, page_size=16)
    cache = PrefixCache(engine, block_tokens=16)
    pool = engine.pool
    a = list(range(1, 50))
    node_a = cache.insert(a)
    used = pool.num_pages - pool.num_free_pages
    node_b = cache.insert(a[:48] + [7, 8])              # shares the first three blocks
    assert cache.hit_tokens == 48
    assert pool.num_pages - pool.num_free_pages == used + 1
    assert cache.match(a + [1])[1] == 49
    cache.release(node_a)
    cache.release(node_b)
    cache.match(a[:48] + [7, 8, 9])                      # b's blocks become most recent
    assert cache.evict(pool.num_free_pages + 1) == 1     # a's last block goes first
    assert node_a not in cache and node_b in cache
    assert cache.clear() == 4 and pool.num_free_pages == pool.num_pages
    pool.check()


def test_bench_replays_the_trace(server, tmp_path):
    from treeattn.bench.serve import bench_serve
    from treeattn.tree import find_shared

    _, srv = server
    try:
        trace = find_shared() / "workloads" / "pat" / "conversation_trace.jsonl"
    except FileNotFoundError:
        pytest.skip("shared workloads not found")
    out = bench_serve(trace, url=srv.url, rate=100.0, max_requests=40, block_tokens=8, max_input_len=64,
                      max_output_len=3, progress=False, timeout=60,
                      system_prompt={"levels": (5, 7, 9), "locations": 3, "languages": 2})
    assert out["requests"] == out["completed"] == 40 and out["failed"] == 0
    assert out["ttft"]["mean_ms"] > 0 and out["tpot"]["p99_ms"] is not None


def test_system_prompt_is_a_three_level_shared_prefix():
    import numpy as np

    from treeattn.bench.serve import build_requests

    trace = [{"input_length": 20, "output_length": 4, "hash_ids": [0, i]} for i in range(1, 61)]
    spec = {"levels": (4, 6, 8), "locations": 3, "languages": 2}
    reqs = build_requests(trace, vocab_size=1000, arrivals=np.zeros(60), block_tokens=8, seed=5,
                          max_model_len=40, system_prompt=spec)
    heads = [tuple(r.prompt[:18]) for r in reqs]
    assert all(len(r.prompt) == 18 + 18 and r.max_tokens == 4 for r in reqs)  # 40 - 4 - 18 trace tokens
    assert len({h[:4] for h in heads}) == 1                     # level 1: every request
    assert len({h[:10] for h in heads}) == 3                    # level 2: per location
    assert len({h for h in heads}) == 6                         # level 3: per (location, language)
    assert len({tuple(r.prompt[18:26]) for r in reqs}) == 1     # then the trace's shared block 0
    plain = build_requests(trace, vocab_size=1000, arrivals=np.zeros(60), block_tokens=8, seed=5)
    assert plain[0].prompt[:18] == reqs[0].prompt[18:]


def test_cli_parsers():
    import argparse

    from treeattn.cli.serve import add_bench_serve_parser, add_serve_parser

    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    add_serve_parser(sub)
    bench = sub.add_parser("bench").add_subparsers()
    add_bench_serve_parser(bench)
    a = p.parse_args(["serve", "--random-weights", "tiny", "--port", "8123", "--max-queue", "4"])
    assert (a.port, a.max_queue, a.host) == (8123, 4, "127.0.0.1")
    b = p.parse_args(["bench", "serve", "--rate", "2", "--duration", "30", "--url", "http://127.0.0.1:1"])
    assert (b.rate, b.duration, b.block_tokens) == (2.0, 30.0, 512)


def test_bench_deadline_cancels_and_frees(server):
    from treeattn.bench.serve import TraceRequest, replay, summarize

    sched, srv = server
    before = sched.stats()
    reqs = [TraceRequest([1, 2, 3, i], 3, 0.0) for i in range(3)] + \
        [TraceRequest([4, 5, i], 500, 0.0) for i in range(2)]
    # (the short ones take 0.05-0.13 s, the long ones 2-5 s, on an idle or a loaded 2-core machine)
    results, wall = asyncio.run(replay(srv.url, reqs, model="tiny", progress=False, deadline=1.0))
    assert [r["ok"] for r in results] == [True] * 3 + [False] * 2
    assert all(r["error"] == "cancelled at the deadline" for r in results[3:])
    assert summarize(results, wall)["failed"] == 2 and wall < 10
    after = _wait_idle(sched)                      # the cancelled streams were aborted
    assert after["steps"] < before["steps"] + 499     # aborted before their 500 tokens
    assert after["decoded_tokens"] > before["decoded_tokens"] and after["max_batch_seen"] >= 2
    assert sum(after["strategies"].values()) > sum(before["strategies"].values())
    assert sched.engine.stats == []                # folded into the counters every step
    _assert_no_leak(sched)


def _decode_stats(prompts, max_tokens):
    """Counters of a fresh scheduler that decodes ``prompts`` greedily, all admitted together."""
    from treeattn.serve import SamplingParams

    engine = TreeEngine(TreeModel.random("tiny"), kv_tokens=4096, page_size=16, keep_reserved=True)
    sched = Scheduler(engine, block_tokens=16)
    for p in prompts:       # queued before the engine thread starts: one admission for all
        sched.submit(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), lambda ev: None)
    sched.start()
    try:
        return _wait_idle(sched)
    finally:
        sched.stop()


def test_stats_count_visible_and_unique_kv(one_thread, rng):
    """One request sees its prompt and its outputs so far at every decode step (steps 1..T-1);
    two requests with a common 32-token prefix read it once per step when shared."""
    p, t = 40, 6
    alone = _decode_stats([rng.integers(0, VOCAB, p).tolist()], t)
    assert alone["kv_visible_tokens"] == alone["kv_unique_tokens"] == sum(p + k for k in range(1, t))
    assert alone["prefill_steps"] == 1 and alone["prefill_ms"] > 0 and alone["decode_ms"] > 0
    assert alone["steps"] == t

    head = rng.integers(0, VOCAB, 32).tolist()
    tails = [rng.integers(0, VOCAB, n).tolist() for n in (8, 12)]
    apart = _decode_stats([rng.integers(0, VOCAB, 40).tolist(), rng.integers(0, VOCAB, 44).tolist()], t)
    shared = _decode_stats([head + tails[0], head + tails[1]], t)
    assert apart["kv_visible_tokens"] == apart["kv_unique_tokens"] == shared["kv_visible_tokens"]
    assert shared["kv_visible_tokens"] - shared["kv_unique_tokens"] == 32 * (t - 1)
    assert shared["prefill_steps"] == 1 and shared["steps"] == t


class _HostEvent:
    """``torch.cuda.Event``'s timing calls on the host clock; waiting for one is an error."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def query(self):
        return self.t is not None

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3

    def synchronize(self):
        raise AssertionError("the scheduler waited for an event")


@pytest.mark.parametrize("timed", [False, True], ids=["cpu", "events"])
def test_step_times(one_thread, rng, monkeypatch, timed):
    """Every decode step's wall time; its GPU time only with CUDA events (none on a CPU), read
    without waiting: ``events`` runs the CUDA path with host-clock events that raise if waited for."""
    from treeattn.serve import SamplingParams

    engine = TreeEngine(TreeModel.random("tiny"), kv_tokens=4096, page_size=16, keep_reserved=True)
    sched = Scheduler(engine, block_tokens=16)
    seen = []
    sched.step_listeners.append(lambda *a: seen.append(a))
    if timed:
        def no_sync(*a, **k):
            raise AssertionError("the scheduler synchronised the device")
        monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
        monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
        sched._timed = True
    t = 6
    for n in (40, 24):          # queued before the engine thread starts: one admission for both
        sched.submit(rng.integers(0, VOCAB, n).tolist(), SamplingParams(max_tokens=t, temperature=0, ignore_eos=True),
                     lambda ev: None)
    sched.start()
    try:
        s = _wait_idle(sched)
        times, tail = sched.decode_times(), sched.decode_times(t - 3)
    finally:
        sched.stop()
    assert s["steps"] == t and s["prefill_steps"] == 1 and s["decode_steps"] == t - 1
    assert times["first"] == 0 and len(times["wall_ms"]) == len(times["gpu_ms"]) == t - 1
    assert all(w >= 0 for w in times["wall_ms"]) and sum(times["wall_ms"]) == pytest.approx(s["decode_ms"])
    assert [k for k, _, _ in seen] == ["prefill"] + ["decode"] * (t - 1)
    assert [w * 1e3 for k, w, _ in seen if k == "decode"] == pytest.approx(times["wall_ms"])
    if timed:       # each decode step: its forward pass (the step before) and its sampling
        assert s["decode_gpu_steps"] == t - 1 and all(g > 0 for g in times["gpu_ms"])
        assert sum(times["gpu_ms"]) == pytest.approx(s["decode_gpu_ms"])
    else:
        assert s["decode_gpu_steps"] == 0 and s["decode_gpu_ms"] == 0 and times["gpu_ms"] == [None] * (t - 1)
    assert [g for k, _, g in seen] == [None] + [None if g is None else g / 1e3 for g in times["gpu_ms"]]
    assert tail["first"] == t - 3 and tail["wall_ms"] == times["wall_ms"][t - 3:]
