"""Probe: is the attention kernel's KV loop software-pipelined on the device's Triton, and what
does a KV tile cost a lone program?

Small suite trees run one launch of a few hundred programs that each walk 4-12 KV tiles (e.g.
``1,256_256,32`` at 32/8: 256 programs x 8 tiles, 32 us for a 9 us roofline), about 3 us a tile.
Compiled for sm_90 with Triton 3.9 (the CPU host's), the gathered, contig and masked loops all
issue their K/V loads as asynchronous copies when the strides are specialised as multiples of 16
(benchmarks/NOTES.md, session 20). This checks the device's Triton: it writes the TTGIR of every
attention-kernel variant the runs below compile (``--ttgir DIR``, from ``TRITON_CACHE_DIR``) with
the count of asynchronous copies in each, and times a lone program per KV head (one query, one
node of ``n`` tokens, ``node`` strategy) over contig slots, gathered slots (the node's slots in
reverse) and with the tree mask (a second query that does not see the node's last token), at ``n`` = 256,
1024 and 4096: the slope is the cost of a KV tile.

Usage (H200)::

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/probe_pipeline.py --ttgir OUT_DIR --out FILE.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil

import torch

from treeattn import DecodingTree, TreeAttention
from treeattn.bench.timing import graph_us, provenance
from treeattn.workloads import tree_from_spec

HEADS = ((32, 8), (64, 8))
SUITE = ("1,256_256,32", "1,10_1104,640", "1,2,64_8,256,32")
LENGTHS = (256, 1024, 4096)


def lone_tree(n: int, kind: str) -> DecodingTree:
    slots = torch.arange(n).flip(0).numpy() if kind == "gathered" else None
    if kind == "masked":  # two queries in the node, one not seeing its last token: the tree mask
        return DecodingTree.from_parents([-1], [n], query_nodes=[0, 0], query_prefix=[n - 1, n])
    return DecodingTree.from_parents([-1], [n], query_nodes=[0], kv_indices=slots)


def time_tree(tree: DecodingTree, hq: int, hkv: int, strategy: str) -> tuple[float, dict]:
    w = TreeAttention(device="cuda")
    plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, strategy=strategy)
    q = torch.randn(tree.num_queries, hq, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(int(tree.kv_indices.max()) + 1, 1, hkv, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    us = graph_us(lambda: w.run(q, k, v, plan, out=out))
    return us, {"strategy": plan.strategy, "has_mask": plan.has_mask, "merged": int(plan.merge_q_indices.numel()),
                "launches": [{"block_m": x.block_m, "block_n": x.block_n, "warps": x.num_warps, "stages": x.num_stages,
                              "units": x.work_end - x.work_start, "contig": x.contig, "masked": x.masked}
                             for x in plan.launches]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--ttgir", default=None, help="copy the compiled kernels' TTGIR here")
    args = ap.parse_args()
    rows = []
    for hq, hkv in HEADS:
        for spec in SUITE:
            us, info = time_tree(tree_from_spec(spec), hq, hkv, "auto")
            rows.append({"tree": spec, "hq": hq, "hkv": hkv, "us": us, **info})
            print(f"{spec:20s} {hq}/{hkv} {us:7.1f} us {info}", flush=True)
        for kind in ("contig", "gathered", "masked"):
            t = {}
            for n in LENGTHS:
                t[n], info = time_tree(lone_tree(n, kind), hq, hkv, "node")
            slope = (t[LENGTHS[-1]] - t[LENGTHS[1]]) / ((LENGTHS[-1] - LENGTHS[1]) / info["launches"][0]["block_n"])
            rows.append({"lone": kind, "hq": hq, "hkv": hkv, "us": t, "us_per_tile": slope, **info})
            print(f"lone {kind:8s} {hq}/{hkv} " + " ".join(f"{n}:{t[n]:.1f}" for n in LENGTHS)
                  + f" us; {slope:.2f} us a tile; {info['launches']}", flush=True)
    kernels = []
    cache = os.environ.get("TRITON_CACHE_DIR")
    if cache:
        for path in sorted(glob.glob(os.path.join(cache, "**", "_tree_partial_attention_kernel.ttgir"), recursive=True)):
            ir = open(path).read()
            meta_path = path[:-len(".ttgir")] + ".json"
            meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
            loops = ir.count("scf.for")
            entry = {"file": os.path.relpath(path, cache), "scf_for": loops,
                     "async_copies": ir.count("async_copy_global_to_local"),
                     "tma_loads": ir.count("async_tma_copy_global_to_local"),
                     "sync_loads": len(re.findall(r"= tt\.load ", ir)),
                     "num_stages": meta.get("num_stages"), "num_warps": meta.get("num_warps"),
                     "shared": meta.get("shared")}
            kernels.append(entry)
            print("ttgir", entry, flush=True)
            if args.ttgir:
                dst = os.path.join(args.ttgir, entry["file"].replace(os.sep, "_"))
                os.makedirs(args.ttgir, exist_ok=True)
                shutil.copy(path, dst)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "rows": rows, "kernels": kernels}, f, indent=1)


if __name__ == "__main__":
    main()
