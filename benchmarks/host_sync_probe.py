"""Find where an engine workload makes the host wait for the GPU.

Runs ``--steps`` decode steps of each workload under ``torch.cuda.set_sync_debug_mode("warn")``
and counts every synchronising call by its innermost treeattn frame; it times the host loop
(wall clock until the last step is enqueued: far below the GPU's time when the host runs ahead)
and the GPU (events) over those steps, and profiles
the host loop (cProfile, top functions by own time): a wait that PyTorch does not flag (a driver
call that blocks) shows up there.

    python benchmarks/host_sync_probe.py --random-weights llama3-8b --workloads tot-sorting speculative-64
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import json
import time
import traceback
import warnings

import torch

from treeattn.engine.engine import TreeEngine
from treeattn.engine.model import TreeModel
from treeattn.engine.workloads import WorkloadSpec, build_workload


def _site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "treeattn" in f.filename or "benchmarks" in f.filename]
    inner = [f for f in frames if "host_sync_probe" not in f.filename]
    return " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}({f.name})" for f in reversed(inner[-4:]))


def probe(model, name: str, strategy: str, steps: int, skip: int) -> dict:
    engine = TreeEngine(model, strategy=strategy)
    spec = WorkloadSpec("fewshot", vocab_size=model.config.vocab_size, branches=int(name.split("-")[1]),
                        steps=400) if name.startswith("fewshot-") else \
        WorkloadSpec(name, vocab_size=model.config.vocab_size)
    ctl, _ = build_workload(spec)
    engine.precompile_kernels()
    engine.prepare_graphs(ctl.query_counts())
    sites: collections.Counter = collections.Counter()
    marks = []
    prof = cProfile.Profile()
    phase = {"probe": False}

    def show(message, category, filename, lineno, file=None, line=None):
        if phase["probe"]:
            sites[_site()] += 1

    def schedule(step):
        phase["probe"] = step >= skip
        if step == skip:
            torch.cuda.synchronize()
            marks.append((time.perf_counter(), torch.cuda.Event(enable_timing=True)))
            marks[-1][1].record()
            prof.enable()
        return True

    old = warnings.showwarning
    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        def on_step(done, stats):  # the last probed step is enqueued (result() then waits)
            if done == skip + steps:
                prof.disable()
                marks.append((time.perf_counter(), torch.cuda.Event(enable_timing=True)))
                marks[-1][1].record()

        engine.run(ctl, max_steps=skip + steps, schedule=schedule, on_step=on_step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    torch.cuda.synchronize()
    (t0, ev0), (t1, ev1) = marks
    st = engine.stats[-steps:]
    return {"workload": name, "strategy": strategy, "steps": steps,
            "host_ms_per_step": (t1 - t0) * 1e3 / steps,
            "gpu_ms_per_step": ev0.elapsed_time(ev1) / steps,
            "kv_ms": sum(s.kv_ms for s in st) / steps, "plan_ms": sum(s.plan_ms for s in st) / steps,
            "forward_ms": sum(s.forward_ms for s in st) / steps,
            "sync_sites": dict(sites.most_common(12)), "profile": _top(prof, 14)}


def _top(prof: cProfile.Profile, n: int) -> list:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(n)
    return [line for line in buf.getvalue().splitlines() if line.strip()][-n:]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random-weights", default="llama3-8b")
    ap.add_argument("--workloads", nargs="+", default=["tot-sorting", "speculative-64", "fewshot-20"])
    ap.add_argument("--strategies", nargs="+", default=["auto", "sequence"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=10, help="warm-up steps before probing")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    model = TreeModel.random(args.random_weights, device="cuda", dtype=torch.bfloat16)
    rows = []
    for name in args.workloads:
        for strategy in args.strategies:
            r = probe(model, name, strategy, args.steps, args.skip)
            rows.append(r)
            print(json.dumps(r, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
