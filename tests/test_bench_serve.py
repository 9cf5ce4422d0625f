"""treeattn.bench.serve: the sampling and agents traffics (deterministic, their sharing structure),
arrivals, the per-choice client measurements, summarize(), the CLI's checks, and one small run of
each new traffic against a tiny in-process server."""
import asyncio
import json

import numpy as np
import pytest

from treeattn.bench import serve as sb

SPEC = {"levels": (4, 6, 8), "locations": 3, "languages": 2}


def test_poisson_arrivals_are_seeded_and_cut_by_duration():
    a = sb.poisson_arrivals(2.0, seed=3, duration=50.0)
    assert a[0] == 0.0 and np.all(np.diff(a) > 0) and a[-1] < 50.0
    assert 60 < a.size < 140                                          # ~100 expected
    np.testing.assert_array_equal(a, sb.poisson_arrivals(2.0, seed=3, duration=50.0))
    np.testing.assert_array_equal(sb.poisson_arrivals(2.0, seed=3, duration=20.0), a[a < 20.0])
    assert not np.array_equal(sb.poisson_arrivals(2.0, seed=4, duration=50.0)[:5], a[:5])
    np.testing.assert_array_equal(sb.poisson_arrivals(2.0, seed=3, count=10), a[:10])
    trace = [{"input_length": 1, "output_length": 1, "hash_ids": []}] * 10
    np.testing.assert_array_equal(sb.arrival_times(trace, 2.0, seed=3), a[:10])    # the trace's arrivals
    with pytest.raises(ValueError, match="rate must be > 0"):
        sb.poisson_arrivals(0.0, seed=0, duration=1.0)


def test_sampling_requests_are_deterministic_own_prompts_within_ranges():
    t = np.arange(40) * 0.1
    reqs = sb.sampling_requests(t, vocab_size=1000, seed=7, n=(8, 16), prompt_len=(20, 40), output_len=(5, 9))
    assert reqs == sb.sampling_requests(t, vocab_size=1000, seed=7, n=(8, 16), prompt_len=(20, 40),
                                        output_len=(5, 9))
    assert reqs != sb.sampling_requests(t, vocab_size=1000, seed=8, n=(8, 16), prompt_len=(20, 40),
                                        output_len=(5, 9))
    assert [r.arrival for r in reqs] == pytest.approx(t)
    assert all(8 <= r.n <= 16 and 20 <= len(r.prompt) <= 40 and 5 <= r.max_tokens <= 9 for r in reqs)
    assert len({r.n for r in reqs}) > 4 and len({len(r.prompt) for r in reqs}) > 4     # drawn, not fixed
    assert all(r.temperature == 1.0 and r.seed is not None for r in reqs)
    assert len({tuple(r.prompt[:8]) for r in reqs}) == 40                  # every request its own prompt
    assert all(0 <= x < 1000 for r in reqs for x in r.prompt)
    cut = sb.sampling_requests(t[:5], vocab_size=1000, seed=7, prompt_len=(2048, 4096), output_len=(128, 512),
                               max_model_len=300)
    assert all(len(r.prompt) + r.max_tokens <= 300 and len(r.prompt) >= 1 for r in cut)
    with pytest.raises(ValueError, match="n must be"):
        sb.sampling_requests(t, vocab_size=1000, n=(8, 65))
    with pytest.raises(ValueError, match="prompt_len must be"):
        sb.sampling_requests(t, vocab_size=1000, prompt_len=(40, 20))
    with pytest.raises(ValueError, match="temperature > 0"):
        sb.sampling_requests(t, vocab_size=1000, temperature=0.0)


def test_agent_requests_share_the_system_prompt_levels():
    t = np.zeros(60)
    reqs = sb.agent_requests(t, vocab_size=1000, seed=5, system_prompt=SPEC, user_len=(3, 7), output_len=(2, 4))
    assert reqs == sb.agent_requests(t, vocab_size=1000, seed=5, system_prompt=SPEC, user_len=(3, 7),
                                     output_len=(2, 4))
    heads = [tuple(r.prompt[:18]) for r in reqs]
    assert len({h[:4] for h in heads}) == 1                     # level 1: every request
    assert len({h[:10] for h in heads}) == 3                    # level 2: per location
    assert len(set(heads)) == 6                                 # level 3: per (location, language)
    assert all(21 <= len(r.prompt) <= 25 and 2 <= r.max_tokens <= 4 and r.n == 1 for r in reqs)
    assert len({tuple(r.prompt[18:]) for r in reqs}) == 60      # then each user's own message
    # the deployment's system prompt does not change with the run's seed; the users do
    other = sb.agent_requests(t, vocab_size=1000, seed=6, system_prompt=SPEC, user_len=(3, 7), output_len=(2, 4))
    assert {tuple(r.prompt[:18]) for r in other} == set(heads)
    assert not {tuple(r.prompt[18:]) for r in other} & {tuple(r.prompt[18:]) for r in reqs}
    # ... and is not pat-trace's of the same seed, which would be found in the cache across traffics
    trace = [{"input_length": 2, "output_length": 2, "hash_ids": []}] * 20
    pat = sb.build_requests(trace, vocab_size=1000, arrivals=np.zeros(20), seed=0, system_prompt=SPEC)
    assert pat[0].prompt[:4] != reqs[0].prompt[:4]
    full = sb.agent_requests(t[:3], vocab_size=128256, seed=0)             # PAT's 46 + 348 + 2123 tokens
    assert all(2517 + 50 <= len(r.prompt) <= 2517 + 300 and 100 <= r.max_tokens <= 400 for r in full)


