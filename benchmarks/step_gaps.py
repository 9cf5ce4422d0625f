"""Why back-to-back decode steps are slower than isolated ones on some workloads.

Runs a workload's steps twice under ``torch.profiler`` (CUDA activity): ``--steps`` steps back to
back (the host runs ahead), then as many isolated steps (the host enqueues each behind a GPU
sleep, as ``bench e2e`` does for its breakdown). For each mode it prints the GPU time per step
summed over kernels and memory copies, grouped by name, so that slower kernels and extra
operations show up side by side.

    python benchmarks/step_gaps.py --workload tot-sorting --strategy auto
"""
from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

from treeattn.engine.engine import TreeEngine
from treeattn.engine.model import TreeModel
from treeattn.engine.workloads import WorkloadSpec, build_workload


def _gpu_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def run(model, workload: str, strategy: str, steps: int, skip: int) -> dict:
    engine = TreeEngine(model, strategy=strategy)
    ctl, _ = build_workload(WorkloadSpec(workload, vocab_size=model.config.vocab_size))
    engine.precompile_kernels()
    engine.prepare_graphs(ctl.query_counts())
    mode = {"isolated": False}

    def schedule(step):
        if mode["isolated"]:
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)
        return True

    engine.run(ctl, max_steps=skip, schedule=schedule)  # warm-up, then the profiled steps
    out = {}
    for name in ("back_to_back", "isolated"):
        mode["isolated"] = name == "isolated"
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            for _ in range(steps):
                if not ctl.step(engine, len(engine.stats)):
                    break
                if mode["isolated"]:
                    torch.cuda.synchronize()
            end.record()
            torch.cuda.synchronize()
        by_name = collections.defaultdict(float)
        count = collections.Counter()
        for e in _gpu_events(prof):
            if "sleep" in e.name:  # the isolated steps' wait
                continue
            key = e.name[:60]
            by_name[key] += e.device_time_total / steps / 1e3  # ms per step
            count[key] += 1
        out[name] = {"span_ms_per_step": start.elapsed_time(end) / steps,
                     "gpu_ms_per_step": sum(by_name.values()),
                     "ops_per_step": sum(count.values()) / steps,
                     "top": sorted(((k, round(v, 4), count[k] // steps) for k, v in by_name.items()),
                                   key=lambda x: -x[1])[:16]}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random-weights", default="llama3-8b")
    ap.add_argument("--workload", default="tot-sorting")
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    model = TreeModel.random(args.random_weights, device="cuda", dtype=torch.bfloat16)
    res = run(model, args.workload, args.strategy, args.steps, args.skip)
    for mode, r in res.items():
        print(f"{mode}: span {r['span_ms_per_step']:.2f} ms/step (isolated includes the sleep), GPU ops "
              f"{r['gpu_ms_per_step']:.2f} ms/step in {r['ops_per_step']:.0f} ops")
        for k, v, c in r["top"]:
            print(f"   {v:8.4f} ms  x{c:<4d} {k}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
