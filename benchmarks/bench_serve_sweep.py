"""Online serving sweep (PAT Fig. 11 style): request traffics sent to ``treeattn serve`` at
several Poisson request rates, one server per attention strategy.

Traffics (``--traffics``, :mod:`treeattn.bench.serve`): ``sampling`` (n = 8-16 sampled choices of
a 2-4K-token prompt of its own: best-of-N and RL rollouts through the API), ``agents`` (users
behind PAT's three-level system prompt with short messages) and ``pat-trace`` (PAT's conversation
trace, whose decode batches share ~17% of their KV). Every request streams with ``ignore_eos``.

The script starts ``python -m treeattn.cli serve --strategy S ...`` for every strategy as a
subprocess (its log goes next to ``--out``), one after the other (the first compiles the kernels,
the next find them in Triton's disk cache), waits for ``GET /health`` and warms each up. All
servers then stay up together (``--kv-tokens`` is per server: they share the GPU) and serve the
runs in turn: for every traffic and rate, each strategy's server gets the same requests, the
strategy order alternating from one rate to the next, so that no strategy always runs first or
in the same minutes of the machine (the first server started on a fresh machine has measured
1.3-1.8x slower whichever strategy it ran, docs/performance.md). An idle server only holds its
memory. ``--one-at-a-time`` runs each strategy's server alone instead (all its runs, then the
next), for strategies whose pools do not fit the GPU together. Before the next run the script
waits until the server is idle and records its own counters over the run (:func:`server_delta`:
KV bytes that prefix-aware attention did not read, the prefix-cache hit rate, the mean batch, and
the decode steps' wall and GPU times, mean / p50 / p99, with their ratio ``decode_wall_over_gpu``).

Run ``i`` of a traffic uses request seed ``--request-seed + i`` for every strategy, so each
strategy sees the same requests at a rate while no rate hits the prompts cached by the previous
one; the agents' system prompt is the deployment's (``--system-seed``), cached by the warm-up as
in steady serving. The JSON (``--out``) is rewritten after every run, so a killed sweep keeps its
finished runs; ``--plot`` draws, per traffic, mean TTFT, TPOT (mean and P99) and output
throughput against the rate, one line per strategy (hollow markers: not sustained).

A run is *sustained* (the rule is also written to the JSON) when every request completed (none
failed, rejected or cancelled at the drain deadline), the mean TTFT is at most ``--max-ttft`` s,
and the served throughput, ``completed / (wall - mean latency)``, is at least
``--min-throughput-ratio`` of the offered one, ``requests / duration`` (the wall time runs from the
first arrival to the last completion; subtracting the mean latency removes the drain of the last
requests, which a stable server also needs). The target, per traffic, compares ``--candidate``
(auto) with ``--baseline`` (sequence): mean TPOT at the highest rate the baseline sustains must be
at least ``--target-reduction`` (30%) lower. TPOT counts each choice stream of an ``n``-choice
request as one sample (:func:`treeattn.bench.serve.summarize`).

Time: ``--time-budget`` bounds the whole sweep (with ``--one-at-a-time``, each server gets an
equal share of what is left when it starts). A run starts only when the time left still holds
``--duration`` plus ``--drain-timeout`` for it and for the other strategies' runs of the same rate
(they run all or none); requests still unfinished ``--drain-timeout`` s after the arrival window are
cancelled, and the runs that do not fit are recorded under ``skipped``. Traffics run in the order
given, so the last traffic's highest rates are the first to go.

H200 run (Llama-3.1-8B shape, random bf16 weights), one device call of under 9 minutes; every
option but the model, device, budget and outputs is the default::

    python benchmarks/bench_serve_sweep.py --random-weights llama3-8b --device cuda --dtype bfloat16 \\
        --strategies auto,sequence --traffics sampling,agents,pat-trace \\
        --rates sampling:0.5,1,2 agents:5,10,20 pat-trace:1,2,3 --duration 10 --drain-timeout 8 \\
        --kv-tokens 262144 --time-budget 480 \\
        --out benchmarks/results/serve_traffic_h200.json --plot benchmarks/results/serve_traffic_h200.png

Why these numbers. Time: the first server starts in ~60-100 s (random 8B weights, the attention
kernels compiled by 16 workers with a cold Triton cache, decode graphs of batch 1-64 captured), the
second in ~10-20 s; each warm-up takes ~5-15 s; a run is 10 s of arrivals plus its drain (the last
requests' latency, at most 8 s): 18 runs of ~15-18 s. Memory: two servers of 15 GiB of weights and
``--kv-tokens 262144`` (32 GiB of bf16 KV for Llama-3-8B: ~30 requests of 8K tokens, more than a
64-sequence batch of the two new traffics holds) fit the H200's 139 GiB together. Load, at ~10 ms
(auto) to ~15 ms (sequence) a 64-sequence decode step: a sampling request is ~12 choices x ~320
tokens (3.8K output tokens, 128-512 each) after a ~3K-token prefill, and a batch of 64 sequences
holds ~5 of them, whose prompts ``sequence`` reads once per choice (26 GB a step at 3.1K tokens)
and ``auto`` once per request: ~1.1 req/s saturate ``sequence``, ~1.8 ``auto``; an agents request
is ~250 tokens after a 2.5K-token system prompt (cached) and a 50-300-token message, 64 of them
share the system prompt's 46 + 8 x 348 + 32 x 2123 tokens: ~18 req/s saturate ``sequence``; the
trace (outputs capped at 256, prompts at ``--max-model-len 8192``) saturates near 3 req/s on
prefill alone (docs/performance.md).

CPU smoke test (tiny model, well under a minute)::

    python benchmarks/bench_serve_sweep.py --random-weights tiny --device cpu --traffics sampling,agents \\
        --rates sampling:2 agents:4 --duration 3 --n 2-4 --prompt-len 64-128 --sampling-output-len 4-8 \\
        --user-len 8-16 --agents-output-len 4-8 --out /tmp/serve.json --plot /tmp/serve.png
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import treeattn  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))
from treeattn import STRATEGIES
from treeattn.bench.serve import TRAFFICS, server_delta, server_snapshot
from treeattn.cli.engine import add_model_args
from treeattn.cli.serve import int_range_arg

log = logging.getLogger("bench_serve_sweep")

#: seconds kept back for stopping a server
STOP_MARGIN_S = 5.0
#: request rates (req/s) of each traffic unless --rates names them (see the module doc)
DEFAULT_RATES = {"sampling": (0.5, 1.0, 2.0), "agents": (5.0, 10.0, 20.0), "pat-trace": (1.0, 2.0, 3.0)}


# ---------------------------------------------------------------------- arguments
def rates_arg(items: list, traffics: list) -> dict:
    """``--rates`` items, ``TRAFFIC:R1,R2,...`` or ``R1,R2,...`` (every traffic), as sorted rate
    lists of each traffic in ``traffics`` (:data:`DEFAULT_RATES` for those not given).
    Raises ValueError naming a bad item."""
    out = {t: list(DEFAULT_RATES[t]) for t in traffics}
    for item in sorted(items or [], key=lambda x: ":" in x):      # plain lists first, named ones override
        name, _, text = item.rpartition(":")
        if name and name not in TRAFFICS:
            raise ValueError(f"--rates {item!r}: unknown traffic {name!r}; expected one of {', '.join(TRAFFICS)}")
        try:
            rates = sorted(float(r) for r in text.split(",") if r.strip())
        except ValueError:
            raise ValueError(f"--rates {item!r}: expected comma-separated numbers") from None
        if not rates or rates[0] <= 0:
            raise ValueError(f"--rates {item!r}: give positive request rates")
        for t in ([name] if name else traffics):
            if t in out:
                out[t] = rates
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(kv_tokens=262144)   # per server, 32 GiB of bf16 KV for Llama-3-8B: two servers fit an H200
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=0, help="0: a free port per server")
    g.add_argument("--prefix-block", type=int, default=64,
                   help="prefix-cache granularity in tokens (finer than the trace's 512-token blocks, so "
                        "the system prompt's 46 / 348-token levels are shared)")
    g.add_argument("--max-model-len", type=int, default=8192)
    g.add_argument("--max-batch", type=int, default=64)
    g.add_argument("--max-queue", type=int, default=1024)
    g.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health")
    g.add_argument("--server-log-level", default="info", choices=("debug", "info", "warning", "error"))
    g.add_argument("--one-at-a-time", action="store_true",
                   help="run each strategy's server alone (all its runs, then the next) instead of all "
                        "servers up together with their runs interleaved")
    g = p.add_argument_group("sweep")
    g.add_argument("--strategies", default="auto,sequence")
    g.add_argument("--traffics", default="sampling,agents,pat-trace",
                   help=f"comma-separated, run in this order: {', '.join(TRAFFICS)}")
    g.add_argument("--rates", nargs="+", default=None, metavar="[TRAFFIC:]R1,R2,...",
                   help="requests per second, per traffic (default: "
                        + " ".join(f"{t}:{','.join(f'{r:g}' for r in rs)}" for t, rs in DEFAULT_RATES.items())
                        + "); a list without a traffic sets every traffic's")
    g.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per run")
    g.add_argument("--request-seed", type=int, default=0, help="run i of a traffic uses seed request_seed + i")
    g.add_argument("--request-timeout", type=float, default=120.0,
                   help="per-request HTTP timeout (s; also bounds the wait for the first token)")
    g.add_argument("--drain-timeout", type=float, default=8.0,
                   help="cancel requests unfinished this many seconds after the arrival window")
    g.add_argument("--idle-timeout", type=float, default=30.0, help="seconds to wait for an idle server")
    g.add_argument("--time-budget", type=float, default=None, help="seconds for the whole sweep")
    g.add_argument("--progress", action="store_true", help="a progress bar per run")
    g = p.add_argument_group("pat-trace traffic")
    g.add_argument("--trace", default=None,
                   help="JSON-lines trace (default: shared/workloads/pat/conversation_trace.jsonl)")
    g.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash id")
    g.add_argument("--max-input-len", type=int, default=None)
    g.add_argument("--max-output-len", type=int, default=256)
    g = p.add_argument_group("sampling traffic (MIN-MAX ranges, drawn per request)")
    g.add_argument("--n", type=int_range_arg, default=(8, 16), metavar="MIN-MAX", help="choices (default: 8-16)")
    g.add_argument("--prompt-len", type=int_range_arg, default=(2048, 4096), metavar="MIN-MAX",
                   help="prompt tokens (default: 2048-4096)")
    g.add_argument("--sampling-output-len", type=int_range_arg, default=(128, 512), metavar="MIN-MAX",
                   help="output tokens per choice (default: 128-512)")
    g.add_argument("--temperature", type=float, default=1.0)
    g = p.add_argument_group("agents traffic")
    g.add_argument("--user-len", type=int_range_arg, default=(50, 300), metavar="MIN-MAX",
                   help="user-message tokens after the system prompt (default: 50-300)")
    g.add_argument("--agents-output-len", type=int_range_arg, default=(100, 400), metavar="MIN-MAX",
                   help="output tokens (default: 100-400)")
    g.add_argument("--system-seed", type=int, default=0, help="seed of the deployment's system prompt")
    g = p.add_argument_group("warm-up (each server, each traffic, before the timed runs)")
    g.add_argument("--warmup-requests", type=int, default=None,
                   help="choice streams of short requests sent at once (default: --max-batch on CUDA, 4 on "
                        "the CPU, which has no graphs to capture; 0: no warm-up); their outputs shrink by one "
                        "token a request, so the batch steps down through its sizes")
    g.add_argument("--warmup-input-len", type=int, default=1024,
                   help="prompt cap of the short pat-trace warm-up requests")
    g.add_argument("--warmup-long", type=int, default=None,
                   help="warm-up requests with whole prompts and 16 output tokens (default: 4 on CUDA, 1 on "
                        "the CPU)")
    g.add_argument("--warmup-timeout", type=float, default=120.0, help="seconds per traffic's warm-up")
    g = p.add_argument_group("evaluation")
    g.add_argument("--max-ttft", type=float, default=10.0, help="sustained: mean TTFT at most this (s)")
    g.add_argument("--min-throughput-ratio", type=float, default=0.9,
                   help="sustained: served / offered request throughput at least this")
    g.add_argument("--baseline", default="sequence")
    g.add_argument("--candidate", default="auto")
    g.add_argument("--target-reduction", type=float, default=0.30,
                   help="mean TPOT reduction of the candidate required at the baseline's highest "
                        "sustained rate")
    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, help="JSON results (rewritten after every run)")
    g.add_argument("--plot", default=None, help="PNG: TTFT, TPOT and output throughput vs rate, per traffic")
    g.add_argument("--log-dir", default=None, help="server logs (default: next to --out)")
    args = p.parse_args(argv)
    args.strategy_list = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in args.strategy_list if s not in STRATEGIES]
    if bad or not args.strategy_list:
        p.error(f"--strategies: unknown {bad}; expected from {STRATEGIES}")
    args.traffic_list = list(dict.fromkeys(t.strip() for t in args.traffics.split(",") if t.strip()))
    bad = [t for t in args.traffic_list if t not in TRAFFICS]
    if bad or not args.traffic_list:
        p.error(f"--traffics: unknown {bad}; expected from {TRAFFICS}")
    try:
        args.rates_by_traffic = rates_arg(args.rates, args.traffic_list)
    except ValueError as e:
        p.error(str(e))
    if args.duration <= 0:
        p.error("--duration must be positive")
    import torch

    args.cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if args.warmup_requests is None:
        args.warmup_requests = args.max_batch if args.cuda else 4
    if args.warmup_long is None:
        args.warmup_long = 4 if args.cuda else 1
    return args


def traffic_kwargs(args, traffic: str) -> dict:
    """Keyword arguments of :func:`treeattn.bench.serve.bench_serve` that shape ``traffic``."""
    if traffic == "pat-trace":
        return {"block_tokens": args.block_tokens, "max_input_len": args.max_input_len,
                "max_output_len": args.max_output_len}
    if traffic == "sampling":
        return {"options": {"n": args.n, "prompt_len": args.prompt_len, "output_len": args.sampling_output_len,
                            "temperature": args.temperature}}
    return {"options": {"user_len": args.user_len, "output_len": args.agents_output_len,
                        "system_seed": args.system_seed}}


def server_command(args, strategy: str, port: int) -> list:
    """``python -m treeattn.cli serve ...`` for one strategy (model arguments passed through)."""
    cmd = [sys.executable, "-m", "treeattn.cli", "serve"]
    cmd += ["--model", args.model] if args.model else ["--random-weights", args.random_weights]
    if args.device:
        cmd += ["--device", args.device]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    cmd += ["--seed", str(args.seed), "--page-size", str(args.page_size), "--kv-tokens", str(args.kv_tokens),
            "--window", str(args.window)]
    if args.no_cuda_graphs:
        cmd.append("--no-cuda-graphs")
    if args.no_fused_layers:
        cmd.append("--no-fused-layers")
    if args.compile_workers is not None:
        cmd += ["--compile-workers", str(args.compile_workers)]
    cmd += ["--strategy", strategy, "--host", args.host, "--port", str(port),
            "--prefix-block", str(args.prefix_block), "--max-model-len", str(args.max_model_len),
            "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
            "--log-level", args.server_log_level]
    return cmd


# ---------------------------------------------------------------------- server process
def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerError(RuntimeError):
    """The server did not start, died or hung."""


class Server:
    """``treeattn serve`` as a subprocess writing its output to ``log_path``."""

    def __init__(self, cmd: list, url: str, log_path):
        self.cmd, self.url, self.log_path = cmd, url, Path(log_path)
        self.proc = None
        self._log = None

    def start(self, timeout: float) -> float:
        """Start and wait for ``GET /health``; returns the seconds it took."""
        import httpx

        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
        self._log = open(self.log_path, "w")  # noqa: SIM115 - open while the server runs; closed by stop()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(ROOT), start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"the server exited with code {self.proc.returncode} while starting; "
                                  f"log tail ({self.log_path}):\n{_tail(self.log_path)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise ServerError(f"the server did not answer /health within {timeout:.0f} s; log tail "
                                  f"({self.log_path}):\n{_tail(self.log_path)}")
            time.sleep(0.5)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGINT (uvicorn's graceful shutdown), then SIGTERM, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return None
        for sig, wait in ((signal.SIGINT, 30.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                self.proc.send_signal(sig)
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                log.warning("the server ignored signal %s", sig.name)
            except ProcessLookupError:
                break
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.poll()


def health(url: str) -> dict | None:
    import httpx

    try:
        r = httpx.get(f"{url}/health", timeout=60)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def wait_idle(url: str, timeout: float, server: Server | None = None) -> dict:
    """Poll ``/health`` until no request runs or waits; returns its payload. Raises
    :class:`ServerError` on timeout or when the server died."""
    end = time.monotonic() + timeout
    h = None
    while time.monotonic() < end:
        if server is not None and not server.alive:
            raise ServerError(f"the server died; log tail ({server.log_path}):\n{_tail(server.log_path)}")
        h = health(url)
        if h is not None and h.get("running", 1) == 0 and h.get("waiting", 1) == 0:
            return h
        time.sleep(0.25)
    raise ServerError(f"the server did not become idle within {timeout:.0f} s (last /health: {h})")


# ---------------------------------------------------------------------- evaluation
def sustained_rule(args) -> dict:
    return {"text": ("every request completed (none failed, rejected or cancelled at the drain deadline), "
                     f"mean TTFT <= {args.max_ttft} s, and served throughput completed / (wall - mean latency) "
                     f">= {args.min_throughput_ratio} x offered throughput requests / duration"),
            "max_mean_ttft_s": args.max_ttft, "min_throughput_ratio": args.min_throughput_ratio}


def judge(summary: dict, duration: float, max_ttft_s: float, min_ratio: float) -> dict:
    """Whether a rate was sustained (see the module doc), with the reasons when not."""
    reasons = []
    n, done = summary["requests"], summary["completed"]
    if n == 0:
        reasons.append("no requests were sent")
    if summary["failed"]:
        reasons.append(f"{summary['failed']} of {n} requests failed")
    ttft = summary["ttft"]["mean_ms"]
    if ttft is None or ttft > max_ttft_s * 1e3:
        reasons.append(f"mean TTFT {ttft} ms > {max_ttft_s} s" if ttft is not None else "no TTFT")
    offered = n / duration
    span = summary["duration_s"] - (summary["latency"]["mean_ms"] or 0.0) / 1e3
    served = done / span if span > 0 else 0.0
    if n and served < min_ratio * offered:
        reasons.append(f"served {served:.3f} req/s < {min_ratio} x offered {offered:.3f} req/s")
    return {"sustained": not reasons, "reasons": reasons, "offered_rps": offered, "served_rps": served}


def _mean_tpot(run) -> float | None:
    return run["summary"]["tpot"]["mean_ms"] if run.get("summary") else None


def evaluate_target(runs: list, *, baseline: str = "sequence", candidate: str = "auto",
                    min_reduction: float = 0.30) -> dict:
    """Mean-TPOT reduction of ``candidate`` vs ``baseline`` at the highest rate the baseline
    sustains. A strategy run several times (``--strategies sequence,auto,auto,sequence``, which
    cancels run-order effects) counts with the mean of its mean TPOTs, and sustains a rate only
    if every run did."""
    groups: dict = {}
    for r in runs:
        if r.get("summary") and _mean_tpot(r) is not None:
            groups.setdefault((r["strategy"], r["rate"]), []).append(r)
    tpot = {k: sum(_mean_tpot(r) for r in g) / len(g) for k, g in groups.items()}
    sustained = {k: all(r.get("sustained") for r in g) for k, g in groups.items()}
    out = {"baseline": baseline, "candidate": candidate, "min_reduction": min_reduction,
           "sequence_max_sustained_rate": None, "tpot_reduction_at_that_rate": None, "pass": False,
           "tpot_reduction_by_rate": {},
           "runs_per_strategy_and_rate": {f"{s}@{r}": len(g) for (s, r), g in groups.items()}}
    for (s, rate), t in sorted(tpot.items(), key=lambda kv: kv[0][1]):
        c = tpot.get((candidate, rate))
        if s == baseline and c is not None and t:
            out["tpot_reduction_by_rate"][str(rate)] = 1.0 - c / t
    ok = [rate for (s, rate) in tpot if s == baseline and sustained[(s, rate)]]
    if not ok:
        out["note"] = f"{baseline} sustained none of the rates run"
        return out
    rate = max(ok)
    out["sequence_max_sustained_rate"] = rate
    c = tpot.get((candidate, rate))
    if c is None or not tpot[(baseline, rate)]:
        out["note"] = f"no {candidate} result with a TPOT at rate {rate}"
        return out
    red = 1.0 - c / tpot[(baseline, rate)]
    out["tpot_reduction_at_that_rate"] = red
    out["pass"] = bool(red >= min_reduction)
    return out


# ---------------------------------------------------------------------- output
def provenance_info(device: str | None) -> dict:
    """:func:`treeattn.bench.serve.provenance`, or what is known when it fails."""
    from treeattn.bench.serve import provenance

    try:
        return provenance(device)
    except Exception as e:  # noqa: BLE001 - provenance must never stop a benchmark
        log.warning("provenance() failed: %s", e)
        return {"device": device, "commit": os.environ.get("TREEATTN_COMMIT", "unknown")}


def write_json(result: dict, path) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def plot(result: dict, path) -> None:
    """Per traffic (a row): mean TTFT, TPOT (mean solid, P99 dotted) and output throughput vs the
    request rate, one colour per strategy (hollow markers: not sustained)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("mean TTFT (s)", lambda s: s["ttft"]["mean_ms"], 1e-3),
              ("TPOT (ms): mean, P99 dotted", lambda s: s["tpot"]["mean_ms"], 1.0),
              ("output throughput (tok/s)", lambda s: s["output_throughput"], 1.0)]
    runs = [r for r in result["runs"] if r.get("summary")]
    traffics = list(dict.fromkeys(r["traffic"] for r in result["runs"])) or ["pat-trace"]
    strategies = list(dict.fromkeys(r["strategy"] for r in result["runs"]))
    fig, axes = plt.subplots(len(traffics), 3, figsize=(13, 3.6 * len(traffics)), squeeze=False)
    for row, traffic in zip(axes, traffics):
        target = result.get("target", {}).get(traffic, {})
        for k, s in enumerate(strategies):
            mine = sorted((r for r in runs if r["strategy"] == s and r["traffic"] == traffic),
                          key=lambda r: r["rate"])
            for ax, (label, get, scale) in zip(row, panels):
                pts = [(r["rate"], get(r["summary"]) * scale, r.get("sustained")) for r in mine
                       if get(r["summary"]) is not None]
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=f"C{k}", label=s)
                for x, y, ok in pts:
                    ax.plot([x], [y], "o", color=f"C{k}", markerfacecolor=f"C{k}" if ok else "white")
            p99 = [(r["rate"], r["summary"]["tpot"]["p99_ms"]) for r in mine if r["summary"]["tpot"]["p99_ms"]]
            if p99:
                row[1].plot([p[0] for p in p99], [p[1] for p in p99], ":x", color=f"C{k}", ms=4)
        rate, red = target.get("sequence_max_sustained_rate"), target.get("tpot_reduction_at_that_rate")
        for ax, (label, _, _) in zip(row, panels):
            ax.set_xlabel("request rate (req/s)")
            ax.set_title(f"{traffic}: {label}", fontsize=10)
            ax.grid(alpha=0.3)
            if rate is not None:
                ax.axvline(rate, color="gray", ls=":", lw=1)
        if red is not None:
            row[1].annotate(f"{target['candidate']} {-red:+.0%} vs {target['baseline']} at {rate} req/s",
                            (0.02, 0.92), xycoords="axes fraction", fontsize=8)
        row[0].legend(title="strategy", fontsize=8)
    fig.suptitle(f"{result.get('model')} on {result.get('device')} (hollow: not sustained)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(s: dict) -> str:
    def ms(d):
        return "-" if d is None else f"{d:.1f}"
    return (f"{s['completed']}/{s['requests']} done ({s.get('cancelled', 0)} cancelled) in {s['duration_s']:.1f} s, "
            f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} tok/s | "
            f"TTFT {ms(s['ttft']['mean_ms'])} ms | "
            f"TPOT mean {ms(s['tpot']['mean_ms'])} P99 {ms(s['tpot']['p99_ms'])} ms")


