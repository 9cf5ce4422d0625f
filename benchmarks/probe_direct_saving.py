"""Probe: ``auto``'s plans with ``CostModel.direct_saving_pdl_s`` at two values, where they differ.

With PDL (the default launch mode on Hopper, and the engine's) a merge launch overlaps the
attention launches, and since session 35 only a launch's last program waits at its exit, so
merging plans of several launches gained on direct (merge-free) ones. This plans every suite case
and Medusa-, few-shot- and ToT-shaped trees with the wrapper's cost model at ``--old`` and
``--new`` savings, and times both plans where they differ, alternately over ``--rounds`` rounds
in one process (CUDA-graph replay, L2 flushed), each checked against the fp32 reference.

    python benchmarks/probe_direct_saving.py [--heads 32/32,32/8,64/8] [--old 6e-6] [--new 2e-6] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from check_gpu import alternating_graph_us, case_with_reference, checked_runs

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM
from treeattn.bench.timing import provenance
from treeattn.workloads import suite_trees, tree_from_medusa, tree_from_spec, tree_from_tot_template

SHAPED = ["1,10_4000,400", "1,10_1104,64", "1,10_1104,256", "1,10_1104,640", "1,10_1104,1024", "1,20_4000,200",
          "1,50_4000,200", "1,3_2000,10", "1,20_1000,50", "1,50_1000,100"]


def trees():
    for spec in suite_trees("all") + SHAPED:
        yield spec, lambda spec=spec: tree_from_spec(spec)
    for t in (32, 64, 128, 256):
        for c in (500, 1000, 2000, 3000, 4000):
            yield f"medusa{t}@{c}", lambda t=t, c=c: tree_from_medusa(t, context_len=c)
    for name in ("set", "sorting", "docmerge", "keyword"):
        for i in range(2):
            yield f"tot-{name}-{i}", lambda name=name, i=i: tree_from_tot_template(name, i)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--old", type=float, default=6e-6)
    ap.add_argument("--new", type=float, default=2e-6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    res = {**provenance(), "old_s": args.old, "new_s": args.new, "planned": 0, "rows": []}
    for name, make in trees():
        tree = make()
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            w = TreeAttention(device="cuda")
            plans = {}
            for key, saving in (("old", args.old), ("new", args.new)):
                w.cost = dataclasses.replace(w.cost, direct_saving_pdl_s=saving)
                plans[key] = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            res["planned"] += 1
            a, b = plans["old"], plans["new"]
            if (a.strategy == b.strategy and a.launches == b.launches and a.num_rows == b.num_rows
                    and a.reason.split("; ")[-1] == b.reason.split("; ")[-1]):
                continue
            q, k, v, out, ref = case_with_reference(tree, hq, hkv)
            row = {"tree": name, "hq": hq, "hkv": hkv,
                   "strategy": {key: p.strategy for key, p in plans.items()},
                   "reason": {key: p.reason for key, p in plans.items()},
                   "err": checked_runs(lambda p, o: w.run(q, k, v, p, out=o), plans, ref, f"{name} {hq}/{hkv}")}
            row["us"] = alternating_graph_us(lambda p: w.run(q, k, v, p, out=out), plans, args.rounds)
            row["speedup"] = min(row["us"]["old"]) / min(row["us"]["new"])
            res["rows"].append(row)
            print(f"{name[:40]:40s} {hq}/{hkv} {row['strategy']['old']} {min(row['us']['old']):.1f} -> "
                  f"{row['strategy']['new']} {min(row['us']['new']):.1f} us  x{row['speedup']:.3f}", flush=True)
            del q, k, v, out, ref
            torch.cuda.empty_cache()
    print(f"{len(res['rows'])} of {res['planned']} plans differ")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
