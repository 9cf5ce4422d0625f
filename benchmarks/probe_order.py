"""Probe: the order of a plan's launches under CUDA-graph replay with side streams.

The plan builder orders launches by tile shape, shortest query tile first, so the first launch
(on the main stream, dispatched first) is usually the thousands of memory-bound leaf programs and
the tall, compute-heavy programs over shared prefixes start only when SMs drain: on the >= 100K-token
trees at 32/8 and 64/8 those programs run alone at the end (e.g. `1,8,512_32,2048,256`: 128 tall
programs of 2048 tokens, ~50 us, beside ~130 us of leaf traffic; 239 us against a 143 us roofline).
This times every strategy's plan with its launches as built, reversed, and by the cost model's
longest program first, checking every output against the first.

    python benchmarks/probe_order.py [--heads 32/32,32/8,64/8] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import numpy as np
import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import copy_bandwidth, graph_us, provenance, roofline_us
from treeattn.plan import PLANNERS, CostModel
from treeattn.workloads import suite_trees, tree_from_spec


def longest_program_s(plan, launch, cost: CostModel) -> float:
    """The cost model's time of the launch's longest program on its own (at the rates of the
    tall-first rule, which were the fitted rates when this probe ran)."""
    start = plan.host.work_kv_start[launch.work_start:launch.work_end]
    end = plan.host.work_kv_end[launch.work_start:launch.work_end]
    tiles = int(np.max(-(-(end - start) // launch.block_n)))
    return cost.program_s(launch.block_m, launch.block_n, tiles, plan.heads, tall_first=True)


def orders(plan, cost: CostModel) -> dict:
    lns = plan.launches
    longest = sorted(lns, key=lambda ln: -longest_program_s(plan, ln, cost))
    return {"built": plan, "reversed": dataclasses.replace(plan, launches=tuple(reversed(lns))),
            "longest": dataclasses.replace(plan, launches=tuple(longest))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    res = {**provenance(), "rows": []}
    bw = copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    cost = CostModel()
    t0 = time.time()
    for spec in suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in heads:
            q, k, v, out = case_inputs(tree, hq, hkv)
            row = {"tree": spec, "hq": hq, "hkv": hkv,
                   "roofline_us": roofline_us(tree.num_tokens, tree.num_queries, hq, hkv, HEAD_DIM, bw),
                   "us": {}, "err": {}, "launches": {}}
            w = TreeAttention(device="cuda", streams=3)
            row["auto"] = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM).strategy
            for s in PLANNERS:
                plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, strategy=s)
                row["launches"][s] = [(ln.block_m, ln.block_n, ln.work_end - ln.work_start,
                                       longest_program_s(plan, ln, cost) * 1e6) for ln in plan.launches]
                if len(plan.launches) < 2:
                    continue
                us, err, ref = {}, {}, None
                for name, p in orders(plan, cost).items():
                    us[name] = graph_us(lambda: w.run(q, k, v, p, out=out))
                    got = out.float()
                    if ref is None:
                        ref, scale = got.clone(), float(got.abs().max())
                    err[name] = float((got - ref).abs().max()) / scale
                row["us"][s], row["err"][s] = us, err
            res["rows"].append(row)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
            best = {n: min(u[n] for u in row["us"].values()) for n in ("built", "reversed", "longest")} \
                if row["us"] else {}
            a = row["us"].get(row["auto"], {})
            print(f"{spec[:40]:40s} {hq}/{hkv} roof={row['roofline_us']:.1f} auto={row['auto']:10s} "
                  + " ".join(f"{n}={x:.1f}" for n, x in a.items()) + " | best "
                  + " ".join(f"{n}={x:.1f}" for n, x in best.items())
                  + (" BAD" if any(not e < 1e-2 for er in row["err"].values() for e in er.values()) else "")
                  + f" [{time.time() - t0:.0f}s]", flush=True)
            torch.cuda.empty_cache()
    summary = {}
    for hq, hkv in heads:
        rows = [r for r in res["rows"] if (r["hq"], r["hkv"]) == (hq, hkv)]
        for s in PLANNERS:
            for n in ("reversed", "longest"):
                ratios = [r["us"][s]["built"] / r["us"][s][n] for r in rows if s in r["us"]]
                if ratios:
                    summary[f"{hq}/{hkv} {s} {n}"] = (math.exp(sum(map(math.log, ratios)) / len(ratios)),
                                                      min(ratios), max(ratios), len(ratios))
    res["geomean_speedup_over_built"] = summary
    for kk, x in summary.items():
        print(f"{kk:28s} geomean {x[0]:.3f} min {x[1]:.3f} max {x[2]:.3f} n={x[3]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
