"""Probe: why back-to-back decode steps were slower than isolated ones, more so later in a process.

Session 16 measured speculative t=32 (``auto``) at 5.88 ms a step when it ran first in a process and
6.71 ms after three other workloads, with the same isolated GPU time (5.80 ms) in both places:
the GPU has the work queued (the host runs several steps ahead) but leaves gaps between its
operations. This runs ``bench e2e``'s measurement (:func:`bench_workload`) in one process: two
aging workloads first (few-shot b=50, ToT keyword), then for speculative t=32 ``sequence`` and ToT
sorting ``auto`` and ``sequence``:

* ``engine``: the engine as it is (a timing event after every attention-graph replay, e7bdb2a);
* ``no barrier``: without that event (as before e7bdb2a), twice (drift control);
* ``no barrier, timed``: instead CUDA events (with timing) around every forward pass and every
  layer's attention, which also report where the time goes (``timeline``);
* ``no barrier, <what> every <k>``: after every ``k``-th layer's attention (0: only around the
  forward pass) a plain ``event``, a ``timing`` event, a one-cycle ``kernel`` or an 8 us ``host``
  busy wait.

With ``--placement``: the engine against the engine with a timing event also before every
attention replay (after the decode graph), and against that event alone.

Earlier versions (see ``benchmarks/NOTES.md``, session 17, and the commits in the result files)
also held the host to one step ahead, ran attention eagerly and emptied torch's pinned-memory cache.

Usage (H200)::

    python benchmarks/probe_late_gaps.py --out benchmarks/results/h200_probe_late_gaps.json
"""
from __future__ import annotations

import argparse
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
def no_barrier(on: bool):
    """Replay the attention graph without the timing event the engine records after it (the engine
    before e7bdb2a)."""
    if not on:
        yield
        return
    original = graphs_mod.AttentionGraph.replay
    graphs_mod.AttentionGraph.replay = lambda self, graph: graph.replay()
    try:
        yield
    finally:
        graphs_mod.AttentionGraph.replay = original


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
def between_layers(every: int | None, what: str = "event", where: str = "attn_end"):
    """After every ``every``-th layer's attention (``where="attn_begin"``: before it, after the
    decode graph; ``every=0``: at ``forward_begin`` and ``forward_end`` only; None: never) do
    ``what``: record a plain CUDA ``event`` or a ``timing`` one, launch a one-cycle ``kernel``
    (``torch.cuda._sleep(1)``), or busy-wait 8 us on the ``host``."""
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
                else event == where and layer % every == every - 1):
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
    ap.add_argument("--placement", action="store_true",
                    help="instead: the engine's barrier against one before each attention replay too")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    model = TreeModel.random(args.random_weights, device="cuda", dtype=torch.bfloat16)
    runs = []

    def one(label, workload, strategy, *, timed=False, barrier=True, every=None, what="event", where="attn_end"):
        t0 = time.perf_counter()
        extra = {}
        with no_barrier(not barrier), timeline(timed, extra), between_layers(every, what, where):
            r = bench_workload(model, workload, strategy, steps=args.steps, windows=args.windows)
        row = {"label": label, "workload": workload, "strategy": strategy, **{k: r[k] for k in KEYS}, **extra}
        row["probe_s"] = time.perf_counter() - t0
        runs.append(row)
        t = extra.get("timeline")
        print(f"{label:28s} {workload:16s} {strategy:9s} step {r['mean_step_ms']:.3f} ms  gpu "
              f"{r['gpu_step_ms']:.3f}  gap {r['isolated_gap']:.1%}  ({row['probe_s']:.0f} s)"
              + ("".join(f"  {k}: fwd {v['forward']} = attn {v['attention']} + rest {v['rest']}, between {v['between']}"
                         for k, v in t.items()) if t else ""), flush=True)

    for w in ("fewshot-50", "tot-keyword"):
        one("aging", w, "auto")
    if args.placement:
        for w, strategy in (("tot-sorting", "auto"), ("tot-sorting", "sequence"), ("tot-keyword", "auto"),
                            ("speculative-64", "auto")):
            one("engine", w, strategy)
            one("engine + timing before attention", w, strategy, every=1, what="timing", where="attn_begin")
            one("no barrier, timing before attention", w, strategy, barrier=False, every=1, what="timing",
                where="attn_begin")
            one("engine, timed", w, strategy, timed=True)
            one("engine", w, strategy)
    else:
        for w, strategy in (("speculative-32", "sequence"), ("tot-sorting", "auto"), ("tot-sorting", "sequence")):
            one("engine", w, strategy)
            one("no barrier", w, strategy, barrier=False)
            one("no barrier, timed", w, strategy, barrier=False, timed=True)
            for what, every in (("timing", 1), ("timing", 0), ("kernel", 1), ("event", 1), ("host", 1)):
                one(f"no barrier, {what} every {every}", w, strategy, barrier=False, every=every, what=what)
            one("no barrier", w, strategy, barrier=False)
            one("engine", w, strategy)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "steps": args.steps, "windows": args.windows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
