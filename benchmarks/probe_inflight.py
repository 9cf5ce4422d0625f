"""Are back-to-back decode steps slower because the host queues many steps ahead of the GPU?

`bench e2e --steps all` (fc4f55b) shows each window's steps start at ~5.4 ms after the breakdown
steps' synchronisations and climb to ~6.1 ms within 10-20 steps (ToT sorting, both strategies),
against 5.5 ms of isolated GPU time; the same GEMMs alone stay at one time back to back at full
clocks (probe_clocks.py). The host enqueues a step in ~2-3 ms of a ~6 ms step, so it runs further
and further ahead. This runs `bench e2e`'s measurement (same model, workloads, windows) with the
engine's ``max_inflight`` bound on the queued forward passes, and without it. Prints and writes
JSON."""
from __future__ import annotations

import argparse
import json

import torch

from treeattn.bench.timing import provenance
from treeattn.engine.bench import bench_workload
from treeattn.engine.model import TreeModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="tot-sorting,speculative-64")
    ap.add_argument("--strategies", default="auto,sequence")
    ap.add_argument("--bounds", default="none,2,3", help="max_inflight values ('none': unbounded)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the bounds (alternating)")
    ap.add_argument("--out")
    args = ap.parse_args()
    model = TreeModel.random("llama3-8b", device=torch.device("cuda"), dtype=torch.bfloat16, seed=0)
    bounds = [None if b == "none" else int(b) for b in args.bounds.split(",")]
    rows = []
    for name in args.workloads.split(","):
        for strategy in args.strategies.split(","):
            for rep in range(args.repeats):
                for bound in bounds:
                    r = bench_workload(model, name, strategy, steps=args.steps, windows=args.windows,
                                       max_inflight=bound)
                    keep = {k: r[k] for k in ("mean_step_ms", "median_step_ms", "gpu_step_ms", "host_overhead",
                                              "idle_ms", "isolated_gap", "iterations", "step_ms")}
                    rows.append({"workload": name, "strategy": strategy, "max_inflight": bound, "repeat": rep,
                                 **keep})
                    print(f"{name:16s} {strategy:9s} max_inflight={bound!s:4s} step {r['mean_step_ms']:.3f} ms "
                          f"gpu {r['gpu_step_ms']:.3f} idle {r['idle_ms']:.3f} host {r['host_overhead']:.1%} "
                          f"gap {r['isolated_gap']:.1%}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "steps": args.steps, "windows": args.windows, "rows": rows}, f)


if __name__ == "__main__":
    main()
