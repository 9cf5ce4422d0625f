"""Launch config of the merge (one GPU call).

The merge runs one program per (merged query, block of ``block_h`` heads); each walks its query's
partial rows. ``merge_partials`` picks ``block_h`` so that the grid has ~1024 programs, and 4
warps. This times the merge launch alone of every kernel-suite case's ``auto`` plan (partial rows
from a real run of the plan) under CUDA-graph replay, L2 flushed, for every ``block_h`` and
``num_warps`` given, and checks each output against the default's.

    python benchmarks/sweep_merge.py [--heads 32/32,32/8,64/8] [--block-h 1,2,4,8,16,32]
        [--warps 2,4,8] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import graph_us, provenance
from treeattn.ops import merge_partials, partial_attention
from treeattn.workloads import suite_trees, tree_from_spec


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--suite", default="all")
    ap.add_argument("--trees", nargs="+", help="these specs instead of the suite")
    ap.add_argument("--block-h", default="1,2,4,8,16,32")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    configs = [(int(b), int(w)) for b in args.block_h.split(",") for w in args.warps.split(",")]
    res = {**provenance(), "rows": []}
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    t0 = time.time()
    for spec in args.trees or suite_trees(args.suite):
        tree = tree_from_spec(spec)
        for hq, hkv in heads:
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            n = plan.merge_q_indices.numel()
            if n == 0:
                continue
            q, k, _, out = case_inputs(tree, hq, hkv)
            o_part, l_part = w.partial_buffers(plan)
            partial_attention(q, k, k, plan, o_part, l_part, sm_scale=HEAD_DIM ** -0.5, out=out)
            rows = torch.diff(plan.merge_indptr.long())[plan.merge_q_indices.long()]

            def merge(cfg=None):
                bh, nw = cfg or (None, 4)
                merge_partials(o_part, l_part, plan.merge_q_indices, plan.merge_indptr, plan.merge_indices,
                               out, None, block_h=bh, num_warps=nw)

            merge()
            ref = out.float().clone()
            row = {"tree": spec, "hq": hq, "hkv": hkv, "auto": plan.strategy, "merged": n,
                   "rows_mean": float(rows.float().mean()), "rows_max": int(rows.max()),
                   "us": {"default": graph_us(merge)}, "err": {}}
            for bh, nw in configs:
                if bh > hq:
                    continue
                key = f"{bh}/{nw}"
                row["us"][key] = graph_us(lambda: merge((bh, nw)))
                row["err"][key] = float((out.float() - ref).abs().max())
            res["rows"].append(row)
            best = min((v, kk) for kk, v in row["us"].items())
            bad = {kk: e for kk, e in row["err"].items() if not e < 1e-2}
            print(f"{spec[:40]:40s} {hq}/{hkv} {plan.strategy:10s} q {n:5d} rows {row['rows_mean']:.1f} "
                  f"default {row['us']['default']:6.1f} best {best[1]} {best[0]:6.1f}"
                  + (f" BAD {bad}" if bad else "") + f" [{time.time() - t0:.0f}s]", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
    summary = {}
    for hq, hkv in heads:
        rs = [r for r in res["rows"] if (r["hq"], r["hkv"]) == (hq, hkv)]
        for bh, nw in configs:
            key = f"{bh}/{nw}"
            ratios = [r["us"]["default"] / r["us"][key] for r in rs if key in r["us"]]
            if ratios:
                summary[f"{hq}/{hkv} {key}"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    res["geomean_speedup_over_default"] = summary
    for kk, x in summary.items():
        print(f"{kk:16s} {x:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
