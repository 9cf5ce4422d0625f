"""Probe: the attention kernel with int32 element offsets (what the launcher picks unless a tensor
spans 2^31 elements) against int64 ones (``WIDE``, forced), the same plans timed alternately in
one process.

Premise (session 38, Nsight Compute on an H200, ``ncu_s38.txt``): the masked path tiles of the
deep 1024-leaf trees and the leaf launches are bound by issuing instructions (2 warps a
scheduler; ALU the busiest pipe at 30-43%), and int64 adds and multiplies are most of their
integer work. Each case's ``auto`` plan is made twice (two plans, two launch caches) and run
once per round with ``treeattn.ops._span`` patched to report 2^31 elements for the ``int64``
one; both outputs are checked against an fp32 reference.

Usage::

    python benchmarks/probe_wide.py [--trees ...] [--heads 32/8,64/8] [--rounds 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import json

import torch
from check_gpu import checked_error, reference_fp32, speedups

import treeattn.ops as ops
from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import graph_us, provenance
from treeattn.workloads import suite_trees, tree_from_spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="*", default=None, help="suite specs (default: the whole suite)")
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    span = ops._span
    modes = {"int32": span, "int64": lambda t: 1 << 31}
    res = {**provenance(), "rows": []}
    for spec in args.trees or suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            q, k, v, out = case_inputs(tree, hq, hkv)
            slots = torch.as_tensor(tree.kv_indices, device=k.device, dtype=torch.long)  # (token order)
            ref = reference_fp32(q, k[slots, 0], v[slots, 0], tree, HEAD_DIM ** -0.5)
            w = TreeAttention(device="cuda")
            plans = {m: w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM) for m in modes}
            row = {"tree": spec, "hq": hq, "hkv": hkv, "tree_tokens": tree.num_tokens,
                   "strategy": plans["int32"].strategy, "err": {}, "us": {m: [] for m in modes}}
            for m, p in plans.items():
                ops._span = modes[m]
                o = torch.empty_like(out)
                w.run(q, k, v, p, out=o)
                torch.cuda.synchronize()
                row["err"][m] = checked_error(o, ref, f"{spec} {hq}/{hkv} {m}")
            for _ in range(args.rounds):
                for m, p in plans.items():
                    ops._span = modes[m]
                    row["us"][m].append(graph_us(lambda p=p: w.run(q, k, v, p, out=out)))
            ops._span = span
            row["speedup"] = min(row["us"]["int64"]) / min(row["us"]["int32"])
            res["rows"].append(row)
            print(f"{spec[:40]:40s} {hq}/{hkv} {row['strategy']:8s} int64 {min(row['us']['int64']):8.1f} "
                  f"int32 {min(row['us']['int32']):8.1f} x{row['speedup']:.3f}", flush=True)
            del q, k, v, out, ref
            torch.cuda.empty_cache()
    print(f"int32 over int64: {len(res['rows'])} plans, {speedups([r['speedup'] for r in res['rows']])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
