"""Probe: HBM bytes each launch of a plan reads, under Nsight Compute (does a tall launch's KV
re-read by its several query tiles hit L2?).

Premise (session 30, ``probe_cohabit.py``): at 64/8 the >= 100K-token GQA plans take about the
HBM time of ``plan.io``'s bytes counting the tall tiles' KV re-reads (``1,8,512_32,2048,256``:
900 MB, 298 us at copy bandwidth, 288 us measured), as if the query tiles of one item, adjacent in
the grid, read its KV from HBM each. If they hit L2 instead, the plans are bound by SM time, not
HBM, and the lever is the tall launch's speed.

Each case's plan runs once as a whole and then launch by launch (attention launches alone, no
merge), between ``cudaProfilerStart`` / ``Stop``; run it under::

    ncu --profile-from-start off --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum \\
        --csv python benchmarks/probe_l2.py [--trees ...] [--heads 64/8] > ncu.csv
    python benchmarks/probe_l2.py --report ncu.csv --plans plans.json

Without ncu it prints each launch's ``plan.io``-style byte counts (``--plans`` writes them) so the
report can set the measured bytes beside them.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json

import numpy as np
import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.ops import partial_attention
from treeattn.workloads import tree_from_spec

TREES = ("1,8,512_32,2048,256", "1,8,512_512,512,256", "1,4,16,64,256,1024_256,8,256,64,32,256")


def launch_bytes(plan, ln) -> dict:
    """KV bytes of a launch's distinct work-unit KV ranges (a root glued to several nodes counts
    once a unit), and with every query tile's pass (what HBM serves if no tile's KV hits L2)."""
    h = plan.heads
    per_token = h.num_kv_heads * h.head_dim * 2 * h.elem_bytes
    start = plan.work_kv_start[ln.work_start:ln.work_end].cpu().numpy().astype(np.int64)
    end = plan.work_kv_end[ln.work_start:ln.work_end].cpu().numpy().astype(np.int64)
    unique = np.unique(np.stack([start, end]), axis=1)  # (a unit's query tiles share its KV range)
    return {"kv_unique": int((unique[1] - unique[0]).sum()) * per_token,
            "kv_with_rereads": int((end - start).sum()) * per_token}


def run(args) -> None:
    plans = []
    for spec in args.trees:
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            q, k, v, out = case_inputs(tree, hq, hkv)
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            o_part, lse_part = w.partial_buffers(plan)
            singles = [dataclasses.replace(plan, launches=(ln,)) for ln in plan.launches]
            for _ in range(2):  # compile and warm up outside the profiled range
                w.run(q, k, v, plan, out=out)
                for one in singles:
                    partial_attention(q, k, v, one, o_part, lse_part, sm_scale=0.088, out=out)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            w.run(q, k, v, plan, out=out)
            for one in singles:
                partial_attention(q, k, v, one, o_part, lse_part, sm_scale=0.088, out=out)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            plans.append({"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy,
                          "io_kv": plan.io.kv, "io_rereads": plan.io.kv_tile_rereads,
                          "launches": [{"block_m": ln.block_m, "programs": (ln.work_end - ln.work_start) * hkv,
                                        "tma": ln.tma, "contig": ln.contig, **launch_bytes(plan, ln)}
                                       for ln in plan.launches]})
    text = json.dumps(plans, indent=1)
    if args.plans:
        with open(args.plans, "w") as f:
            f.write(text)
    print(text)


def report(args) -> None:
    """Measured bytes of each profiled kernel beside the plans' counts, in launch order."""
    with open(args.report) as f:
        lines = f.read().splitlines()
    start = next(i for i, s in enumerate(lines) if s.startswith('"ID"'))
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    kernels = {}
    for r in rows:
        kernels.setdefault(int(r["ID"]), {"name": r["Kernel Name"]})[r["Metric Name"]] = (r["Metric Unit"],
                                                                                          r["Metric Value"])
    with open(args.plans) as f:
        plans = json.load(f)
    for p in plans:
        print(f"{p['tree']} {p['hq']}/{p['hkv']} {p['strategy']}: plan.io kv {p['io_kv'] / 1e6:.1f} MB "
              f"+ re-reads {p['io_rereads'] / 1e6:.1f} MB")
        for i, ln in enumerate(p["launches"]):
            print(f"  L{i}: {ln['programs']} programs of {ln['block_m']} rows, tma={ln['tma']}: KV unique "
                  f"{ln['kv_unique'] / 1e6:.1f} MB, with re-reads {ln['kv_with_rereads'] / 1e6:.1f} MB")
    # (kernels in profiling order: per plan, the whole plan's launches and merge, then each launch alone)
    for i in sorted(kernels):
        k = kernels[i]
        print(f"{i:4d} {k['name'][:40]:40s} " + " ".join(
            f"{m}={mv[1]} {mv[0]}" for m, mv in k.items() if m != "name"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="*", default=list(TREES))
    ap.add_argument("--heads", default="64/8,32/8")
    ap.add_argument("--plans", help="JSON of the plans' launches and byte counts (written by a run, read by --report)")
    ap.add_argument("--report", metavar="NCU_CSV")
    args = ap.parse_args()
    report(args) if args.report else run(args)


if __name__ == "__main__":
    main()
