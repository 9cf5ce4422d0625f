"""Probe: launch configs of the >= 100K-token GQA plans as a whole (tall and leaf launches side by
side), not launch by launch.

At 64/8 `1,8,512_32,2048,256` runs 244 us against 144 us for its leaf launch alone and 108 us for
its tall launch alone (NOTES.md, session 16): the two barely overlap. A tall program holds a large
share of an SM's registers and shared memory, so while tall programs are resident few leaf
programs fit beside them. This times ``auto``'s plan of each such case under CUDA-graph replay with
one launch's ``(block_n, num_warps, num_stages)`` replaced at a time, and checks each variant's
output against the planned one (relative L2).

Usage (H200)::

    python benchmarks/probe_mix.py --out benchmarks/results/h200_probe_mix.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import case_inputs
from treeattn.bench.timing import graph_us, provenance
from treeattn.workloads import tree_from_spec

TREES = ("1,8,512_32,2048,256", "1,8,512_512,512,256", "1,8,512_32,512,256",
         "1,4,16,64,256,1024_256,8,256,64,32,256")
HEADS = ((32, 8), (64, 8))
TALL = [(64, 8, 3), (64, 8, 2), (64, 4, 2), (32, 4, 3), (32, 4, 4), (32, 8, 3), (128, 8, 2)]
SHORT = [(64, 2, 2), (64, 4, 3), (32, 4, 3), (32, 2, 3), (128, 4, 2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for spec in TREES:
        tree = tree_from_spec(spec)
        for hq, hkv in HEADS:
            q, k, v, out = case_inputs(tree, hq, hkv)
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128)
            ref = torch.empty_like(out)
            w.run(q, k, v, plan, out=ref)
            base = graph_us(lambda: w.run(q, k, v, plan, out=ref))
            row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy, "planned_us": base,
                   "launches": [dataclasses.asdict(ln) for ln in plan.launches], "variants": []}
            print(json.dumps({k_: row[k_] for k_ in ("tree", "hq", "hkv", "strategy", "planned_us")}), flush=True)
            for i, ln in enumerate(plan.launches):
                for cfg in (TALL if ln.block_m >= 64 else SHORT):
                    if cfg == (ln.block_n, ln.num_warps, ln.num_stages):
                        continue
                    new = dataclasses.replace(ln, block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2],
                                              tma=False)
                    p = dataclasses.replace(plan, launches=plan.launches[:i] + (new,) + plan.launches[i + 1:])
                    o = torch.empty_like(out)
                    try:
                        w.run(q, k, v, p, out=o)
                        us = graph_us(lambda: w.run(q, k, v, p, out=o))
                    except Exception as e:  # a config the compiler rejects (shared memory)
                        row["variants"].append({"launch": i, "config": cfg, "error": str(e)[:120]})
                        continue
                    rel = float((o.float() - ref.float()).norm() / ref.float().norm())
                    row["variants"].append({"launch": i, "config": cfg, "us": us, "rel": rel})
                    print(f"  launch {i} {ln.block_m}x{ln.block_n}/{ln.num_warps}/{ln.num_stages} contig={ln.contig}"
                          f" -> {cfg}: {us:.1f} us ({base / us:.3f}x) rel {rel:.1e}", flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
