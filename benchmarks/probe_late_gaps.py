"""Probe: why back-to-back decode steps get slower later in a process.

Session 16 measured speculative t=32 (``auto``) at 5.88 ms a step when it ran first in a process and
6.71 ms after three other workloads, with the same isolated GPU time (5.80 ms) in both places:
the GPU has the work queued (the host runs several steps ahead) but leaves gaps between its
operations. This runs, in one process, ``bench e2e``'s measurement (:func:`bench_workload`) of:

1. speculative-32 ``auto`` and ``sequence`` first;
2. the aging workloads of that measurement (few-shot b=50, ToT sorting and keyword, ``auto``);
3. speculative-32 ``auto`` again (profiled), then variants that each remove one suspect:
   ``ahead1``: the host waits until the GPU has started the previous step before issuing the next
   (at most one step queued ahead); ``eager_attention``: no per-step attention graph (each layer's
   attention launched eagerly); ``host_empty``: torch's pinned-memory cache emptied first; and
   a plain repeat (drift control);
4. ToT sorting ``auto`` and ``sequence`` with and without ``ahead1``.

Profiled runs report the CUDA runtime calls (count, total and longest host time) and the GPU's gaps
between consecutive operations (2 us to 1 ms), summed by the pair of operations around them.

Usage (H200)::

    python benchmarks/probe_late_gaps.py --out benchmarks/results/h200_probe_late_gaps.json
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from treeattn.bench.timing import provenance
from treeattn.engine import graphs as graphs_mod
from treeattn.engine.bench import bench_workload
from treeattn.engine.engine import TreeEngine
from treeattn.engine.model import TreeModel

KEYS = ("mean_step_ms", "median_step_ms", "gpu_step_ms", "isolated_gap", "idle_ms", "host_ms",
        "breakdown_ms", "strategies_used", "wall_s")


@contextlib.contextmanager
def ahead(limit: int | None):
    """Make :meth:`TreeEngine.run` keep the host at most ``limit`` steps ahead of the GPU."""
    if limit is None:
        yield
        return
    original = TreeEngine.run

    def run(self, controller, *, max_steps=None, on_step=None, schedule=None):
        queued = collections.deque()

        def throttled(step):
            go = schedule(step) if schedule is not None else True
            if go:
                ev = torch.cuda.Event()
                ev.record()  # the end of everything issued so far
                queued.append(ev)
                if len(queued) > limit:
                    queued.popleft().synchronize()
            return go
        return original(self, controller, max_steps=max_steps, on_step=on_step, schedule=throttled)

    TreeEngine.run = run
    try:
        yield
    finally:
        TreeEngine.run = original


@contextlib.contextmanager
def eager_attention(on: bool):
    """Make the engine's per-step attention-graph capture fail, so attention runs eagerly."""
    if not on:
        yield
        return
    original = graphs_mod.AttentionGraph.capture

    def capture(self, *a, **k):
        raise RuntimeError("disabled by probe_late_gaps")
    graphs_mod.AttentionGraph.capture = capture
    try:
        yield
    finally:
        graphs_mod.AttentionGraph.capture = original


@contextlib.contextmanager
def profiled(on: bool, out: dict):
    """Profile (CUDA activity only) from a run's first model step to its end, with a marker kernel
    (a ``torch.cuda._sleep(1)`` spin) enqueued at every ``forward_begin`` and ``forward_end``, and
    put :func:`summarize_profile` into ``out["profile"]``."""
    if not on:
        yield
        return
    prof = profile(activities=[ProfilerActivity.CUDA])
    original_run, original_fire = TreeEngine.run, TreeEngine._fire

    def fire(self, event, layer=-1):
        original_fire(self, event, layer)
        if event in ("forward_begin", "forward_end"):
            torch.cuda._sleep(1)

    def run(self, controller, *, max_steps=None, on_step=None, schedule=None):
        started = []

        def start(step):
            go = schedule(step) if schedule is not None else True
            if go and not started:
                prof.start()
                started.append(step)
            return go
        try:
            return original_run(self, controller, max_steps=max_steps, on_step=on_step, schedule=start)
        finally:
            torch.cuda.synchronize()
            if started:
                prof.stop()

    TreeEngine.run, TreeEngine._fire = run, fire
    try:
        yield
    finally:
        TreeEngine.run, TreeEngine._fire = original_run, original_fire
    out["profile"] = summarize_profile(prof)


