"""Leaf packing on the GPU: several small single-node items (a leaf's tokens and its queries) in
one work item, their queries kept apart by the tree mask.

On the 1024-leaf suite trees a plan runs one program per leaf and KV head (~33K one-tile programs
at 32/32 heads), and each costs about half a microsecond of SM time whatever its size. Packing
``k`` consecutive leaf items into one item (their rows share the query tile, their tokens the KV
tiles; each query sees only its own leaf through the tree mask, which only their launch applies)
cuts those programs ``k`` times. This times ``node`` and ``greedy`` plans with their leaf items
packed ``k`` = 2..16 at a time (:func:`treeattn.plan.packing.pack_leaf_items`) against the
plans without packing and ``auto``, under CUDA-graph replay as
``bench kernels`` does, and checks every output against ``auto``'s.

    python benchmarks/sweep_packing.py [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from treeattn import TreeAttention
from treeattn.bench.timing import graph_us, provenance
from treeattn.plan import PLANNERS, CostModel, HeadConfig, make_plan
from treeattn.plan.build import build_plan
from treeattn.plan.packing import pack_leaf_items
from treeattn.workloads import tree_from_spec

CASES = [("1,2,4,8,16,32,64,128,1024_16,16,16,16,16,16,16,16,16", 32, 32),
         ("1,2,4,8,16,32,64,128,1024_256,128,64,16,16,16,16,16,16", 32, 32),
         ("1,16,32,64,128,1024_256,128,64,16,16,16", 32, 32),
         ("1,8,16,32,64,256,1024_256,128,64,16,16,16,16", 32, 32),
         ("1,8,16,32,64,256,1024_256,128,64,16,16,16,16", 32, 8),
         ("1,8,16,32,64,256,1024_256,128,64,32,32,32,32", 32, 8),
         ("1,16,32,64,128,1024_256,128,64,32,32,32", 32, 32)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    d, dtype = 128, torch.float16
    w = TreeAttention(torch.empty(1 << 27, dtype=torch.float32, device="cuda"), device="cuda")
    cost, unpacked = CostModel(), CostModel(leaf_packing=False)
    res = {**provenance(), "rows": []}
    for spec, hq, hkv in CASES:
        tree = tree_from_spec(spec)
        heads = HeadConfig(hq, hkv, d, dtype)
        auto = make_plan(tree, heads, strategy="auto", device="cuda", cost=cost)
        q = torch.randn(tree.num_queries, hq, d, device="cuda", dtype=dtype)
        kc = torch.randn(-(-auto.min_slots // tree.page_size), tree.page_size, hkv, d, device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
        out = torch.empty_like(q)
        times = {f"auto({auto.strategy})": graph_us(lambda: w.run(q, kc, vc, auto, out=out))}
        ref = out.float().clone()
        worst = 0.0
        for s in ("node", "greedy"):
            items, _ = PLANNERS[s](tree, heads, unpacked)
            for k in (1, 2, 4, 8, 16):
                packed = pack_leaf_items(items, tree, k, group=heads.group)
                if k > 1 and packed is items:
                    continue
                plan = build_plan(tree, packed, heads, strategy=s, device="cuda")
                times[f"{s}/k{k}"] = graph_us(lambda: w.run(q, kc, vc, plan, out=out))
                worst = max(worst, float((out.float() - ref).norm() / ref.norm()))
        res["rows"].append({"tree": spec, "hq": hq, "hkv": hkv, "us": times, "max_rel_l2": worst})
        best = min(times, key=times.get)
        print(f"{spec[:40]:40s} {hq}/{hkv} " + " ".join(f"{k}={x:.1f}" for k, x in times.items())
              + f" | best {best} | err {worst:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
