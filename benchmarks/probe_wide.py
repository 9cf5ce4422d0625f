"""Probe: the attention kernel with int32 element offsets (what the launcher picks unless a tensor
spans 2^31 elements) against int64 ones (``WIDE``, forced), the same plans timed alternately in
one process.

Premise (session 38, Nsight Compute on an H200, ``ncu_s38.txt``): the masked path tiles of the
deep 1024-leaf trees and the leaf launches are bound by issuing instructions (2 warps a
scheduler; ALU the busiest pipe at 30-43%), and int64 adds and multiplies are most of their
integer work. Each case's ``auto`` plan is made twice (two plans, two launch caches) and run
once per round with ``treeattn.ops._wide`` patched to report a span of 2^31 elements for the
``int64`` one (session 38's runs patched the function it replaced, ``_span``, alike;
:func:`check_gpu.patched_ab`); both outputs are checked against an fp32 reference.

Usage::

    python benchmarks/probe_wide.py [--trees ...] [--heads 32/8,64/8] [--rounds 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import json

from check_gpu import patched_ab, speedups

import treeattn.ops as ops
from treeattn.bench.timing import provenance
from treeattn.workloads import suite_trees, tree_from_spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="*", default=None, help="suite specs (default: the whole suite)")
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    patches = {"int32": {"_wide": ops._wide}, "int64": {"_wide": lambda *args: True}}
    res = {**provenance(), "rows": []}
    for spec in args.trees or suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            row = patched_ab(tree, spec, hq, hkv, patches, args.rounds, ops)
            row["speedup"] = min(row["us"]["int64"]) / min(row["us"]["int32"])
            res["rows"].append(row)
            print(f"{spec[:40]:40s} {hq}/{hkv} {row['strategy']:8s} int64 {min(row['us']['int64']):8.1f} "
                  f"int32 {min(row['us']['int32']):8.1f} x{row['speedup']:.3f}", flush=True)
    print(f"int32 over int64: {len(res['rows'])} plans, {speedups([r['speedup'] for r in res['rows']])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
