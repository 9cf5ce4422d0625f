"""Session 28's planning changes on the kernel-suite plans they change: TMA wide tiles for launches
of at most a wave of programs (``TMA_MIN_TOKENS``, :func:`treeattn.plan.addressing.tma_pays`),
the TMA rating of items known to read runs (``CostModel.tma_speedup``: ``paths``' lead chunks,
``node``'s items) and leads cut in 2 chunks (``LEAD_CHUNKS``). Each plan timed as planned now and
as before (TMA from 2048 tokens only, no TMA rating, chunks 3, 4, 6), in the same process, under
CUDA-graph replay (``bench kernels``' timing: side streams, ``do_bench`` median, L2 flushed),
outputs checked against each other.

Usage::

    python benchmarks/probe_tma_wave.py [--cases SPEC:HQ/HKV:STRATEGY ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import provenance, time_run
from treeattn.plan import addressing
from treeattn.plan import node as node_planner
from treeattn.plan import paths as paths_planner
from treeattn.workloads import tree_from_spec

#: the suite plans that differ (every strategy, 32/32, 32/8, 64/8; found on the CPU with
#: ``CostModel(tma=True)``)
CASES = ("8,16,32,256_512,512,256,32:32/8:auto", "8,16,32,256_512,512,256,32:32/8:node",
         "1,16,64_1024,256,32:32/8:node", "1,16,64_1024,256,32:64/8:node", "1,10_4000,400:64/8:pack",
         "1,10_4096,416:64/8:pack", "1,2,64_1024,256,256:32/8:node", "1,2,64_1024,256,256:64/8:node",
         "1,16,64_1024,256,32:32/32:paths", "1,16,64_1024,256,32:32/8:paths",
         "1,2,64_1024,256,256:64/8:auto", "1,8,512_32,2048,256:32/8:auto", "1,8,512_32,2048,256:64/8:auto",
         "1,1024_2048,32:32/8:auto", "1,1024_2048,32:64/8:auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--out")
    args = ap.parse_args()
    node_runs = node_planner._NodeItems.unmasked_runs
    now = (addressing.TMA_MIN_TOKENS, paths_planner.LEAD_CHUNKS, None, node_runs)
    before = (now[0][-1:], (3, 4, 6), 1.0, False)
    res = {**provenance(), "now": now[:2], "before": before, "rows": []}
    for case in args.cases:
        spec, heads, strategy = case.split(":")
        hq, hkv = (int(x) for x in heads.split("/"))
        tree = tree_from_spec(spec)
        q, k, v, out = case_inputs(tree, hq, hkv)
        row, ref = {"case": case}, None
        for name, (table, chunks, speedup, runs) in (("now", now), ("before", before)):
            addressing.TMA_MIN_TOKENS, paths_planner.LEAD_CHUNKS = table, chunks
            node_planner._NodeItems.unmasked_runs = runs
            tree = tree_from_spec(spec)  # (fresh: a tree caches its planners' items)
            w = TreeAttention(device="cuda")
            if speedup is not None:
                w.cost = dataclasses.replace(w.cost, tma_speedup=speedup)
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, strategy=strategy)
            eager, graph = time_run(w, plan, q, k, v, out)
            torch.cuda.synchronize()
            if ref is None:
                ref = out.float().clone()
            else:
                diff = (out.float() - ref).abs().max().item()
                if not diff <= 5e-3:
                    raise SystemExit(f"{case} {name}: max diff {diff}")
            row[name] = {"graph_us": graph, "us": eager, "strategy": plan.strategy,
                         "tma_launches": sum(ln.tma for ln in plan.launches)}
        addressing.TMA_MIN_TOKENS, paths_planner.LEAD_CHUNKS = now[:2]
        node_planner._NodeItems.unmasked_runs = node_runs
        print(f"{case}: now {row['now']['graph_us']:.1f} us ({row['now']['tma_launches']} TMA), before "
              f"{row['before']['graph_us']:.1f} us ({row['before']['tma_launches']} TMA)", flush=True)
        res["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
