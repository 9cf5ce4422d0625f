"""End-to-end decode benchmark (DeFT Table 5 and Fig. 4): every workload with several treeattn
strategies in the same run, on one model.

Each workload is replayed in full. By default (``steps=None``, ``--steps all``) every step runs
the model and the workload is cut into consecutive *windows*; with a step count, only a few windows
of consecutive steps spread over the workload run it (the others only do the tree / KV
bookkeeping: their KV slots are allocated but not written, which does not change the timing of
later steps), which samples the workload: ToT's steps decode varying numbers of queries, and 3
windows of 10 steps misjudged its mean. Per window: ``warmup_steps`` warm-up steps (one by
default), ``steps / windows`` timed steps (back to back, no host synchronisation: the per-iteration latency is the interval
between CUDA events recorded after each step), then a few *breakdown* steps, each run in isolation
after a GPU sleep long enough for the host to enqueue the whole step first, so their CUDA events
measure pure GPU time: attention (events around every layer's attention call, summed) and the rest.
Host times (KV management, planning, issuing the forward pass) come from the engine's own timers.

Every attention-kernel variant is compiled before the run (``TreeEngine.precompile_kernels``).
``mean_step_ms`` leaves out timed steps slower than 4x the median (one-time costs such as
allocator growth; ``outliers`` counts them, ``mean_step_ms_all`` keeps them).

``host_overhead`` is the share of the timed steps' latency during which the GPU waited for the
host: each timed step records an event when its forward pass is issued (after its planning and
KV bookkeeping), and the GPU time from the previous step's end event to it is ``idle_ms`` (zero
when the host issued the forward before the GPU finished the previous step; otherwise the wait,
plus the step's few KV copies issued before its forward). Until 03a2ab8 the event sat before the
step's host work, where it could not see the GPU wait while the host planned. ``busy_step_ms`` is
the mean step latency without that idle time. ``isolated_gap`` = (mean step latency -
``gpu_step_ms``) / mean step latency compares back-to-back steps with the isolated breakdown
steps: 13-17% on ToT and speculative decoding before the engine recorded a timing event after
each attention-graph replay (e7bdb2a), -5% to +9% since (docs/performance.md).
"""
from __future__ import annotations

import gc
import math
import time

import numpy as np
import torch

from treeattn.engine.engine import TreeEngine
from treeattn.engine.workloads import WorkloadSpec, build_workload

__all__ = ["DEFT_DECODING_SPEEDUP", "BENCH_WORKLOADS", "bench_workload", "bench_e2e", "plot_e2e"]


#: DeFT-Flatten's decoding speedups over Radix Attention (DeFT Table 5): the targets.
DEFT_DECODING_SPEEDUP = {
    "fewshot-20": 1.24, "fewshot-30": 1.28, "fewshot-50": 1.33,
    "tot-sorting": 1.10, "tot-docmerge": 1.03, "tot-keyword": 1.03, "tot-set": 1.05,
    "speculative-32": 1.29, "speculative-64": 1.50, "speculative-128": 1.91, "speculative-256": 2.23,
}
BENCH_WORKLOADS = tuple(DEFT_DECODING_SPEEDUP)


def _spec(name: str, vocab: int, seed: int) -> WorkloadSpec:
    if name.startswith("fewshot-"):
        return WorkloadSpec("fewshot", vocab_size=vocab, branches=int(name.split("-")[1]), steps=400,
                            seed=seed)
    return WorkloadSpec(name, vocab_size=vocab, seed=seed)


