"""Measured ``auto`` (``TreeEngine(tune=True)``) against the cost model's ``auto`` and ``sequence``
over whole workloads, one process (`bench e2e`'s measurement with ``--steps all``).

Session 8 found tuning neutral on `bench e2e`'s short windows, whose trials rarely finished; over a
whole ToT replay (475-5193 steps) every tree shape's trial can finish and pay off. Prints and
writes JSON."""
from __future__ import annotations

import argparse
import json

import torch

from treeattn.bench.timing import provenance
from treeattn.engine.bench import bench_workload
from treeattn.engine.model import TreeModel

RUNS = (("auto", False), ("auto", True), ("sequence", False))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="tot-sorting,tot-set,tot-docmerge,tot-keyword")
    ap.add_argument("--windows", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args()
    model = TreeModel.random("llama3-8b", device=torch.device("cuda"), dtype=torch.bfloat16, seed=0)
    rows = []
    for name in args.workloads.split(","):
        for strategy, tune in RUNS:
            r = bench_workload(model, name, strategy, steps=None, windows=args.windows, tune=tune)
            rows.append({"workload": name, "strategy": strategy, "tune": tune,
                         **{k: r[k] for k in ("mean_step_ms", "gpu_step_ms", "breakdown_ms", "host_overhead",
                                              "isolated_gap", "strategies_used", "tuning", "leaked_pages")}})
            print(f"{name:14s} {strategy:9s} tune={tune!s:5s} step {r['mean_step_ms']:.3f} ms gpu {r['gpu_step_ms']:.3f} "
                  f"attn/layer {r['breakdown_ms']['attention'] / 32 * 1e3:.1f} us host {r['host_overhead']:.1%} "
                  f"used {r['strategies_used']}", flush=True)
        base = rows[-1]["mean_step_ms"]
        print(f"{name}: speedup over sequence {base / rows[-3]['mean_step_ms']:.3f} (model) "
              f"{base / rows[-2]['mean_step_ms']:.3f} (tuned)", flush=True)
        if args.out:  # after every workload, so a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump({**provenance(), "windows": args.windows, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
