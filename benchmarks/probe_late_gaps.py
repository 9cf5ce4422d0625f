"""Probe: why back-to-back decode steps get slower later in a process.

Session 16 measured speculative t=32 (``auto``) at 5.88 ms a step when it ran first in a process and
6.71 ms after three other workloads, with the same isolated GPU time (5.80 ms) in both places:
the GPU has the work queued (the host runs several steps ahead) but leaves gaps between its
operations. This runs, in one process, ``bench e2e``'s measurement (:func:`bench_workload`) of:

1. speculative-32 ``auto`` first (under ``torch.profiler``) and ``sequence``;
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


def summarize_profile(prof) -> dict:
    """CUDA runtime calls by name and the GPU's short gaps by the operations around them."""
    api = collections.defaultdict(lambda: [0, 0.0, 0.0])
    gpu = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu.append((e.time_range.start, e.time_range.end, e.name[:50]))
        elif e.name.startswith("cu"):
            us = e.time_range.end - e.time_range.start
            a = api[e.name]
            a[0] += 1
            a[1] += us
            a[2] = max(a[2], us)
    gpu.sort()
    gaps = collections.defaultdict(lambda: [0, 0.0])
    total_gap = busy = 0.0
    for (s0, e0, n0), (s1, e1, n1) in zip(gpu, gpu[1:]):
        gap = s1 - max(e0, s0)
        busy += e1 - s1
        if 2.0 <= gap <= 1000.0:
            g = gaps[f"{n0} -> {n1}"]
            g[0] += 1
            g[1] += gap
            total_gap += gap
    return {
        "gpu_ops": len(gpu), "gpu_busy_ms": busy / 1e3, "gap_2us_1ms_total_ms": total_gap / 1e3,
        "gaps": sorted(([k, v[0], round(v[1] / 1e3, 3)] for k, v in gaps.items()), key=lambda r: -r[2])[:15],
        "api": sorted(([k, v[0], round(v[1] / 1e3, 3), round(v[2], 1)] for k, v in api.items()),
                      key=lambda r: -r[2])[:20],
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

    def one(label, workload, strategy, *, profiled=False, limit=None, eager=False):
        t0 = time.perf_counter()
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if profiled else None
        with ahead(limit), eager_attention(eager), (prof or contextlib.nullcontext()):
            r = bench_workload(model, workload, strategy, steps=args.steps, windows=args.windows)
        row = {"label": label, "workload": workload, "strategy": strategy, **{k: r[k] for k in KEYS}}
        if prof is not None:
            row["profile"] = summarize_profile(prof)
        row["probe_s"] = time.perf_counter() - t0
        row["host_memory"] = {k: v for k, v in torch.cuda.host_memory_stats().items()
                              if not isinstance(v, dict)}
        runs.append(row)
        print(f"{label:28s} {workload:16s} {strategy:9s} step {r['mean_step_ms']:.3f} ms  gpu "
              f"{r['gpu_step_ms']:.3f}  gap {r['isolated_gap']:.1%}  ({row['probe_s']:.0f} s)", flush=True)

    spec = "speculative-32"
    one("first", spec, "auto", profiled=True)
    one("first", spec, "sequence")
    for w in ("fewshot-50", "tot-sorting", "tot-keyword"):
        one("aging", w, "auto")
    one("late", spec, "auto", profiled=True)
    one("late ahead1", spec, "auto", limit=1)
    one("late eager_attention", spec, "auto", eager=True)
    empty = getattr(torch._C, "_host_emptyCache", None) or getattr(torch._C, "_accelerator_emptyHostCache")
    empty()
    one("late host_empty", spec, "auto")
    one("late repeat", spec, "auto")
    one("late", spec, "sequence")
    one("late ahead1", spec, "sequence", limit=1)
    for limit in (None, 1):
        for s in ("auto", "sequence"):
            one(f"late{' ahead1' if limit else ''}", "tot-sorting", s, limit=limit)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "steps": args.steps, "windows": args.windows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
