"""Probe: what affine KV addressing (``Launch.contig``) is worth, before the planner sets it.

For every kernel-suite case (and a few single-item trees) and a few strategies, plans as usual,
finds the launches whose work units each read one run of consecutive slots (in the suite every
node's slots are consecutive, so node-sized items qualify), and times the plan's CUDA-graph replay
with those launches as they are and with ``contig`` set. Checks that both give the same output.

Usage (H200)::

    python benchmarks/probe_contig.py --out benchmarks/results/h200_probe_contig.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import case_inputs
from treeattn.bench.timing import graph_us
from treeattn.plan.addressing import unit_runs
from treeattn.workloads import suite_trees, tree_from_spec

HEADS = ((32, 32), (32, 8), (64, 8))
EXTRA = ("1_256", "1_1024", "1_4096", "4_1024", "16_4096")


def with_contig(plan):
    h = plan.host
    ok = unit_runs(h.kv_slots, h.work_kv_start, h.work_kv_end)
    launches = tuple(dataclasses.replace(x, contig=bool(ok[x.work_start:x.work_end].all()))
                     for x in plan.launches)
    return dataclasses.replace(plan, launches=launches), sum(x.contig for x in launches)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--strategies", default="auto,node,sequence")
    args = ap.parse_args()
    trees = list(suite_trees("all")) + list(EXTRA)
    rows = []
    for spec in trees:
        tree = tree_from_spec(spec)
        for hq, hkv in HEADS:
            q, k, v, out = case_inputs(tree, hq, hkv)
            for s in args.strategies.split(","):
                w = TreeAttention(device="cuda")
                plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, strategy=s)
                cplan, n = with_contig(plan)
                if n == 0:
                    continue
                w.run(q, k, v, plan, out=out)
                ref = out.clone()
                w.run(q, k, v, cplan, out=out)
                err = (out.float() - ref.float()).abs().max().item()
                base = graph_us(lambda: w.run(q, k, v, plan, out=out))
                new = graph_us(lambda: w.run(q, k, v, cplan, out=out))
                row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy, "asked": s,
                       "launches": len(plan.launches), "contig_launches": n, "gather_us": base,
                       "contig_us": new, "speedup": base / new, "max_diff": err}
                rows.append(row)
                print(f"{spec:48s} {hq}/{hkv} {s:8s}->{plan.strategy:10s} {n}/{len(plan.launches)} "
                      f"{base:8.1f} -> {new:8.1f} us  x{base / new:.3f}  diff {err:.1e}", flush=True)
    by = {}
    for r in rows:
        by.setdefault((r["asked"], f"{r['hq']}/{r['hkv']}"), []).append(r["speedup"])
    summary = {f"{a}@{h}": math.exp(np.mean(np.log(x))) for (a, h), x in sorted(by.items())}
    print(json.dumps(summary, indent=1))
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        with open(args.out, "w") as f:
            json.dump({**meta, "rows": rows, "geomean_speedup": summary}, f, indent=1)


if __name__ == "__main__":
    main()
