"""KV split length of the few-shot trees (one ~4K-token prompt, b sampled branches) as the engine
runs them: CUDA-graph replay without side streams, Llama-3-8B heads (32/8, bf16).

The engine's attention for these trees is greedy's plan: the prompt split into 256-token chunks
(``CostModel.min_split_tokens``) and one launch per tile shape, run one after the other. This times
greedy's items split at other lengths, and the other strategies, against the default plan.

    python benchmarks/sweep_fewshot.py [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from treeattn import TreeAttention
from treeattn.bench.timing import copy_bandwidth, graph_us, provenance, roofline_us
from treeattn.plan import PLANNERS, CostModel, HeadConfig, make_plan
from treeattn.plan.build import build_plan
from treeattn.plan.greedy import _assign_edges
from treeattn.plan.items import glued_items
from treeattn.plan.split import split_long_items
from treeattn.workloads import tree_from_spec

TREES = ("1,20_4000,50", "1,20_4000,200", "1,20_4000,400", "1,30_4000,200", "1,50_4000,200")
SPLITS = (64, 128, 192, 256, 384, 512, 1024)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    bw = copy_bandwidth()
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    heads, cost = HeadConfig(hq, hkv, d, dtype), CostModel()
    w = TreeAttention(torch.empty(1 << 26, dtype=torch.float32, device="cuda"), device="cuda", streams=0)
    res = {**provenance(), "copy_bandwidth_TBps": bw / 1e12, "rows": []}
    for spec in TREES:
        tree = tree_from_spec(spec)
        auto = make_plan(tree, heads, strategy="auto", device="cuda", cost=cost)
        q = torch.randn(tree.num_queries, hq, d, device="cuda", dtype=dtype)
        k = torch.randn(-(-auto.min_slots // tree.page_size), tree.page_size, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        times = {"auto": graph_us(lambda: w.run(q, k, v, auto, out=out))}
        ref = out.clone()
        for s in ("sequence", "node_chunk", "flatten", "pack"):
            items, _ = PLANNERS[s](tree, heads, cost)
            plan = build_plan(tree, items, heads, strategy=s, device="cuda")
            times[s] = graph_us(lambda: w.run(q, k, v, plan, out=out))
        glued = glued_items(tree, _assign_edges(tree, tree.subtree_queries * heads.group, cost))
        worst = 0.0
        for ml in SPLITS:
            plan = build_plan(tree, split_long_items(glued, ml), heads, strategy="greedy", device="cuda")
            times[f"greedy/split{ml}"] = graph_us(lambda: w.run(q, k, v, plan, out=out))
            worst = max(worst, float((out.float() - ref.float()).norm() / ref.float().norm()))
        roof = roofline_us(tree.num_tokens, tree.num_queries, hq, hkv, d, bw)
        res["rows"].append({"tree": spec, "roofline_us": roof, "auto": auto.strategy, "us": times,
                            "max_rel_l2_vs_auto": worst})
        best = min(times, key=times.get)
        print(f"{spec:16s} roof {roof:5.1f} auto({auto.strategy}) {times['auto']:6.1f} | "
              + " ".join(f"{k}={x:.1f}" for k, x in times.items() if k != "auto")
              + f" | best {best} {times[best]:.1f} | err {worst:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
