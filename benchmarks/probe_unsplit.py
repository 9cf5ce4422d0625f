"""Probe: does splitting long items pay on small trees? Small suite trees are latency-bound (a
merge launch costs 7-14 us, benchmarks/NOTES.md), and every planner splits long items until the
grid has ``CostModel.target_programs`` programs, which forces a merge. This times, under CUDA-graph
replay, ``auto`` and each strategy with its default items and with splitting off
(``CostModel(min_split_tokens=2**30)``), next to the cost model's estimate of each.

Usage (H200)::

    python benchmarks/probe_unsplit.py --out benchmarks/results/h200_probe_unsplit.json
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from probe_contig import HEADS
from treeattn import TreeAttention
from treeattn.bench.kernels import case_inputs
from treeattn.bench.timing import graph_us
from treeattn.plan import PLANNERS, CostModel, HeadConfig
from treeattn.plan.auto import estimate_items
from treeattn.workloads import suite_trees, tree_from_spec

STRATEGIES = ("sequence", "node", "greedy", "pack")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-tokens", type=int, default=60000, help="only trees up to this many tokens")
    args = ap.parse_args()
    models = {"split": CostModel(), "unsplit": CostModel(min_split_tokens=1 << 30)}
    rows = []
    for spec in suite_trees("all"):
        tree = tree_from_spec(spec)
        if int(tree.node_extent.sum()) > args.max_tokens:
            continue
        for hq, hkv in HEADS:
            heads = HeadConfig(hq, hkv, 128)
            q, k, v, out = case_inputs(tree, hq, hkv)
            row = {"tree": spec, "hq": hq, "hkv": hkv, "us": {}, "est_us": {}, "programs": {}}
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128)
            row["auto_choice"] = plan.strategy
            row["us"]["auto"] = graph_us(lambda p=plan: w.run(q, k, v, p, out=out))
            for s in STRATEGIES:
                for tag, cm in models.items():
                    w = TreeAttention(device="cuda", cost=cm)
                    p = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, strategy=s)
                    items, _ = PLANNERS[s](tree, heads, cm)
                    name = f"{s}/{tag}"
                    row["est_us"][name] = estimate_items(tree, items, heads, CostModel())["total"] * 1e6
                    row["programs"][name] = p.num_work * hkv
                    row["us"][name] = graph_us(lambda p=p, w=w: w.run(q, k, v, p, out=out))
            rows.append(row)
            u = row["us"]
            best = min(u, key=u.get)
            print(f"{spec[:44]:44s} {hq}/{hkv} auto({plan.strategy}) {u['auto']:7.1f} best {best} {u[best]:7.1f} | "
                  + " ".join(f"{s} {u[s + '/split']:.1f}/{u[s + '/unsplit']:.1f}" for s in STRATEGIES), flush=True)
    for hq, hkv in HEADS:
        r = [x for x in rows if (x["hq"], x["hkv"]) == (hq, hkv)]
        gain = [x["us"]["auto"] / min(x["us"].values()) for x in r]
        print(f"{hq}/{hkv}: best of all variants vs auto geomean {float(np.exp(np.mean(np.log(gain)))):.3f}, "
              f"max {max(gain):.3f} over {len(r)} trees")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