def test_make_requests_checks_the_traffic_before_building():
    reqs = sb.make_requests("sampling", vocab_size=100, rate=4.0, seed=1, duration=5.0,
                            options={"n": (2, 3), "prompt_len": (4, 6), "output_len": (2, 2)})
    assert 8 < len(reqs) < 40 and all(r.arrival < 5.0 and 2 <= r.n <= 3 for r in reqs)
    assert len(sb.make_requests("agents", vocab_size=100, rate=4.0, max_requests=7, system_prompt=SPEC)) == 7
    bad = [
        (dict(traffic="nope"), "unknown traffic"),
        (dict(traffic="pat-trace", options={"n": (1, 2)}), "takes no options"),
        (dict(traffic="pat-trace"), "needs a trace file"),
        (dict(traffic="sampling", trace_path="x.jsonl"), "belong to pat-trace"),
        (dict(traffic="sampling", max_output_len=5), "belong to pat-trace"),
        (dict(traffic="sampling", rate=0.0), "rate > 0"),
        (dict(traffic="sampling", duration=None), "needs a duration"),
        (dict(traffic="sampling", options={"user_len": (1, 2)}), "unknown sampling options"),
        (dict(traffic="sampling", options={"n": (4, 100)}), "n must be"),
        (dict(traffic="sampling", options={"temperature": 0.0}), "temperature > 0"),
        (dict(traffic="agents", system_prompt=None), "needs a system prompt"),
        (dict(traffic="agents", options={"output_len": (0, 3)}), "output_len must be"),
    ]
    for kw, message in bad:
        kw = {"rate": 1.0, "duration": 2.0, **kw}
        with pytest.raises(ValueError, match=message):
            sb.check_traffic(kw.pop("traffic"), **kw)


def test_send_counts_tokens_and_tpot_per_choice_stream(monkeypatch):
    """Two choices streamed in shared chunks; the second's last token comes later: each choice
    stream gets its own TPOT, TTFT is the request's first token, ok needs every choice complete."""
    clock = {"t": 0.0}
    monkeypatch.setattr(sb.time, "perf_counter", lambda: clock["t"])

    def chunk(*choices):
        return "data: " + json.dumps({"choices": [{"index": i, "text": "", "token_ids": ids} for i, ids in choices]})
    lines = [(1.0, chunk((0, [5]), (1, [6]))), (1.5, chunk((0, [7]), (1, [8]))), (2.5, chunk((0, [9]))),
             (3.5, chunk((1, [10], ))), (3.6, "data: [DONE]")]

    class Stream:
        status_code = 200

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def aiter_lines(self):
            for t, line in lines:
                clock["t"] = t
                yield line

    class Client:
        def stream(self, method, path, json):
            self.body = json
            return Stream()

    client = Client()
    req = sb.TraceRequest([1, 2, 3], 3, 0.0, n=2, temperature=1.0, seed=9)
    res = asyncio.run(sb._send(client, "m", req, 0.0))
    assert client.body["n"] == 2 and client.body["seed"] == 9 and client.body["ignore_eos"]
    assert res["ok"] and res["tokens"] == 6 and res["choices"] == 2
    assert res["ttft"] == 1.0 and res["latency"] == 3.6
    assert res["tpot"] == [pytest.approx(0.75), pytest.approx(1.25)]    # (2.5 - 1) / 2, (3.5 - 1) / 2
    res = asyncio.run(sb._send(client, "m", sb.TraceRequest([1], 4, 0.0, n=2), 0.0))
    assert not res["ok"] and "got [3] of 4 tokens per choice" in res["error"]


def test_summarize():
    def ok(ttft, latency, tpot, tokens, choices=1):
        return {"ok": True, "ttft": ttft, "latency": latency, "tpot": tpot, "tokens": tokens, "status": 200,
                "error": None, "prompt_tokens": 10, "choices": choices}
    results = [ok(0.1, 1.0, [0.01, 0.03], 20, 2), ok(0.3, 2.0, [0.02], 10), ok(0.2, 1.5, [], 1),
               {"ok": False, "ttft": None, "latency": None, "tpot": [], "tokens": 0, "status": 429,
                "error": "queue full", "prompt_tokens": 10, "choices": 4}]
    s = sb.summarize(results, 4.0)
    assert (s["requests"], s["completed"], s["failed"], s["rejected_429"]) == (4, 3, 1, 1)
    assert (s["choices"], s["output_tokens"], s["prompt_tokens"]) == (4, 31, 30)
    assert s["request_throughput"] == 0.75 and s["output_throughput"] == 31 / 4.0
    assert s["ttft"] == pytest.approx({"mean_ms": 200.0, "p50_ms": 200.0, "p99_ms": 298.0})
    assert s["tpot"]["mean_ms"] == pytest.approx(20.0) and s["tpot"]["p50_ms"] == pytest.approx(20.0)
    assert s["tpot"]["p99_ms"] == pytest.approx(29.8)                  # numpy's linear interpolation
    assert s["latency"]["mean_ms"] == pytest.approx(1500.0) and s["errors"] == ["queue full"]
    assert sb.summarize([], 0.0)["tpot"] == {"mean_ms": None, "p50_ms": None, "p99_ms": None}