def summarize_profile(prof) -> dict:
    """The GPU timeline cut at the marker kernels, in microseconds: per forward pass (begin to end
    marker) its span, busy time and gaps (summed by the operations around them), back to back
    (``inside``) or after a wait (``isolated``: breakdown steps, first steps of a window), and
    between the end of one forward and the begin of the next (``between``, consecutive steps)."""
    ops = sorted((e.time_range.start, e.time_range.end, e.name[:48]) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    marks = [i for i, (s, e, n) in enumerate(ops) if ("spin" in n or "sleep" in n) and e - s < 20.0]
    rows = {"inside": [], "isolated": [], "between": []}
    gaps = {k: collections.defaultdict(lambda: [0, 0.0]) for k in rows}
    after_wait = True
    # markers alternate forward_begin, forward_end; a begin more than 20 ms after the previous end
    # waited for a breakdown step's sleep or for fast-forwarded steps: its forward counts as isolated
    for j, (a, b) in enumerate(zip(marks, marks[1:])):
        seg = ops[a: b + 1]
        span = seg[-1][0] - seg[0][1]
        if j % 2:
            if span > 20_000:
                after_wait = True
                continue
            kind = "between"
        else:
            kind, after_wait = ("isolated" if after_wait else "inside"), False
        gap_sum = 0.0
        for (s0, e0, n0), (s1, e1, n1) in zip(seg, seg[1:]):
            gap = max(0.0, s1 - e0)
            gap_sum += gap
            if gap > 1.0:
                g = gaps[kind][f"{n0} -> {n1}"]
                g[0] += 1
                g[1] += gap
        rows[kind].append({"span_us": span, "busy_us": sum(e - s for s, e, _ in seg[1:-1]), "gap_us": gap_sum,
                           "ops": len(seg) - 2})

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows) if rows else float("nan")
    return {
        **{f"{kind}_{k}": mean(r, k) for kind, r in rows.items() for k in ("span_us", "busy_us", "gap_us", "ops")},
        **{f"{kind}_count": len(r) for kind, r in rows.items()},
        **{f"top_gaps_{kind}": sorted(([k, v[0], round(v[1], 1)] for k, v in g.items()), key=lambda r: -r[2])[:12]
           for kind, g in gaps.items()},
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random-weights", default="llama3-8b")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    model = TreeModel.random(args.random_weights, device="cuda", dtype=torch.bfloat16)
    runs = []

    def one(label, workload, strategy, *, profile_it=False, limit=None, eager=False):
        t0 = time.perf_counter()
        extra = {}
        with ahead(limit), eager_attention(eager), profiled(profile_it, extra):
            r = bench_workload(model, workload, strategy, steps=args.steps, windows=args.windows)
        row = {"label": label, "workload": workload, "strategy": strategy, **{k: r[k] for k in KEYS}, **extra}
        row["probe_s"] = time.perf_counter() - t0
        runs.append(row)
        p = extra.get("profile", {})
        print(f"{label:28s} {workload:16s} {strategy:9s} step {r['mean_step_ms']:.3f} ms  gpu "
              f"{r['gpu_step_ms']:.3f}  gap {r['isolated_gap']:.1%}  ({row['probe_s']:.0f} s)"
              + "".join(f"  {k} span/busy/gaps {p[k + '_span_us']:.0f}/{p[k + '_busy_us']:.0f}/{p[k + '_gap_us']:.0f}"
                        for k in ("inside", "isolated", "between") if p), flush=True)

    empty_host_cache = getattr(torch._C, "_host_emptyCache", None) or getattr(torch._C, "_accelerator_emptyHostCache")
    spec = "speculative-32"
    one("first", spec, "auto", profile_it=True)
    one("first", spec, "sequence", profile_it=True)
    for w in ("fewshot-50", "tot-sorting", "tot-keyword"):
        one("aging", w, "auto")
    one("late", spec, "auto", profile_it=True)
    one("late", spec, "sequence", profile_it=True)
    empty_host_cache()
    one("late host_empty", spec, "auto", profile_it=True)
    one("late repeat", spec, "auto")
    empty_host_cache()
    one("late host_empty", spec, "auto")
    empty_host_cache()
    one("late host_empty", spec, "sequence")
    for s in ("auto", "sequence"):
        one("late", "tot-sorting", s, profile_it=True)
        empty_host_cache()
        one("late host_empty", "tot-sorting", s)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "steps": args.steps, "windows": args.windows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
