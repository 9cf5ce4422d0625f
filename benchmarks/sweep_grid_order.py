"""Grid order of the attention launches (one GPU call).

A launch's grid is ``(work units, KV heads)``: the GPU starts every work unit of KV head 0, then
of head 1, ... With ``Launch.heads_inner`` it is one dimension with the KV head varying fastest,
so the programs of one work unit's heads run together and read each token's contiguous
``[Hkv, D]`` row at about the same time. The plan builder sets it for launches whose work units
average at least ``HEADS_INNER_MIN_TOKENS`` KV tokens. This times every kernel-suite case's
``auto`` plan with the flag set by other thresholds (``off`` = never, ``0`` = every launch), under
CUDA-graph replay as ``treeattn bench kernels`` does, and checks each output against the plan's
own. Variants giving a plan the same flags share one timing.

    python benchmarks/sweep_grid_order.py [--heads 32/32,32/8,64/8] [--suite all]
        [--thresholds off,0,128,256,512,1024,2048] [--out FILE.json]
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
from treeattn.workloads import suite_trees, tree_from_spec


def launch_tokens(plan) -> list:
    """Mean KV tokens per work unit of each launch (what the builder's rule reads)."""
    span = plan.host.work_kv_end.astype(np.int64) - plan.host.work_kv_start
    return [float(span[ln.work_start:ln.work_end].mean()) for ln in plan.launches]


def with_threshold(plan, tokens: list, threshold):
    flags = tuple(threshold != "off" and t >= float(threshold) for t in tokens)
    return flags, dataclasses.replace(plan, launches=tuple(
        dataclasses.replace(ln, heads_inner=f) for ln, f in zip(plan.launches, flags)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--suite", default="all")
    ap.add_argument("--trees", nargs="+", help="these specs instead of the suite")
    ap.add_argument("--thresholds", default="off,0,128,256,512,1024,2048")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    thresholds = args.thresholds.split(",")
    res = {**provenance(), "thresholds": thresholds, "rows": []}
    bw = copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    t0 = time.time()
    for spec in args.trees or suite_trees(args.suite):
        tree = tree_from_spec(spec)
        for hq, hkv in heads:
            w = TreeAttention(device="cuda", streams=3)
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            q, k, v, out = case_inputs(tree, hq, hkv)
            tokens = launch_tokens(plan)
            row = {"tree": spec, "hq": hq, "hkv": hkv, "auto": plan.strategy,
                   "roofline_us": roofline_us(tree.num_tokens, tree.num_queries, hq, hkv, HEAD_DIM, bw),
                   "launch_tokens": tokens, "base_flags": [ln.heads_inner for ln in plan.launches],
                   "us": {"base": graph_us(lambda: w.run(q, k, v, plan, out=out))}, "err": {}}
            ref = out.float().clone()
            scale = float(ref.abs().max())
            timed = {tuple(row["base_flags"]): "base"}
            for th in thresholds:
                flags, p2 = with_threshold(plan, tokens, th)
                if flags in timed:
                    row["us"][th] = row["us"][timed[flags]]
                    continue
                timed[flags] = th
                row["us"][th] = graph_us(lambda: w.run(q, k, v, p2, out=out))
                row["err"][th] = float((out.float() - ref).abs().max()) / scale
            res["rows"].append(row)
            if args.out:  # after every case: a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
            bad = {th: e for th, e in row["err"].items() if not e < 1e-2}
            print(f"{spec[:40]:40s} {hq}/{hkv} {plan.strategy:10s} roof {row['roofline_us']:6.1f} "
                  + " ".join(f"{th}:{row['us'][th]:.1f}" for th in ["base", *thresholds])
                  + (f" BAD {bad}" if bad else "") + f" [{time.time() - t0:.0f}s]", flush=True)
            torch.cuda.empty_cache()
    # geomean speedup of each threshold over "off" (grid order of every launch as before)
    summary = {}
    for hq, hkv in heads:
        rows = [r for r in res["rows"] if (r["hq"], r["hkv"]) == (hq, hkv)]
        for th in ["base", *thresholds]:
            ratios = [r["us"]["off"] / r["us"][th] for r in rows]
            summary[f"{hq}/{hkv} {th}"] = {"geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                                           "min": min(ratios), "max": max(ratios)}
    res["speedup_over_off"] = summary
    for key, x in summary.items():
        print(f"{key:16s} geomean {x['geomean']:.3f} min {x['min']:.3f} max {x['max']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
