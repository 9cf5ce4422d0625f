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

Runs marked ``timed`` record CUDA events around every forward pass and every layer's attention,
so that the extra back-to-back time can be placed: inside the forward (attention or the rest) or
between two steps' forwards.

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
def timeline(on: bool, out: dict):
    """Record CUDA events at every model step's ``forward_begin``, ``attn_begin``, ``attn_end`` and
    ``forward_end`` and put :func:`summarize_timeline` into ``out["timeline"]`` (events, not
    ``torch.profiler``: profiling the engine's per-step graph captures takes minutes)."""
    if not on:
        yield
        return
    marks = []
    original = TreeEngine._fire

    def fire(self, event, layer=-1):
        original(self, event, layer)
        if event in ("forward_begin", "attn_begin", "attn_end", "forward_end"):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append((event, ev))

    TreeEngine._fire = fire
    try:
        yield
    finally:
        TreeEngine._fire = original
    torch.cuda.synchronize()
    out["timeline"] = summarize_timeline(marks)


@contextlib.contextmanager
def between_layers(every: int | None, what: str = "event"):
    """After every ``every``-th layer's attention (``0``: at ``forward_begin`` and ``forward_end``
    only; None: never) do ``what``: record a plain CUDA ``event`` or a ``timing`` one, launch a
    one-cycle ``kernel`` (``torch.cuda._sleep(1)``), or busy-wait 8 us on the ``host``."""
    if every is None:
        yield
        return
    original = TreeEngine._fire

    def act():
        if what == "event":
            torch.cuda.Event().record()
        elif what == "timing":
            torch.cuda.Event(enable_timing=True).record()
        elif what == "kernel":
            torch.cuda._sleep(1)
        else:
            end = time.perf_counter() + 8e-6
            while time.perf_counter() < end:
                pass

    def fire(self, event, layer=-1):
        original(self, event, layer)
        if (event in ("forward_begin", "forward_end") if every == 0
                else event == "attn_end" and layer % every == every - 1):
            act()

    TreeEngine._fire = fire
    try:
        yield
    finally:
        TreeEngine._fire = original


def summarize_timeline(marks: list) -> dict:
    """Mean milliseconds per model step: the forward pass's span, its attention (summed over
    layers) and the rest, and the time from the previous step's forward end (``between``). Steps
    whose forward began more than 20 ms after the previous one ended (breakdown steps after their
    sleep, first steps of a window) are ``isolated``; the others ``back_to_back``."""
    steps, cur = [], None
    for name, ev in marks:
        if name == "forward_begin":
            cur = {"begin": ev, "attn": []}
        elif name == "attn_begin" and cur is not None:
            cur["attn"].append([ev, None])
        elif name == "attn_end" and cur is not None and cur["attn"]:
            cur["attn"][-1][1] = ev
        elif name == "forward_end" and cur is not None:
            cur["end"] = ev
            steps.append(cur)
            cur = None
    rows = {"back_to_back": [], "isolated": []}
    for prev, st in zip([None] + steps, steps):
        span = st["begin"].elapsed_time(st["end"])
        attn = sum(a.elapsed_time(b) for a, b in st["attn"] if b is not None)
        between = prev["end"].elapsed_time(st["begin"]) if prev is not None else float("inf")
        kind = "isolated" if between > 20.0 else "back_to_back"
        rows[kind].append({"forward": span, "attention": attn, "rest": span - attn,
                           "between": between if kind == "back_to_back" else float("nan")})

    def mean(rs, key):
        vals = [r[key] for r in rs if r[key] == r[key]]
        return round(sum(vals) / len(vals), 4) if vals else None
    return {kind: {"steps": len(rs), **{k: mean(rs, k) for k in ("forward", "attention", "rest", "between")}}
            for kind, rs in rows.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random-weights", default="llama3-8b")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    model = TreeModel.random(args.random_weights, device="cuda", dtype=torch.bfloat16)
    runs = []

    def one(label, workload, strategy, *, timed=False, limit=None, eager=False, every=None, what="event"):
        t0 = time.perf_counter()
        extra = {}
        with ahead(limit), eager_attention(eager), timeline(timed, extra), between_layers(every, what):
            r = bench_workload(model, workload, strategy, steps=args.steps, windows=args.windows)
        row = {"label": label, "workload": workload, "strategy": strategy, **{k: r[k] for k in KEYS}, **extra}
        row["probe_s"] = time.perf_counter() - t0
        runs.append(row)
        t = extra.get("timeline")
        print(f"{label:28s} {workload:16s} {strategy:9s} step {r['mean_step_ms']:.3f} ms  gpu "
              f"{r['gpu_step_ms']:.3f}  gap {r['isolated_gap']:.1%}  ({row['probe_s']:.0f} s)"
              + ("".join(f"  {k}: fwd {v['forward']} = attn {v['attention']} + rest {v['rest']}, between {v['between']}"
                         for k, v in t.items()) if t else ""), flush=True)

    for w, strategy in (("speculative-32", "sequence"), ("tot-sorting", "auto")):
        one("plain", w, strategy)
        for what, every in (("timing", 1), ("timing", 4), ("timing", 0), ("kernel", 1), ("host", 1),
                            ("event", 1)):
            one(f"{what} every {every}", w, strategy, every=every, what=what)
        one("plain", w, strategy)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "steps": args.steps, "windows": args.windows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
