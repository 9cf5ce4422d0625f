"""Online serving sweep (PAT Fig. 11 style): PAT's conversation trace replayed against
``treeattn serve`` at several Poisson request rates, once per attention strategy.

For every strategy the script starts ``python -m treeattn.cli serve --strategy S ...`` as a
subprocess (its log goes next to ``--out``), waits for ``GET /health``, warms it up, then replays
the trace at each rate in ascending order with :func:`treeattn.bench.serve.bench_serve` (streaming
requests, ``ignore_eos``), waits until the server is idle before the next rate, and stops the
server before the next strategy. Rate ``i`` uses trace seed ``--trace-seed + i`` for every
strategy, so each strategy sees the same requests at a rate while no rate hits the prefix blocks
cached by the previous one (block contents are drawn from the seed). The JSON (``--out``) is
rewritten after every rate, so a killed sweep keeps its finished rates; ``--plot`` draws mean TTFT,
mean TPOT and P99 TPOT against the rate, one line per strategy (hollow markers: not sustained).

A rate is *sustained* (the rule is also written to the JSON) when every request completed (none
failed, rejected or cancelled at the drain deadline), the mean TTFT is at most ``--max-ttft`` s,
and the served throughput, ``completed / (wall - mean latency)``, is at least
``--min-throughput-ratio`` of the offered one, ``requests / duration`` (the wall time runs from the
first arrival to the last completion; subtracting the mean latency removes the drain of the last
requests, which a stable server also needs). The target compares ``--candidate`` (auto) with
``--baseline`` (sequence): mean TPOT at the highest rate the baseline sustains must be at least
``--target-reduction`` (30%) lower. The first server started on a fresh machine has measured
1.3-1.8x slower whichever strategy it ran (docs/performance.md); list the strategies as
``sequence,auto,auto,sequence`` to cancel such order effects (each strategy counts with its mean).

Time: ``--time-budget`` bounds the whole sweep. Each strategy gets an equal share of what is
left when it starts (a strategy that finishes early leaves its time to the next); a rate starts
only when its share still holds ``--duration`` plus 10 s of drain, its requests still unfinished
``--drain-timeout`` s after the arrival window (or at the end of the share) are cancelled, and the
rates that do not fit are recorded under ``skipped``.

H200 run (Llama-3-8B shape, random bf16 weights; the whole run must fit in 9 minutes for two
strategies; --rates, --duration, --max-output-len, --drain-timeout and --kv-tokens default to these)::

    python benchmarks/bench_serve_sweep.py --random-weights llama3-8b --device cuda --dtype bfloat16 \\
        --kv-tokens 393216 --strategies auto,sequence --rates 0.5,1,2,3 --duration 25 \\
        --max-output-len 256 --drain-timeout 20 --time-budget 480 \\
        --out benchmarks/results/serve_sweep_h200.json --plot benchmarks/results/serve_sweep_h200.png

Why these numbers: the trace's prompts are long (median 6.9K, mean 12K tokens; cut here to
``--max-model-len 8192`` less the output, ~6.5K on average) and share little (block 0 and a few
conversation turns: ~8% of the prompt tokens of 30-120 consecutive requests), so a request costs
~6K prefilled tokens, roughly 0.3-0.4 s of an H200 for an 8B model, plus ~220 decode steps
(outputs capped at 256; the trace's median is 350) of 8-15 ms each. Prefill alone saturates the
GPU near 2.5-3 req/s, so rates 0.5-3 span the idle server to overload. Per strategy: ~20-60 s to
start a server with random 8B weights, ~20-50 s of warm-up (``--max-batch`` short requests whose
batch steps down from 64 to 1, capturing every CUDA-graph bucket, plus 4 full-length ones; Triton
compiles the tree kernels on first use), then 25 s of arrivals per rate (12-75 requests) plus the
drain (a few seconds when sustained, cut at 20 s when not): ~200-230 s, so two strategies fit the
480 s budget with a minute of the 9 to spare; a rate that no longer fits its strategy's share is
skipped (and recorded) rather than overrun. ``--kv-tokens 393216`` (48 GiB of bf16 KV next to 16
GB of weights) holds ~45 requests of 8K tokens, so an overloaded rate runs out of batch slots (64)
before it runs out of pages; the engine's default 65536 (8 GiB, 8 requests) would preempt at
every rate.

CPU smoke test (tiny model, well under a minute)::

    python benchmarks/bench_serve_sweep.py --random-weights tiny --device cpu --rates 2,4 --duration 3 \\
        --max-output-len 8 --max-input-len 600 --out /tmp/serve.json --plot /tmp/serve.png
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import treeattn  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))
from treeattn import STRATEGIES
from treeattn.cli.engine import add_model_args

log = logging.getLogger("bench_serve_sweep")

#: seconds of drain a rate needs at least (besides its arrival window) to be started
MIN_DRAIN_S = 10.0
#: seconds kept back from a strategy's share for stopping its server
STOP_MARGIN_S = 5.0


# ---------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(kv_tokens=393216)   # 48 GiB of bf16 KV for Llama-3-8B: ~45 requests of 8K tokens
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
    g = p.add_argument_group("sweep")
    g.add_argument("--strategies", default="auto,sequence")
    g.add_argument("--rates", default="0.5,1,2,3", help="requests per second, comma-separated")
    g.add_argument("--duration", type=float, default=25.0, help="seconds of arrivals per rate")
    g.add_argument("--trace", default=None,
                   help="JSON-lines trace (default: shared/workloads/pat/conversation_trace.jsonl)")
    g.add_argument("--trace-seed", type=int, default=0, help="rate i uses seed trace_seed + i")
    g.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash id")
    g.add_argument("--max-input-len", type=int, default=None)
    g.add_argument("--max-output-len", type=int, default=256)
    g.add_argument("--request-timeout", type=float, default=120.0,
                   help="per-request HTTP timeout (s; also bounds the wait for the first token)")
    g.add_argument("--drain-timeout", type=float, default=20.0,
                   help="cancel requests unfinished this many seconds after the arrival window")
    g.add_argument("--idle-timeout", type=float, default=30.0, help="seconds to wait for an idle server")
    g.add_argument("--time-budget", type=float, default=None, help="seconds for the whole sweep")
    g.add_argument("--warmup-requests", type=int, default=None,
                   help="short requests sent at once before the timed rates (default: --max-batch on "
                        "CUDA, 4 on the CPU, which has no graphs to capture; 0: no warm-up); their "
                        "outputs shrink by one token each, so the batch steps down through every size")
    g.add_argument("--warmup-input-len", type=int, default=1024, help="prompt cap of the short warm-up requests")
    g.add_argument("--warmup-long", type=int, default=None,
                   help="warm-up requests with full-length prompts and 16 output tokens (default: 4 on "
                        "CUDA, 1 on the CPU)")
    g.add_argument("--warmup-timeout", type=float, default=180.0)
    g.add_argument("--progress", action="store_true", help="a progress bar per rate")
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
    g.add_argument("--out", required=True, help="JSON results (rewritten after every rate)")
    g.add_argument("--plot", default=None, help="PNG: mean TTFT, mean TPOT, P99 TPOT vs rate")
    g.add_argument("--log-dir", default=None, help="server logs (default: next to --out)")
    args = p.parse_args(argv)
    args.strategy_list = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in args.strategy_list if s not in STRATEGIES]
    if bad or not args.strategy_list:
        p.error(f"--strategies: unknown {bad}; expected from {STRATEGIES}")
    try:
        args.rate_list = sorted(float(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        p.error(f"--rates {args.rates!r}: expected comma-separated numbers")
    if not args.rate_list or min(args.rate_list) <= 0:
        p.error("--rates: give positive request rates")
    if args.duration <= 0:
        p.error("--duration must be positive")
    import torch

    args.cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if args.warmup_requests is None:
        args.warmup_requests = args.max_batch if args.cuda else 4
    if args.warmup_long is None:
        args.warmup_long = 4 if args.cuda else 1
    return args


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


def server_delta(before: dict | None, after: dict | None) -> dict:
    """Server-side counters of one rate (differences of two ``/health`` payloads).

    Derived: ``mean_batch`` (sequences per step); ``kv_io_saving``, ``1 - kv_unique_tokens /
    kv_visible_tokens``, the share of decode attention's KV reads that reading each shared token
    once saves (an upper bound of what prefix-aware attention can save); ``decode_step_ms``, the
    mean wall time between device waits without a prefill; ``prefill_share``, the share of the
    timed wall time that prefills took, each prefill interval less one ``decode_step_ms``.
    """
    if not before or not after:
        return {}
    out = {}
    for k in ("steps", "preemptions", "decoded_tokens", "prefix_hit_tokens", "prefill_tokens", "plan_ms",
              "kv_visible_tokens", "kv_unique_tokens", "prefill_ms", "prefill_steps", "decode_ms"):
        if k in before and k in after:
            out[k] = after[k] - before[k]
    if out.get("steps"):
        out["mean_batch"] = out.get("decoded_tokens", 0) / out["steps"]
    if out.get("kv_visible_tokens"):
        out["kv_io_saving"] = 1.0 - out["kv_unique_tokens"] / out["kv_visible_tokens"]
    if "decode_ms" in out and out["steps"] > out["prefill_steps"]:
        step = out["decode_step_ms"] = out["decode_ms"] / (out["steps"] - out["prefill_steps"])
        total = out["prefill_ms"] + out["decode_ms"]
        out["prefill_share"] = max(0.0, out["prefill_ms"] - out["prefill_steps"] * step) / total
    if "strategies" in after:
        b = before.get("strategies", {})
        out["strategies"] = {k: v - b.get(k, 0) for k, v in after["strategies"].items() if v - b.get(k, 0)}
    for k in ("max_batch_seen", "num_pages", "free_pages", "cached_blocks"):
        if k in after:
            out[k] = after[k]
    return out


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
           "tpot_reduction_by_rate": {}, "runs_per_strategy_and_rate": {f"{s}@{r}": len(g) for (s, r), g in groups.items()}}
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
    """:func:`treeattn.bench.timing.provenance` on CUDA; the same keys elsewhere."""
    import torch

    if (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
        try:
            from treeattn.bench.timing import provenance
            return provenance()
        except Exception as e:  # noqa: BLE001 - provenance must never stop a benchmark
            log.warning("provenance() failed: %s", e)
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    commit = os.environ.get("TREEATTN_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=True, cwd=str(ROOT)).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {"device": f"cpu ({platform.processor() or platform.machine()})", "torch": torch.__version__,
            "triton": tv, "python": platform.python_version(), "commit": commit}


def write_json(result: dict, path) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def plot(result: dict, path) -> None:
    """Mean TTFT, mean TPOT and P99 TPOT vs request rate, one line per strategy (PAT Fig. 11)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("mean TTFT (s)", lambda s: s["ttft"]["mean_ms"], 1e-3),
              ("mean TPOT (ms)", lambda s: s["tpot"]["mean_ms"], 1.0),
              ("P99 TPOT (ms)", lambda s: s["tpot"]["p99_ms"], 1.0)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    strategies = list(dict.fromkeys(r["strategy"] for r in result["runs"]))
    for k, s in enumerate(strategies):
        runs = sorted((r for r in result["runs"] if r["strategy"] == s and r.get("summary")),
                      key=lambda r: r["rate"])
        color = f"C{k}"
        for ax, (label, get, scale) in zip(axes, panels):
            pts = [(r["rate"], get(r["summary"]) * scale, r.get("sustained")) for r in runs
                   if get(r["summary"]) is not None]
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=color, label=s)
            for x, y, ok in pts:
                ax.plot([x], [y], "o", color=color, markerfacecolor=color if ok else "white")
    rate = result.get("target", {}).get("sequence_max_sustained_rate")
    for ax, (label, _, _) in zip(axes, panels):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        if rate is not None:
            ax.axvline(rate, color="gray", ls=":", lw=1)
    axes[0].legend(title="strategy")
    t = result.get("target", {})
    red = t.get("tpot_reduction_at_that_rate")
    note = (f"; {t.get('candidate')} mean TPOT {-red:+.0%} vs {t.get('baseline')} at {rate} req/s "
            f"({'pass' if t.get('pass') else 'fail'})" if red is not None else "")
    fig.suptitle(f"{result.get('model')} on {result.get('device')}: trace replay (hollow: not sustained){note}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(s: dict) -> str:
    def ms(d):
        return "-" if d is None else f"{d:.1f}"
    return (f"{s['completed']}/{s['requests']} done ({s.get('cancelled', 0)} cancelled) in {s['duration_s']:.1f} s, "
            f"{s['request_throughput']:.2f} req/s | TTFT {ms(s['ttft']['mean_ms'])} ms | "
            f"TPOT mean {ms(s['tpot']['mean_ms'])} P99 {ms(s['tpot']['p99_ms'])} ms")


# ---------------------------------------------------------------------- sweep
def warmup_trace(trace: list, n: int, input_len: int, path, *, long: int = 0,
                 max_input_len: int | None = None) -> int:
    """Warm-up requests written to ``path``: ``n`` trace records with inputs capped at ``input_len``
    and outputs of ``n + 7`` down to 8 tokens (sent at once, they step the batch down through
    every size: CUDA graphs, kernel variants), then ``long`` records with their whole prompts (up
    to ``max_input_len``) and 16 output tokens (long prefills and decode trees). Returns the count."""
    cap = max_input_len or 1 << 62
    recs = [{"input_length": min(int(rec["input_length"]), input_len, cap), "output_length": n + 7 - j,
             "hash_ids": rec["hash_ids"]} for j, rec in enumerate(trace[:n])]
    recs += [{"input_length": min(int(rec["input_length"]), cap), "output_length": 16,
              "hash_ids": rec["hash_ids"]} for rec in trace[n: n + long]]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    return len(recs)


def _max_requests(rate: float, duration: float) -> int:
    lam = rate * duration
    return int(lam + 6 * math.sqrt(lam) + 20)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("treeattn.bench.serve").setLevel(logging.WARNING)
    from treeattn.bench.serve import bench_serve, load_trace
    from treeattn.tree import find_shared

    t_start = time.monotonic()
    budget_end = t_start + args.time_budget if args.time_budget else math.inf
    trace_path = Path(args.trace) if args.trace else find_shared() / "workloads" / "pat" / "conversation_trace.jsonl"
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
              "args": {k: v for k, v in vars(args).items()}, "trace": str(trace_path),
              "sustained_rule": sustained_rule(args), "servers": {}, "warmup": {}, "runs": [], "skipped": []}

    def save():
        result["target"] = evaluate_target(result["runs"], baseline=args.baseline, candidate=args.candidate,
                                           min_reduction=args.target_reduction)
        result["elapsed_s"] = time.monotonic() - t_start
        write_json(result, out)

    def skip(strategy, rates, reason):
        for rate in rates:
            result["skipped"].append({"strategy": strategy, "rate": rate, "reason": reason})
        log.warning("%s: skipping rates %s: %s", strategy, rates, reason)

    save()
    tmpdir = tempfile.TemporaryDirectory(prefix="serve_sweep_")
    warm_path = Path(tmpdir.name) / "warmup.jsonl"
    n_warm = 0
    if args.warmup_requests > 0:
        n_warm = warmup_trace(load_trace(trace_path, args.warmup_requests + args.warmup_long),
                              args.warmup_requests, args.warmup_input_len, warm_path, long=args.warmup_long,
                              max_input_len=args.max_input_len)
    try:
        for k, strategy in enumerate(args.strategy_list):
            now = time.monotonic()
            share_end = now + (budget_end - now) / (len(args.strategy_list) - k)
            stem = out.stem
            port = args.port + k if args.port else free_port(args.host)
            url = f"http://{args.host}:{port}"
            # a strategy listed again (A,B,B,A) gets its own server, log and keys
            name = strategy if args.strategy_list.index(strategy) == k else f"{strategy}#{k}"
            server = Server(server_command(args, strategy, port), url,
                            log_dir / f"{stem}_{name.replace('#', '_')}_server.log")
            info = result["servers"][name] = {"command": " ".join(server.cmd), "log": str(server.log_path)}
            first_run, first_skip = len(result["runs"]), len(result["skipped"])
            if share_end - now < args.duration + MIN_DRAIN_S + STOP_MARGIN_S:
                skip(strategy, args.rate_list, "time budget spent before the server started")
                save()
                continue
            log.info("%s: starting the server: %s", strategy, info["command"])
            try:
                info["startup_s"] = server.start(min(args.startup_timeout, share_end - now))
                log.info("%s: server up after %.1f s at %s", strategy, info["startup_s"], url)
                if n_warm:
                    t0 = time.monotonic()
                    left = share_end - t0 - args.duration - MIN_DRAIN_S - STOP_MARGIN_S
                    try:
                        w = bench_serve(warm_path, url=url, rate=1000.0, block_tokens=args.block_tokens,
                                        seed=args.trace_seed + 10_000, timeout=args.request_timeout,
                                        progress=False, deadline=max(1.0, min(args.warmup_timeout, left)))
                    except Exception as e:  # noqa: BLE001 - a failed warm-up is recorded, not fatal
                        w = {"error": f"{type(e).__name__}: {e}"}
                    h = wait_idle(url, args.idle_timeout, server)
                    w.update(wall_s=time.monotonic() - t0, server=h)
                    result["warmup"][name] = w
                    log.info("%s: warm-up took %.1f s%s", strategy, w["wall_s"],
                             f" ({_fmt(w)})" if "ttft" in w else f" ({w.get('error')})")
                save()
                for i, rate in enumerate(args.rate_list):
                    left = share_end - time.monotonic() - STOP_MARGIN_S
                    if left < args.duration + MIN_DRAIN_S:
                        skip(strategy, args.rate_list[i:], f"time budget ({left:.0f} s left of this strategy's share)")
                        break
                    before = health(url)
                    seed = args.trace_seed + i
                    t0 = time.monotonic()
                    run = {"strategy": strategy, "rate": rate, "seed": seed}
                    try:
                        summary = bench_serve(
                            trace_path, url=url, rate=rate, duration=args.duration,
                            max_requests=_max_requests(rate, args.duration), block_tokens=args.block_tokens,
                            seed=seed, max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                            timeout=args.request_timeout, progress=args.progress,
                            deadline=min(args.duration + args.drain_timeout, left))
                    except Exception as e:  # noqa: BLE001 - recorded; the server is checked below
                        run["error"] = f"{type(e).__name__}: {e}"
                        result["runs"].append(run)
                        save()
                        log.error("%s @ %s req/s failed: %s", strategy, rate, run["error"])
                        wait_idle(url, args.idle_timeout, server)
                        continue
                    idle = wait_idle(url, args.idle_timeout, server)
                    run.update(summary=summary, wall_s=time.monotonic() - t0, server=server_delta(before, idle),
                               **judge(summary, args.duration, args.max_ttft, args.min_throughput_ratio))
                    result["runs"].append(run)
                    save()
                    log.info("%s @ %s req/s: %s%s", strategy, rate, _fmt(summary),
                             "" if run["sustained"] else f"  NOT sustained: {'; '.join(run['reasons'])}")
            except ServerError as e:
                info["error"] = str(e)
                log.error("%s: %s", strategy, e)
                done = {r["rate"] for r in result["runs"][first_run:]}
                skipped = {s["rate"] for s in result["skipped"][first_skip:]}
                rest = [r for r in args.rate_list if r not in done | skipped]
                if rest:
                    skip(strategy, rest, f"server error: {str(e).splitlines()[0]}")
            finally:
                t0 = time.monotonic()
                info["exit_code"] = server.stop()
                info["stop_s"] = time.monotonic() - t0
                save()
        result["status"] = "complete"
    except BaseException as e:
        result["status"] = f"interrupted: {type(e).__name__}: {e}"
        raise
    finally:
        tmpdir.cleanup()
        result["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        save()
        if args.plot:
            try:
                plot(result, args.plot)
                log.info("wrote %s", args.plot)
            except Exception as e:  # noqa: BLE001 - the JSON is the result; the plot is a view of it
                log.error("plot failed: %s", e)
    t = result["target"]
    log.info("wrote %s; %s max sustained rate %s, %s mean TPOT reduction there %s -> %s", out, args.baseline,
             t["sequence_max_sustained_rate"], args.candidate,
             "n/a" if t["tpot_reduction_at_that_rate"] is None else f"{t['tpot_reduction_at_that_rate']:.1%}",
             "PASS" if t["pass"] else "FAIL")
    return 0 if result["runs"] else 1


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _sigterm)
    sys.exit(main())
