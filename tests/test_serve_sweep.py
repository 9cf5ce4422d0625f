"""benchmarks/bench_serve_sweep.py: the sustained-rate rule, the target, the plot, the rates per
traffic, the warm-up, the server process handling and one end-to-end sweep with the tiny model on
the CPU."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("bench_serve_sweep", ROOT / "benchmarks" / "bench_serve_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stats(mean):
    return {"mean_ms": mean, "p50_ms": mean, "p99_ms": None if mean is None else 2 * mean}


def _summary(*, requests=30, completed=30, wall=32.0, ttft=500.0, tpot=20.0, latency=4000.0):
    return {"requests": requests, "completed": completed, "failed": requests - completed, "rejected_429": 0,
            "duration_s": wall, "request_throughput": completed / wall, "output_throughput": 0.0,
            "prompt_tokens": 0, "ttft": _stats(ttft), "tpot": _stats(tpot), "latency": _stats(latency),
            "errors": [], "cancelled": 0}


def test_judge(sweep):
    ok = sweep.judge(_summary(), 30.0, 10.0, 0.9)
    assert ok["sustained"] and not ok["reasons"] and ok["offered_rps"] == 1.0
    assert ok["served_rps"] == pytest.approx(30 / 28)
    assert not sweep.judge(_summary(completed=29), 30.0, 10.0, 0.9)["sustained"]         # a failure
    assert not sweep.judge(_summary(ttft=11_000.0), 30.0, 10.0, 0.9)["sustained"]        # slow TTFT
    slow = sweep.judge(_summary(wall=60.0, latency=10_000.0), 30.0, 30.0, 0.9)           # backlog
    assert not slow["sustained"] and "served" in slow["reasons"][0]
    assert not sweep.judge(_summary(requests=0, completed=0), 30.0, 10.0, 0.9)["sustained"]


def _run(strategy, rate, tpot, sustained=True, traffic="pat-trace"):
    return {"strategy": strategy, "traffic": traffic, "rate": rate, "summary": _summary(tpot=tpot),
            "sustained": sustained}


def test_evaluate_target(sweep):
    runs = [_run("sequence", 1.0, 20.0), _run("sequence", 2.0, 30.0), _run("sequence", 4.0, 90.0, False),
            _run("auto", 1.0, 16.0), _run("auto", 2.0, 18.0), _run("auto", 4.0, 40.0)]
    t = sweep.evaluate_target(runs)
    assert t["sequence_max_sustained_rate"] == 2.0 and t["pass"]
    assert t["tpot_reduction_at_that_rate"] == pytest.approx(0.4)
    assert t["tpot_reduction_by_rate"]["1.0"] == pytest.approx(0.2)
    t = sweep.evaluate_target(runs, min_reduction=0.5)
    assert not t["pass"] and t["tpot_reduction_at_that_rate"] == pytest.approx(0.4)
    t = sweep.evaluate_target(runs[:3] + [_run("auto", 1.0, 16.0)])          # auto missing at rate 2
    assert t["sequence_max_sustained_rate"] == 2.0 and t["tpot_reduction_at_that_rate"] is None
    assert not t["pass"] and "note" in t
    t = sweep.evaluate_target([_run("sequence", 1.0, 20.0, False), _run("auto", 1.0, 10.0)])
    assert t["sequence_max_sustained_rate"] is None and not t["pass"]


def test_evaluate_target_averages_repeated_strategies(sweep):
    """An A,B,B,A sweep: each strategy counts with the mean of its runs, and sustains a rate only
    if every run did."""
    runs = [_run("sequence", 2.0, 30.0), _run("auto", 2.0, 20.0), _run("auto", 2.0, 16.0),
            _run("sequence", 2.0, 20.0)]
    t = sweep.evaluate_target(runs)
    assert t["tpot_reduction_at_that_rate"] == pytest.approx(1 - 18.0 / 25.0)
    assert t["runs_per_strategy_and_rate"] == {"sequence@2.0": 2, "auto@2.0": 2}
    t = sweep.evaluate_target(runs[:3] + [_run("sequence", 2.0, 20.0, False)])
    assert t["sequence_max_sustained_rate"] is None and not t["pass"]


def test_plot_and_json(sweep, tmp_path):
    runs = [_run("sequence", 1.0, 20.0), _run("sequence", 2.0, 30.0, False), _run("auto", 1.0, 16.0),
            _run("auto", 2.0, 18.0), {"strategy": "auto", "traffic": "pat-trace", "rate": 4.0, "error": "boom"},
            _run("sequence", 0.5, 40.0, traffic="sampling"), _run("auto", 0.5, 25.0, traffic="sampling")]
    result = {"device": "cpu", "model": "random:tiny", "runs": runs, "skipped": [],
              "target": {t: sweep.evaluate_target([r for r in runs if r["traffic"] == t])
                         for t in ("pat-trace", "sampling")}}
    sweep.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
    sweep.write_json(result, tmp_path / "r.json")
    target = json.loads((tmp_path / "r.json").read_text())["target"]
    assert target["pat-trace"]["sequence_max_sustained_rate"] == 1.0
    assert target["sampling"]["tpot_reduction_at_that_rate"] == pytest.approx(0.375)


def test_server_delta_derives_sharing_and_prefill_share(sweep):
    before = {"steps": 10, "decoded_tokens": 20, "kv_visible_tokens": 100, "kv_unique_tokens": 100,
              "prefill_ms": 50.0, "prefill_steps": 2, "decode_ms": 80.0, "strategies": {"auto": 8}}
    after = {"steps": 30, "decoded_tokens": 100, "kv_visible_tokens": 1100, "kv_unique_tokens": 400,
             "prefill_ms": 250.0, "prefill_steps": 7, "decode_ms": 230.0, "strategies": {"auto": 25}}
    d = sweep.server_delta(before, after)      # (treeattn.bench.serve's)
    assert d["mean_batch"] == 4.0 and d["kv_io_saving"] == pytest.approx(0.7)
    assert d["decode_step_ms"] == pytest.approx(150.0 / 15)           # 20 steps, 5 with a prefill
    assert d["prefill_share"] == pytest.approx((200.0 - 5 * 10.0) / 350.0)
    assert d["strategies"] == {"auto": 17}
    assert "decode_step_wall" not in d and sweep._fmt_steps(d) == ""


def test_server_delta_step_times(sweep):
    """Mean / p50 / p99 of the run's decode steps; wall over GPU over the steps with a GPU time."""
    before = {"steps": 10, "decode_steps": 8}
    after = {"steps": 14, "decode_steps": 12,
             "decode_times": {"first": 8, "wall_ms": [2.0, 4.0, 6.0, 8.0], "gpu_ms": [1.0, None, 3.0, 4.0]}}
    d = sweep.server_delta(before, after)
    assert d["decode_steps"] == 4
    assert d["decode_step_wall"]["mean_ms"] == 5.0 and d["decode_step_wall"]["p50_ms"] == 5.0
    assert d["decode_step_gpu"]["mean_ms"] == pytest.approx(8 / 3) and d["decode_step_gpu"]["p50_ms"] == 3.0
    assert d["decode_step_gpu"]["p99_ms"] == pytest.approx(3.98)
    assert d["decode_wall_over_gpu"] == 2.0                # (2 + 6 + 8) / (1 + 3 + 4)
    assert "wall 5.00/5.00/7.94 GPU 2.67/3.00/3.98 ms, wall/GPU 2.00" in sweep._fmt_steps(d)
    cpu = sweep.server_delta(before, {**after, "decode_times": {"first": 8, "wall_ms": [2.0], "gpu_ms": [None]}})
    assert cpu["decode_step_gpu"]["mean_ms"] is None and "decode_wall_over_gpu" not in cpu
    assert sweep._fmt_steps(cpu).endswith("GPU - ms")


