"""Probe: ``paths`` plans (query tiles reading the union of their queries' paths) on the kernel suite.

For every suite case this times, under CUDA-graph replay with side streams, ``auto`` without
``paths`` and every ``paths`` variant (each query-tile height, with long nodes of few rows kept
apart or not, whole or with the tiles' leads split for parallelism), checks each output against ``auto``'s, and records
the cost model's estimate of each, for a refit.

    python benchmarks/probe_paths.py [--heads 32/8,64/8,32/32] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import copy_bandwidth, graph_us, provenance, roofline_us
from treeattn.plan import PLANNERS, CostModel, HeadConfig, build_plan
from treeattn.plan.auto import estimate_items, plan_auto
from treeattn.plan.paths import paths_variants
from treeattn.workloads import suite_trees, tree_from_spec


def variants(tree, heads: HeadConfig, cost: CostModel) -> dict:
    """``paths``' variants by note."""
    return {note: items for items, note in paths_variants(tree, heads, cost)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/8,64/8,32/32")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    res = {**provenance(), "rows": []}
    bw = copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    heads_list = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    cost = CostModel()
    others = {k: v for k, v in PLANNERS.items() if k != "paths"}
    t0 = time.time()
    trees = {spec: tree_from_spec(spec) for spec in suite_trees("all")}
    for hq, hkv in heads_list:  # (heads outermost: a run cut short has whole head configs)
        for spec, tree in trees.items():
            heads = HeadConfig(hq, hkv, HEAD_DIM, torch.float16)
            q, k, v, out = case_inputs(tree, hq, hkv)
            row = {"tree": spec, "hq": hq, "hkv": hkv,
                   "roofline_us": roofline_us(tree.num_tokens, tree.num_queries, hq, hkv, HEAD_DIM, bw),
                   "us": {}, "est_us": {}, "err": {}}
            name, items, reason, _ = plan_auto(tree, heads, cost, others)
            plans = {"auto": build_plan(tree, items, heads, strategy=name, device="cuda", cost=cost)}
            row["auto"] = name
            row["est_us"]["auto"] = estimate_items(tree, items, heads, cost)["total"] * 1e6
            for vn, vitems in variants(tree, heads, cost).items():
                plans[vn] = build_plan(tree, vitems, heads, strategy="paths", device="cuda", cost=cost)
                row["est_us"][vn] = estimate_items(tree, vitems, heads, cost)["total"] * 1e6
            need = max(p.workspace_bytes() for p in plans.values()) // 4
            w = TreeAttention(torch.empty(max(need, 1), dtype=torch.float32, device="cuda"), device="cuda", streams=3)
            ref = None
            for vn, p in plans.items():
                row["us"][vn] = graph_us(lambda: w.run(q, k, v, p, out=out))
                got = out.float()
                if ref is None:
                    ref, scale = got.clone(), float(got.abs().max())
                row["err"][vn] = float((got - ref).abs().max()) / scale
            res["rows"].append(row)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
            us = row["us"]
            best = min((x, n) for n, x in us.items() if n != "auto")
            print(f"{spec[:40]:40s} {hq}/{hkv} roof={row['roofline_us']:.1f} auto({name})={us['auto']:.1f} "
                  f"best paths {best[1]}={best[0]:.1f} ({us['auto'] / best[0]:.2f}x)"
                  + (" BAD" if any(not e < 1e-2 for e in row["err"].values()) else "")
                  + f" [{time.time() - t0:.0f}s]", flush=True)
            del plans
            torch.cuda.empty_cache()
    for hq, hkv in heads_list:
        rows = [r for r in res["rows"] if (r["hq"], r["hkv"]) == (hq, hkv)]
        if not rows:
            continue
        gain = [r["us"]["auto"] / min(min(x for n, x in r["us"].items() if n != "auto"), r["us"]["auto"])
                for r in rows]
        print(f"{hq}/{hkv}: min(auto, best paths) vs auto geomean "
              f"{math.exp(sum(map(math.log, gain)) / len(gain)):.3f}, max {max(gain):.2f}")


if __name__ == "__main__":
    main()
