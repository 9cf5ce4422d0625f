"""Leaf packing on the GPU: several small single-node items (a leaf's tokens and its queries) in
one work item, their queries kept apart by the tree mask.

On the 1024-leaf suite trees a plan runs one program per leaf and KV head (~33K one-tile programs
at 32/32 heads), and each costs about half a microsecond of SM time whatever its size. Packing
``k`` consecutive leaf items into one item (their rows share the query tile, their tokens the KV
tiles; each query sees only its own leaf through the tree mask, which only their launch applies)
cuts those programs ``k`` times. This times ``node`` and ``greedy`` plans with their leaf items
packed ``k`` = 2..16 at a time against the unpacked plans and ``auto``, under CUDA-graph replay as
``bench kernels`` does, and checks every output against ``auto``'s.

    python benchmarks/sweep_packing.py [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from treeattn import TreeAttention
from treeattn.bench.timing import graph_us, provenance
from treeattn.plan import PLANNERS, CostModel, HeadConfig, make_plan
from treeattn.plan.items import WorkItems, items_from_groups
from treeattn.plan.plan import build_plan
from treeattn.tree import DecodingTree
from treeattn.workloads import tree_from_spec

CASES = [("1,2,4,8,16,32,64,128,1024_16,16,16,16,16,16,16,16,16", 32, 32),
         ("1,2,4,8,16,32,64,128,1024_256,128,64,16,16,16,16,16,16", 32, 32),
         ("1,16,32,64,128,1024_256,128,64,16,16,16", 32, 32),
         ("1,8,16,32,64,256,1024_256,128,64,16,16,16,16", 32, 32),
         ("1,8,16,32,64,256,1024_256,128,64,16,16,16,16", 32, 8),
         ("1,8,16,32,64,256,1024_256,128,64,32,32,32,32", 32, 8),
         ("1,16,32,64,128,1024_256,128,64,32,32,32", 32, 32)]


def pack_leaf_items(items: WorkItems, tree: DecodingTree, k: int, *, group: int, rows: int = 16,
                    max_tokens: int = 256) -> WorkItems:
    """``items`` with runs of ``k`` consecutive leaf items (one segment, every query at that
    segment's node, at most ``rows // k`` rows and ``max_tokens // k`` tokens) merged into one."""
    n = items.num_items
    nseg = np.diff(items.seg_indptr)
    nq = items.item_queries
    item_of_q = np.repeat(np.arange(n), nq)
    first_seg = items.seg_indptr[:-1]
    seg_node = items.seg_node[np.minimum(first_seg, items.seg_node.size - 1)]
    own = np.ones(n, dtype=bool)
    np.logical_and.at(own, item_of_q, tree.query_nodes[items.q_indices] == seg_node[item_of_q])
    leaf = (nseg == 1) & (nq > 0) & own & (nq * group * k <= rows) & (items.item_len * k <= max_tokens)
    if leaf.sum() < 2 or k < 2:
        return items
    new_id = np.empty(n, dtype=np.int64)
    others = np.flatnonzero(~leaf)
    new_id[others] = np.arange(others.size)
    new_id[leaf] = others.size + np.arange(int(leaf.sum())) // k
    num = int(new_id.max()) + 1
    seg_item = new_id[np.repeat(np.arange(n), nseg)]
    return items_from_groups(seg_item, items.seg_node, items.seg_lo, items.seg_hi, new_id[item_of_q],
                             items.q_indices, num, items.q_tokens)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    d, dtype = 128, torch.float16
    w = TreeAttention(torch.empty(1 << 27, dtype=torch.float32, device="cuda"), device="cuda")
    cost = CostModel()
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
            items, _ = PLANNERS[s](tree, heads, cost)
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