def test_server_command_passes_model_args(sweep):
    args = sweep.parse_args(["--random-weights", "llama3-8b", "--device", "cpu", "--dtype", "bfloat16",
                             "--kv-tokens", "1000", "--page-size", "32", "--rates", "2,0.5", "--out", "x.json"])
    assert args.rates_by_traffic == {t: [0.5, 2.0] for t in ("sampling", "agents", "pat-trace")}
    assert args.strategy_list == ["auto", "sequence"] and args.traffic_list == ["sampling", "agents", "pat-trace"]
    cmd = sweep.server_command(args, "sequence", 8123)
    assert cmd[1:4] == ["-m", "treeattn.cli", "serve"]
    line = " ".join(cmd)
    for part in ("--random-weights llama3-8b", "--device cpu", "--dtype bfloat16", "--kv-tokens 1000",
                 "--page-size 32", "--strategy sequence", "--port 8123", "--prefix-block 64",
                 "--max-model-len 8192"):
        assert part in line
    for bad in (["--strategies", "nope"], ["--traffics", "sampling,nope"], ["--rates", "nope:1"],
                ["--rates", "sampling:0,1"], ["--n", "4-2"]):
        with pytest.raises(SystemExit):
            sweep.parse_args(["--random-weights", "tiny", "--out", "x.json", *bad])