def test_server_delta_derives_hit_rate_and_saved_bytes():
    before = {"steps": 10, "decoded_tokens": 20, "prefix_hit_tokens": 100, "prefill_tokens": 300,
              "kv_visible_tokens": 100, "kv_unique_tokens": 100, "kv_read_saved_bytes": 1e6}
    after = {"steps": 20, "decoded_tokens": 60, "prefix_hit_tokens": 400, "prefill_tokens": 400,
             "kv_visible_tokens": 500, "kv_unique_tokens": 200, "kv_read_saved_bytes": 4e6}
    d = sb.server_delta(before, after)
    assert d["prefix_hit_rate"] == pytest.approx(300 / 400) and d["kv_read_saved_bytes"] == 3e6
    assert d["kv_io_saving"] == pytest.approx(0.75) and d["mean_batch"] == 4.0
    assert sb.server_delta(None, after) == {}


@pytest.mark.parametrize("argv,message", [
    ("--traffic sampling --rate 1 --duration 2 --max-output-len 5", "belong to pat-trace"),
    ("--traffic sampling --rate 1", "needs a duration"),
    ("--traffic agents --rate 1 --duration 2 --n 2-3", "unknown agents options ['n']"),
    ("--traffic agents --rate 1 --duration 2 --system-prompt none", "needs a system prompt"),
    ("--traffic pat-trace --rate 1 --temperature 0.5", "takes no options"),
    ("--traffic sampling --rate 1 --duration 2 --n 3-2", "MIN <= MAX"),
    ("--traffic sampling --rate 1 --duration 2 --n 0-2", "MIN <= MAX"),
])
def test_cli_rejects_bad_traffic_options_before_asking_the_server(argv, message, capsys):
    from treeattn.cli.main import main

    try:    # the server URL is never asked (nothing listens on port 9)
        code = main(["bench", "serve", "--url", "http://127.0.0.1:9", *argv.split()])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("treeattn bench serve: error: ") and message in err, err


def test_cli_parses_traffic_options():
    from treeattn.cli.main import build_parser
    from treeattn.cli.serve import traffic_options

    a = build_parser().parse_args(["bench", "serve", "--traffic", "sampling", "--rate", "2", "--duration", "5",
                                   "--n", "4-8", "--prompt-len", "100", "--output-len", "16-32"])
    assert a.traffic == "sampling"
    assert traffic_options(a) == {"n": (4, 8), "prompt_len": (100, 100), "output_len": (16, 32)}


@pytest.fixture(scope="module")
def server(one_thread):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from treeattn.engine import TreeEngine, TreeModel
    from treeattn.serve import Scheduler
    from treeattn.serve.server import ServerThread, create_app

    engine = TreeEngine(TreeModel.random("tiny"), kv_tokens=4096, page_size=16, keep_reserved=True)
    sched = Scheduler(engine, block_tokens=16, max_batch=32).start()
    srv = ServerThread(create_app(sched, model_name="tiny", max_model_len=512)).start()
    yield srv
    srv.stop()
    sched.stop()


def test_small_sampling_run(server):
    """The n choices of a prompt share its KV on the server."""
    s = sb.bench_serve(url=server.url, rate=50.0, traffic="sampling", max_requests=3, seed=2, progress=False,
                       timeout=60, options={"n": (2, 4), "prompt_len": (24, 40), "output_len": (3, 3)})
    assert s["requests"] == s["completed"] == 3 and s["failed"] == 0
    assert 6 <= s["choices"] <= 12 and s["output_tokens"] == 3 * s["choices"]
    assert s["tpot"]["mean_ms"] > 0 and s["traffic"] == "sampling" and s["options"]["n"] == (2, 4)
    assert s["server"]["decoded_tokens"] >= s["output_tokens"] - s["choices"]
    assert s["server"]["kv_io_saving"] > 0.3 and s["server"]["kv_read_saved_bytes"] > 0


def test_small_agents_run(server):
    """The agents' system prompt is found in the prefix cache."""
    a = sb.bench_serve(url=server.url, rate=50.0, traffic="agents", max_requests=6, seed=2, progress=False,
                       timeout=60, system_prompt={"levels": (16, 16, 16), "locations": 2, "languages": 1},
                       options={"user_len": (4, 8), "output_len": (2, 3)})
    assert a["completed"] == a["choices"] == 6 and a["server"]["prefix_hit_rate"] > 0.3