def _schedule(total: int, steps: int | None, windows: int, breakdown: int, warmup: int = 1) -> dict:
    """step -> "warm" | "timed" | "breakdown" for the steps that run the model. ``steps`` None:
    every step runs it, the workload cut into ``windows`` consecutive windows (each its warm-up,
    timed and breakdown steps), so the timed steps are all but ``windows * (warmup + breakdown)``
    of the workload."""
    if steps is None:
        windows = max(1, min(windows, total // (warmup + 1 + breakdown)))
        per = total // windows - warmup - breakdown
        kinds = {}
        for w in range(windows):
            s = w * (total // windows)
            # the last window also takes the remainder of the division
            timed = per + (total - windows * (total // windows) if w == windows - 1 else 0)
            kinds.update({s + i: "warm" for i in range(warmup)})
            kinds.update({s + warmup + i: "timed" for i in range(timed)})
            kinds.update({s + warmup + timed + i: "breakdown" for i in range(breakdown)})
        return kinds
    windows = max(1, min(windows, steps))
    per = math.ceil(steps / windows)
    block = warmup + per + breakdown
    if total <= windows * block:
        starts, windows = [0], 1
        per = max(1, min(steps, total - warmup - breakdown))
        block = warmup + per + breakdown
    else:
        starts = np.linspace(0, total - block, windows).round().astype(int).tolist()
    kinds = {}
    for s in starts:
        kinds.update({s + i: "warm" for i in range(warmup)})
        kinds.update({s + warmup + i: "timed" for i in range(per)})
        kinds.update({s + warmup + per + i: "breakdown" for i in range(breakdown)})
    return kinds


class _Clock:
    """CUDA events on a GPU, host timestamps on a CPU; ``elapsed`` in milliseconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _sleep_cycles(device: torch.device, ms: float) -> int:
    """GPU clock cycles ``torch.cuda._sleep`` needs to idle about ``ms`` milliseconds."""
    if device.type != "cuda" or not hasattr(torch.cuda, "_sleep"):
        return 0
    clock, cycles = _Clock(device), 10_000_000
    torch.cuda._sleep(1000)
    a = clock.mark()
    torch.cuda._sleep(cycles)
    b = clock.mark()
    clock.sync()
    return int(cycles * ms / max(clock.elapsed(a, b), 1e-3))


def bench_workload(model, name: str, strategy: str, *, steps: int | None = None, windows: int = 10,
                   breakdown_steps: int = 2, warmup_steps: int = 1, seed: int = 0, sleep_ms: float = 60.0,
                   **engine_kw) -> dict:
    """Benchmark one workload (a :data:`BENCH_WORKLOADS` name or a :data:`WORKLOADS` name) with one
    strategy; see the module docstring (``steps`` None, the default: time every step, cut into
    ``windows`` windows, :func:`_schedule`).
    Returns a JSON-able dict of latencies (ms)."""
    # free the previous run's engine (its KV pool and graph memory pools sit in reference
    # cycles), so that every run starts from the same device memory (``reserved_gib_at_start``)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine = TreeEngine(model, strategy=strategy, **engine_kw)
    reserved = torch.cuda.memory_reserved(engine.device) if engine.device.type == "cuda" else 0
    ctl, total = build_workload(_spec(name, model.config.vocab_size, seed))
    kinds = _schedule(total, steps, windows, breakdown_steps, max(1, int(warmup_steps)))
    clock = _Clock(engine.device)
    cycles = _sleep_cycles(engine.device, sleep_ms)
    marks, parts, state, begins = [], [], {}, {}

    def hook(event, layer):
        if state.get("kind") == "breakdown":
            state.setdefault("ev", []).append((event, clock.mark()))
        elif event == "forward_begin" and state.get("kind") in ("warm", "timed") and state["step"] not in begins:
            begins[state["step"]] = clock.mark()  # once the host has planned and issued the KV work

    def schedule(step):
        kind = kinds.get(step)
        state.clear()
        state["kind"], state["step"] = kind, step
        if kind == "breakdown":
            clock.sync()
            state["t0"] = time.perf_counter()
            if cycles:
                torch.cuda._sleep(cycles)
            state["begin"] = clock.mark()
        return kind is not None

    def on_step(done, stats):
        step, kind = done - 1, state.get("kind")
        if kind in ("warm", "timed"):
            marks.append((step, kind, clock.mark()))
        elif kind == "breakdown":
            end = clock.mark()
            host_ms = (time.perf_counter() - state["t0"]) * 1e3
            clock.sync()
            ev = state.get("ev", [])
            opens = [e for n, e in ev if n == "attn_begin"]
            closes = [e for n, e in ev if n == "attn_end"]
            parts.append({
                "gpu_step": clock.elapsed(state["begin"], end),
                "attention": sum(clock.elapsed(a, b) for a, b in zip(opens, closes)),
                "host_enqueue": host_ms,
                "pure": not cycles or host_ms < sleep_ms})

    engine.precompile_kernels()  # no timed step waits for Triton's JIT (a no-op once the engine compiled)
    compiled, precompile_s = engine.compiled_launches, engine.compile_s
    engine.prepare_graphs(ctl.query_counts())
    engine.hook = hook
    t_start = time.perf_counter()
    engine.run(ctl, max_steps=total, schedule=schedule, on_step=on_step)
    clock.sync()
    wall_s = time.perf_counter() - t_start
    iters, lat, idle = [], [], []
    for (_, _, prev), (step, kind, ev) in zip(marks, marks[1:]):
        if kind == "timed":
            iters.append(step)
            lat.append(clock.elapsed(prev, ev))
            idle.append(max(0.0, clock.elapsed(prev, begins[step])) if step in begins else 0.0)
    computed = [s for s in engine.stats if s.computed]
    host = {k: float(np.mean([getattr(s, k) for s in computed])) if computed else 0.0
            for k in ("kv_ms", "plan_ms", "forward_ms")}
    used = {}
    for s in computed:
        used[s.strategy] = used.get(s.strategy, 0) + 1
    graphs = engine.graphs is not None and not engine.graphs.disabled
    engine.reset()
    engine.pool.check()
    leaked = engine.pool.num_pages - engine.pool.num_free_pages
    # steps that paid a one-time cost (Triton JIT compile, allocator growth) are > 4x the median
    keep = [x <= 4 * np.median(lat) for x in lat] if lat else []
    kept = [x for x, k in zip(lat, keep) if k]
    kept_idle = [x for x, k in zip(idle, keep) if k]
    mean = float(np.mean(kept)) if kept else float("nan")
    gpu = float(np.median([p["gpu_step"] for p in parts])) if parts else float("nan")   # robust to
    attn = float(np.median([p["attention"] for p in parts])) if parts else float("nan")  # JIT stalls
    out = {
        "strategy": strategy, "total_iterations": total, "iterations": iters, "step_ms": lat,
        "mean_step_ms": mean, "median_step_ms": float(np.median(lat)) if lat else float("nan"),
        "mean_step_ms_all": float(np.mean(lat)) if lat else float("nan"), "outliers": len(lat) - len(kept),
        "gpu_step_ms": gpu,
        "breakdown_ms": {"attention": attn, "kv_management": host["kv_ms"], "plan": host["plan_ms"],
                         "rest": gpu - attn},
        "host_ms": {"kv_management": host["kv_ms"], "plan": host["plan_ms"],
                    "forward_enqueue": host["forward_ms"]},
        "host_overhead": float(np.sum(kept_idle) / np.sum(kept)) if kept else float("nan"),
        "idle_ms": float(np.mean(kept_idle)) if kept else float("nan"),
        "busy_step_ms": float(np.mean(np.subtract(kept, kept_idle))) if kept else float("nan"),
        "isolated_gap": (mean - gpu) / mean if lat and parts else float("nan"),
        "breakdown_pure": all(p["pure"] for p in parts),
        "strategies_used": used, "cuda_graphs": graphs,
        "graph_max_diff": engine.graphs.max_diff if engine.graphs is not None else None,
        "leaked_pages": int(leaked), "wall_s": wall_s, "precompile_s": precompile_s,
        "precompile_launches": compiled, "reserved_gib_at_start": reserved / 2**30,
    }
    del engine
    return out


def bench_e2e(model, workloads=BENCH_WORKLOADS, strategies=("auto", "sequence"), *, progress=None,
              **kw) -> dict:
    """:func:`bench_workload` for every workload and strategy; speedups of the first strategy over
    the last one (``sequence``) against DeFT's. ``progress(name, strategy, result)`` after each run."""
    out = {"workloads": {}}
    for name in workloads:
        runs = {}
        for strategy in strategies:
            runs[strategy] = bench_workload(model, name, strategy, **kw)
            if progress is not None:
                progress(name, strategy, runs[strategy])
        first, base = runs[strategies[0]], runs[strategies[-1]]
        speedup = base["mean_step_ms"] / first["mean_step_ms"]
        target = DEFT_DECODING_SPEEDUP.get(name)
        out["workloads"][name] = {
            "strategies": runs, "speedup": speedup,
            "gpu_speedup": base["gpu_step_ms"] / first["gpu_step_ms"],
            "deft_speedup": target, "target_met": None if target is None else bool(speedup >= target),
            "host_overhead_ok": all(r["host_overhead"] <= 0.05 for r in runs.values()),
        }
    return out


def plot_e2e(result: dict, path) -> None:
    """PNG: breakdown bars (attention / KV management / planning / rest, and the measured step
    latency) per workload and strategy, and the per-iteration latency curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    strategies = list(next(iter(result["workloads"].values()))["strategies"]) if names else []
    cols = 4
    rows = 1 + math.ceil(len(names) / cols)
    fig = plt.figure(figsize=(4 * cols, 3.2 * rows))
    grid = fig.add_gridspec(rows, cols)
    ax = fig.add_subplot(grid[0, :])
    width = 0.8 / max(1, len(strategies))
    colors = {"attention": "tab:red", "kv_management": "tab:blue", "plan": "tab:purple", "rest": "tab:gray"}
    for j, s in enumerate(strategies):
        x = np.arange(len(names)) + j * width
        bottom = np.zeros(len(names))
        for part, color in colors.items():
            vals = np.array([result["workloads"][n]["strategies"][s]["breakdown_ms"][part] for n in names])
            ax.bar(x, vals, width, bottom=bottom, color=color, alpha=0.9 if j == 0 else 0.5,
                   label=f"{part} ({s})")
            bottom += vals
        ax.scatter(x, [result["workloads"][n]["strategies"][s]["mean_step_ms"] for n in names],
                   color="black", marker="_" if j else "x", zorder=3, label=f"step latency ({s})")
    ax.set_xticks(np.arange(len(names)) + width * (len(strategies) - 1) / 2)
    ax.set_xticklabels([f"{n}\n{result['workloads'][n]['speedup']:.2f}x" for n in names], fontsize=7)
    ax.set_ylabel("ms / decode step")
    ax.legend(fontsize=6, ncol=4)
    for i, n in enumerate(names):
        a = fig.add_subplot(grid[1 + i // cols, i % cols])
        runs = [result["workloads"][n]["strategies"][s] for s in strategies]
        for s, r in zip(strategies, runs):
            a.plot(r["iterations"], r["step_ms"], ".", markersize=3 if len(r["step_ms"]) < 500 else 1, label=s)
        lat = np.concatenate([r["step_ms"] for r in runs]) if runs else np.zeros(0)
        if lat.size:
            # a few one-off stalls (allocator growth, JIT) would flatten the curves: clip them
            lo, hi = np.percentile(lat, [0, 99.5])
            a.set_ylim(lo * 0.97, hi * 1.05)
            n_out = int((lat > hi * 1.05).sum())
            if n_out:
                a.text(0.99, 0.01, f"{n_out} above", transform=a.transAxes, ha="right", va="bottom", fontsize=6)
        a.set_title(n, fontsize=8)
        a.set_xlabel("iteration", fontsize=7)
        a.set_ylabel("ms", fontsize=7)
        a.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