def test_rates_per_traffic(sweep):
    r = sweep.rates_arg(None, ["sampling", "pat-trace"])
    assert r == {"sampling": [0.5, 1.0, 2.0], "pat-trace": [1.0, 2.0, 3.0]}
    r = sweep.rates_arg(["agents:8,4", "1", "sampling:3"], ["sampling", "agents", "pat-trace"])
    assert r == {"sampling": [3.0], "agents": [4.0, 8.0], "pat-trace": [1.0]}      # named lists win
    with pytest.raises(ValueError, match="positive"):
        sweep.rates_arg(["agents:"], ["agents"])


def test_warmup_requests_step_the_batch_down(sweep):
    from treeattn.bench.serve import TraceRequest

    reqs = [TraceRequest(list(range(50)), 100, 3.0 + i, n=n) for i, n in enumerate((3, 3, 4, 2, 5, 6))]
    w = sweep.warmup_requests(reqs, 8, long=2, input_len=10)
    assert [r.n for r in w] == [3, 3, 4, 2, 5] and all(r.arrival == 0.0 for r in w)
    assert [r.max_tokens for r in w] == [10, 9, 8, 16, 16]     # 3 requests hold 8 choices: 3 + 7 - j
    assert [len(r.prompt) for r in w] == [10, 10, 10, 50, 50]


def test_server_that_dies_reports_its_log(sweep, tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('model load failed: boom'); sys.exit(3)"]
    server = sweep.Server(cmd, f"http://127.0.0.1:{sweep.free_port('127.0.0.1')}", tmp_path / "s.log")
    with pytest.raises(sweep.ServerError, match="boom"):
        server.start(timeout=30)
    assert server.stop() == 3


def test_time_budget_skips_everything(sweep, tmp_path):
    out = tmp_path / "r.json"
    code = sweep.main(["--random-weights", "tiny", "--device", "cpu", "--traffics", "sampling,agents",
                       "--rates", "1,2", "--duration", "5", "--time-budget", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    assert code == 1 and res["runs"] == [] and res["status"] == "complete" and res["trace"] is None
    assert sorted((s["strategy"], s["traffic"], s["rate"]) for s in res["skipped"]) == sorted(
        (s, t, r) for s in ("auto", "sequence") for t in ("sampling", "agents") for r in (1.0, 2.0))


@pytest.mark.slow
def test_sweep_end_to_end_tiny(sweep, tmp_path):
    """Both servers up together, the sampling traffic at one rate on each, then both stopped."""
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    code = sweep.main(["--random-weights", "tiny", "--device", "cpu", "--traffics", "sampling", "--rates", "4",
                       "--duration", "2", "--n", "2-3", "--prompt-len", "40-80", "--sampling-output-len", "4",
                       "--warmup-requests", "4", "--warmup-long", "1", "--out", str(out), "--plot", str(png)])
    assert code == 0
    res = json.loads(out.read_text())
    for key in ("device", "torch", "triton", "commit", "model", "args", "runs", "skipped", "target",
                "sustained_rule"):
        assert key in res
    assert res["status"] == "complete" and res["skipped"] == []
    assert [(r["strategy"], r["traffic"], r["rate"]) for r in res["runs"]] == [
        ("auto", "sampling", 4.0), ("sequence", "sampling", 4.0)]
    a, b = (r["summary"] for r in res["runs"])
    assert (a["requests"], a["choices"], a["output_tokens"]) == (b["requests"], b["choices"], b["output_tokens"])
    for r in res["runs"]:
        s = r["summary"]
        assert s["requests"] == s["completed"] > 0 and s["failed"] == 0, s
        assert s["requests"] * 2 <= s["choices"] <= s["requests"] * 3 and s["output_tokens"] == 4 * s["choices"]
        assert s["tpot"]["mean_ms"] > 0 and r["server"]["steps"] > 0 and r["server"]["mean_batch"] >= 1
        assert r["server"]["plan_ms"] > 0 and sum(r["server"]["strategies"].values()) > 0
        srv = r["server"]
        assert 0 < srv["kv_unique_tokens"] < srv["kv_visible_tokens"] and 0 < srv["kv_io_saving"] < 1
        assert srv["kv_read_saved_bytes"] > 0 and srv["prefill_ms"] > 0
        assert isinstance(r["sustained"], bool)
    for strategy, info in res["servers"].items():
        assert info["exit_code"] == 0 and info["startup_s"] > 0, (strategy, info)
        assert res["warmup"][strategy]["sampling"]["completed"] >= 2
    t = res["target"]["sampling"]
    assert set(t) >= {"sequence_max_sustained_rate", "tpot_reduction_at_that_rate", "pass"}
    assert "4.0" in t["tpot_reduction_by_rate"]
    assert png.stat().st_size > 10_000
