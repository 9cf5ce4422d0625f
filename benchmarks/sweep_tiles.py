"""Compute-heavy work items on a GPU (one call): KV splits and launch configs of tall query tiles.

Trees where many query rows share a long KV range (a Medusa verification tree over a long
context; suite trees with 1024 queries under one prefix and GQA) make the attention kernel
compute-bound: each KV tile feeds a [block_m x block_n] QK^T and PV. This times, under CUDA-graph
replay, each chosen strategy's plan (1) with its long items split at several lengths and (2) with
the launches of 64- and 128-row query tiles given other (block_n, warps, stages), and checks
every variant's output against the unmodified plan. Prints a table; --out writes JSON.

Usage::

    python benchmarks/sweep_tiles.py [--out FILE.json] [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from treeattn import TreeAttention
from treeattn.bench.timing import copy_bandwidth, graph_us, provenance, roofline_us
from treeattn.plan import PLANNERS, CostModel, HeadConfig, make_plan
from treeattn.plan.build import build_plan
from treeattn.plan.split import split_long_items
from treeattn.workloads import tree_from_medusa, tree_from_spec

#: (name, tree factory, hq, hkv, dtype)
CASES = [
    ("medusa256@3000", lambda: tree_from_medusa(256, context_len=3000, compress=False), 32, 8, torch.bfloat16),
    ("medusa256@1000", lambda: tree_from_medusa(256, context_len=1000, compress=False), 32, 8, torch.bfloat16),
    ("medusa128@3000", lambda: tree_from_medusa(128, context_len=3000, compress=False), 32, 8, torch.bfloat16),
    ("medusa32@3000", lambda: tree_from_medusa(32, context_len=3000, compress=False), 32, 8, torch.bfloat16),
    ("1,1024_2048,32", lambda: tree_from_spec("1,1024_2048,32"), 32, 8, torch.float16),
    ("1,1024_2048,32", lambda: tree_from_spec("1,1024_2048,32"), 64, 8, torch.float16),
    ("1,10_4000,400", lambda: tree_from_spec("1,10_4000,400"), 64, 8, torch.float16),
    ("1,16,64_1024,256,32", lambda: tree_from_spec("1,16,64_1024,256,32"), 64, 8, torch.float16),
    ("1,8,16,32,64,256,1024_256,128,64,16,16,16,16",
     lambda: tree_from_spec("1,8,16,32,64,256,1024_256,128,64,16,16,16,16"), 64, 8, torch.float16),
    ("1,256_256,32", lambda: tree_from_spec("1,256_256,32"), 64, 8, torch.float16),
    ("1,2,64_8,256,32", lambda: tree_from_spec("1,2,64_8,256,32"), 64, 8, torch.float16),
    ("1,1024_2048,32", lambda: tree_from_spec("1,1024_2048,32"), 32, 32, torch.float16),
]
SPLITS = (4096, 2048, 1024, 512, 256)
CONFIGS = [(64, 4, 3), (64, 8, 3), (64, 8, 2), (128, 8, 3), (32, 4, 2), (32, 8, 3), (128, 4, 2), (64, 4, 4)]



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="first four cases only")
    args = ap.parse_args()
    bw = copy_bandwidth()
    res = {**provenance(), "copy_bandwidth_TBps": bw / 1e12, "rows": []}
    d, t0 = 128, time.time()
    ws = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    w = TreeAttention(ws, device="cuda")
    cost = CostModel()
    for name, factory, hq, hkv, dtype in CASES[:4] if args.quick else CASES:
        tree = factory()
        heads = HeadConfig(hq, hkv, d, dtype)
        auto = make_plan(tree, heads, strategy="auto", device="cuda", cost=cost)
        q = torch.randn(tree.num_queries, hq, d, device="cuda", dtype=dtype)
        k = torch.randn(-(-auto.min_slots // tree.page_size), tree.page_size, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        flops = 4.0 * hq * d * float(tree.visible_tokens.sum())
        roof = roofline_us(tree.num_tokens, tree.num_queries, hq, hkv, d, bw)
        row = {"case": name, "hq": hq, "hkv": hkv, "roofline_us": roof, "tflop": flops / 1e12,
               "auto": auto.strategy, "variants": {}}

        def time_plan(plan, ref=None):
            t = graph_us(lambda: w.run(q, k, v, plan, out=out))
            err = None if ref is None else float((out.float() - ref.float()).abs().max())
            return t, err

        for s in dict.fromkeys([auto.strategy, "greedy", "flatten", "sequence"]):
            items, _ = PLANNERS[s](tree, heads, cost)
            base = build_plan(tree, items, heads, strategy=s, device="cuda")
            tb, _ = time_plan(base)
            ref = out.clone()
            row["variants"][f"{s}"] = tb
            longest = int(items.item_len.max())
            best = (tb, base, "")
            for ml in SPLITS:
                if ml >= longest or s == "sequence":
                    continue
                plan = build_plan(tree, split_long_items(items, ml), heads, strategy=s, device="cuda")
                t, err = time_plan(plan, ref)
                row["variants"][f"{s}/split{ml}"] = t
                row.setdefault("errors", {})[f"{s}/split{ml}"] = err
                if t < best[0]:
                    best = (t, plan, f"/split{ml}")
            _, plan0, tag = best
            for bm in (64, 128):
                if not any(l.block_m == bm for l in plan0.launches):
                    continue
                for bn, nw, ns in CONFIGS:
                    plan = dataclasses.replace(plan0, launches=tuple(
                        dataclasses.replace(l, block_n=bn, num_warps=nw, num_stages=ns) if l.block_m == bm else l
                        for l in plan0.launches))
                    key = f"{s}{tag}/m{bm}/{bn}/{nw}/{ns}"
                    try:
                        t, err = time_plan(plan, ref)
                    except Exception as e:  # noqa: BLE001 (out of shared memory etc.: record it)
                        row["variants"][key] = None
                        row.setdefault("failures", {})[key] = type(e).__name__
                        continue
                    row["variants"][key] = t
                    row.setdefault("errors", {})[key] = err
        res["rows"].append(row)
        v = {k: x for k, x in row["variants"].items() if x is not None}
        top = sorted(v.items(), key=lambda kv: kv[1])[:4]
        bad = {k: e for k, e in row.get("errors", {}).items() if e is None or e > 0.05}
        print(f"{name[:32]:32s} {hq}/{hkv} roof={roof:.1f}us {flops / 1e12 * 1e6 / 700:.1f}us@700TF auto={auto.strategy} "
              + " ".join(f"{k}={x:.1f}" for k, x in v.items() if "/" not in k)
              + " | best " + " ".join(f"{k}={x:.1f}" for k, x in top)
              + (f" | BAD {bad}" if bad else "") + f" [{time.time() - t0:.0f}s]", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