def _fmt_steps(d: dict) -> str:
    """The run's decode step wall and GPU ms (mean, p50, p99) and their ratio, where measured."""
    wall, gpu = d.get("decode_step_wall") or {}, d.get("decode_step_gpu") or {}
    if wall.get("mean_ms") is None:
        return ""

    def ms(s):
        return "-" if s.get("mean_ms") is None else f"{s['mean_ms']:.2f}/{s['p50_ms']:.2f}/{s['p99_ms']:.2f}"
    ratio = d.get("decode_wall_over_gpu")
    return (f" | decode step mean/p50/p99 wall {ms(wall)} GPU {ms(gpu)} ms"
            + (f", wall/GPU {ratio:.2f}" if ratio is not None else ""))


# ---------------------------------------------------------------------- sweep
def warmup_requests(requests: list, choices: int, *, long: int = 0, input_len: int | None = None) -> list:
    """Warm-up requests made of one traffic's ``requests``, all arriving at once: the first ones
    that together hold ``choices`` choice streams, prompts capped at ``input_len``, request ``j``
    of ``k`` with ``k + 7 - j`` output tokens (the batch steps down through its sizes: CUDA graphs,
    kernel variants), then ``long`` more with their whole prompts and 16 output tokens (long
    prefills and decode trees)."""
    k, held = 0, 0
    while k < len(requests) and held < choices:
        held += requests[k].n
        k += 1
    short = [replace(r, prompt=r.prompt[:input_len], max_tokens=k + 7 - j, arrival=0.0)
             for j, r in enumerate(requests[:k])]
    return short + [replace(r, max_tokens=16, arrival=0.0) for r in requests[k: k + long]]


def warm_up(url: str, args, traffic: str, trace_path, deadline: float) -> dict:
    """Send :func:`warmup_requests` of ``traffic`` to the server at ``url``; returns their summary."""
    import asyncio

    import httpx

    from treeattn.bench.serve import PAT_SYSTEM_PROMPT, make_requests, replay, summarize

    info = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    opts = traffic_kwargs(args, traffic)
    # the short requests' prompts are cut below, so the trace's whole ones stay for the long ones
    reqs = make_requests(traffic, vocab_size=int(info["vocab_size"]), rate=1000.0, seed=args.request_seed + 10_000,
                         max_requests=args.warmup_requests + args.warmup_long,
                         max_model_len=info.get("max_model_len"), system_prompt=PAT_SYSTEM_PROMPT,
                         trace_path=trace_path if traffic == "pat-trace" else None, **opts)
    reqs = warmup_requests(reqs, args.warmup_requests, long=args.warmup_long,
                           input_len=args.warmup_input_len if traffic == "pat-trace" else None)
    results, wall = asyncio.run(replay(url, reqs, model=info["id"], timeout=args.request_timeout, progress=False,
                                       deadline=deadline))
    return summarize(results, wall)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("treeattn.bench.serve").setLevel(logging.WARNING)
    from treeattn.bench.serve import bench_serve
    from treeattn.tree import find_shared

    t_start = time.monotonic()
    budget_end = t_start + args.time_budget if args.time_budget else math.inf
    trace_path = None
    if "pat-trace" in args.traffic_list:
        trace_path = (Path(args.trace) if args.trace
                      else find_shared() / "workloads" / "pat" / "conversation_trace.jsonl")
        if not trace_path.is_file():
            raise FileNotFoundError(f"trace {trace_path} not found")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir) if args.log_dir else out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    model = args.model or f"random:{args.random_weights}"
    dtype = args.dtype or ("bfloat16" if args.cuda else "float32")
    result = {**provenance_info(args.device), "model": model, "dtype": dtype,
              "started": datetime.datetime.now().isoformat(timespec="seconds"), "status": "running",
              "args": dict(vars(args)), "trace": str(trace_path) if trace_path else None,
              "sustained_rule": sustained_rule(args), "servers": {}, "warmup": {}, "runs": [], "skipped": []}
    # every strategy listed gets a server; one listed again (A,B,B,A) gets its own name, log and keys
    names = [s if args.strategy_list.index(s) == k else f"{s}#{k}" for k, s in enumerate(args.strategy_list)]
    strategy_of = dict(zip(names, args.strategy_list))
    plan = [(t, i, r) for t in args.traffic_list for i, r in enumerate(args.rates_by_traffic[t])]

    def save():
        result["target"] = {t: evaluate_target([r for r in result["runs"] if r["traffic"] == t],
                                               baseline=args.baseline, candidate=args.candidate,
                                               min_reduction=args.target_reduction) for t in args.traffic_list}
        result["elapsed_s"] = time.monotonic() - t_start
        write_json(result, out)

    def skip(name, runs, reason):
        for traffic, _, rate in runs:
            result["skipped"].append({"strategy": strategy_of[name], "server_name": name, "traffic": traffic,
                                      "rate": rate, "reason": reason})
        if runs:
            log.warning("%s: skipping %d runs: %s", name, len(runs), reason)

    def run_one(name, server, traffic, i, rate, left):
        url = server.url
        before = server_snapshot(url)
        t0 = time.monotonic()
        run = {"strategy": strategy_of[name], "server_name": name, "traffic": traffic, "rate": rate,
               "seed": args.request_seed + i}
        try:
            summary = bench_serve(trace_path if traffic == "pat-trace" else None, url=url, rate=rate,
                                  traffic=traffic, duration=args.duration, seed=args.request_seed + i,
                                  timeout=args.request_timeout, progress=args.progress, server_stats=False,
                                  deadline=min(args.duration + args.drain_timeout, left),
                                  **traffic_kwargs(args, traffic))
        except Exception as e:  # noqa: BLE001 - recorded; the server is checked below
            run["error"] = f"{type(e).__name__}: {e}"
            result["runs"].append(run)
            save()
            log.error("%s %s @ %s req/s failed: %s", name, traffic, rate, run["error"])
            wait_idle(url, args.idle_timeout, server)
            return
        try:
            wait_idle(url, args.idle_timeout, server)
        except ServerError as e:      # the run's numbers stand; the server's end is the caller's
            run.update(summary=summary, error=str(e).splitlines()[0])
            result["runs"].append(run)
            save()
            raise
        run.update(summary=summary, wall_s=time.monotonic() - t0,
                   server=server_delta(before, server_snapshot(url, since=before)),
                   **judge(summary, args.duration, args.max_ttft, args.min_throughput_ratio))
        result["runs"].append(run)
        save()
        log.info("%s %s @ %s req/s: %s%s%s", name, traffic, rate, _fmt(summary), _fmt_steps(run["server"]),
                 "" if run["sustained"] else f"  NOT sustained: {'; '.join(run['reasons'])}")

    def warm_all(name, server, end):
        """Warm ``server`` up with every traffic, leaving time for one run before ``end``."""
        result["warmup"][name] = {}
        for traffic in args.traffic_list:
            t0 = time.monotonic()
            left = end - t0 - args.duration - args.drain_timeout
            try:
                w = warm_up(server.url, args, traffic, trace_path, max(1.0, min(args.warmup_timeout, left)))
            except Exception as e:  # noqa: BLE001 - a failed warm-up is recorded, not fatal
                w = {"error": f"{type(e).__name__}: {e}"}
            w.update(wall_s=time.monotonic() - t0, server=wait_idle(server.url, args.idle_timeout, server))
            result["warmup"][name][traffic] = w
            log.info("%s: %s warm-up took %.1f s%s", name, traffic, w["wall_s"],
                     f" ({_fmt(w)})" if "ttft" in w else f" ({w.get('error')})")

    save()
    groups = [[n] for n in names] if args.one_at_a_time else [names]
    try:
        for g, group in enumerate(groups):
            now = time.monotonic()
            share_end = now + (budget_end - now) / (len(groups) - g)
            servers = {}
            try:
                for k, name in enumerate(group):
                    port = args.port + names.index(name) if args.port else free_port(args.host)
                    server = Server(server_command(args, strategy_of[name], port), f"http://{args.host}:{port}",
                                    log_dir / f"{out.stem}_{name.replace('#', '_')}_server.log")
                    info = result["servers"][name] = {"command": " ".join(server.cmd), "log": str(server.log_path)}
                    left = share_end - time.monotonic() - STOP_MARGIN_S * (k + 1)
                    if left < args.duration + args.drain_timeout:
                        skip(name, plan, "time budget spent before the server started")
                        continue
                    log.info("%s: starting the server: %s", name, info["command"])
                    try:
                        info["startup_s"] = server.start(min(args.startup_timeout, left))
                        log.info("%s: server up after %.1f s at %s", name, info["startup_s"], server.url)
                        servers[name] = server
                        if args.warmup_requests > 0:
                            warm_all(name, server, share_end - STOP_MARGIN_S * (k + 1))
                    except ServerError as e:
                        info["error"] = str(e)
                        log.error("%s: %s", name, e)
                        servers.pop(name, None)
                        server.stop()
                        skip(name, plan, f"server error: {str(e).splitlines()[0]}")
                    save()
                for p, (traffic, i, rate) in enumerate(plan):
                    # the strategies of one rate run all or none, in an order that alternates by rate
                    order = [n for n in (group if p % 2 == 0 else group[::-1]) if n in servers]
                    left = share_end - time.monotonic() - STOP_MARGIN_S * len(servers)
                    if left < len(order) * (args.duration + args.drain_timeout):
                        for name in order:
                            skip(name, plan[p:], f"time budget ({left:.0f} s left)")
                        break
                    for name in order:
                        left = share_end - time.monotonic() - STOP_MARGIN_S * len(servers)
                        try:
                            run_one(name, servers[name], traffic, i, rate, left)
                        except ServerError as e:
                            result["servers"][name]["error"] = str(e)
                            log.error("%s: %s", name, e)
                            servers.pop(name).stop()
                            skip(name, plan[p + 1:], f"server error: {str(e).splitlines()[0]}")
                            save()
            finally:
                for name, server in servers.items():
                    t0 = time.monotonic()
                    result["servers"][name]["exit_code"] = server.stop()
                    result["servers"][name]["stop_s"] = time.monotonic() - t0
                save()
        result["status"] = "complete"
    except BaseException as e:
        result["status"] = f"interrupted: {type(e).__name__}: {e}"
        raise
    finally:
        result["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        save()
        if args.plot:
            try:
                plot(result, args.plot)
                log.info("wrote %s", args.plot)
            except Exception as e:  # noqa: BLE001 - the JSON is the result; the plot is a view of it
                log.error("plot failed: %s", e)
    for traffic, t in result["target"].items():
        red = t["tpot_reduction_at_that_rate"]
        log.info("%s: %s max sustained rate %s, %s mean TPOT reduction there %s -> %s", traffic, args.baseline,
                 t["sequence_max_sustained_rate"], args.candidate, "n/a" if red is None else f"{red:.1%}",
                 "PASS" if t["pass"] else "FAIL")
    log.info("wrote %s", out)
    return 0 if result["runs"] else 1


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _sigterm)
    sys.exit(main())
