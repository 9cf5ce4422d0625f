"""Probe: warps per program of the small query tiles (one GPU call).

Premise (session 12): a launch of many one- or two-tile programs with 16-row query tiles (the
leaves of GQA trees: ``1,256_256,32`` at 32/8 runs 2048 programs of one 32-token tile in ~20 us)
is bound by how many programs an SM holds while each waits on its chain of dependent loads (work
unit, slots, K/V gather, partial-row store). Four warps a 16-row program leave most of its
threads idle in the MMA and cost registers and shared memory that cap residency; one or two
warps would hold 2-4x more programs in flight.

This compiles the kernel for the GPU at ``(block_m, block_n, warps, stages)`` configs and reports
registers and shared memory (the residency they allow), then times every kernel-suite case's
``auto`` plan with its launches of <= 32-row tiles given 1 or 2 warps (and other stages), under
CUDA-graph replay (streams as ``treeattn bench kernels``), checking each output against the
unmodified plan's.

    python benchmarks/probe_warps.py [--heads 32/32,32/8,64/8] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import torch

from sweep_stages import pipeline_buffers
from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import graph_us, provenance, roofline_us, copy_bandwidth
from treeattn.workloads import suite_trees, tree_from_spec

#: (max block_m of the launches changed, warps, stages delta)
VARIANTS = [(32, 2, 0), (32, 1, 0), (16, 2, 0), (16, 1, 0), (32, 2, 1), (16, 1, 1)]
COMPILE = [(16, 32, w, s) for w in (1, 2, 4) for s in (2, 3)] + [(16, 64, w, 3) for w in (1, 2, 4)] + \
          [(32, 64, w, 3) for w in (2, 4)]
EXTRA_TREES = ["1,10_1104,64", "1,10_1104,640", "1,20_4000,200"]


def with_warps(plan, max_m: int, warps: int, dstages: int):
    return dataclasses.replace(plan, launches=tuple(
        dataclasses.replace(ln, num_warps=warps, num_stages=max(1, ln.num_stages + dstages))
        if ln.block_m <= max_m else ln for ln in plan.launches))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    res = {**provenance(), "compiled": {}, "rows": []}
    for cfg in COMPILE:
        key = "/".join(map(str, cfg))
        try:
            res["compiled"][key] = pipeline_buffers(*cfg)
        except Exception as e:  # noqa: BLE001 (record what did not compile)
            res["compiled"][key] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print("compile m/n/w/s", key, res["compiled"][key], flush=True)
    bw = copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    t0 = time.time()
    for spec in suite_trees("all") + EXTRA_TREES:
        tree = tree_from_spec(spec)
        for hq, hkv in heads:
            w = TreeAttention(device="cuda", streams=3)
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            if not any(ln.block_m <= 32 for ln in plan.launches):
                continue
            q, k, v, out = case_inputs(tree, hq, hkv)
            row = {"tree": spec, "hq": hq, "hkv": hkv, "auto": plan.strategy,
                   "roofline_us": roofline_us(tree.num_tokens, tree.num_queries, hq, hkv, HEAD_DIM, bw),
                   "small_launches": [(ln.block_m, ln.block_n, ln.num_warps, ln.num_stages, ln.contig,
                                       (ln.work_end - ln.work_start) * hkv) for ln in plan.launches if ln.block_m <= 32],
                   "us": {"base": graph_us(lambda: w.run(q, k, v, plan, out=out))}, "err": {}}
            ref = out.float().clone()
            scale = float(ref.abs().max())
            for max_m, warps, ds in VARIANTS:
                key = f"m{max_m}/w{warps}/s{ds:+d}"
                p2 = with_warps(plan, max_m, warps, ds)
                if p2.launches == plan.launches:
                    continue
                try:
                    row["us"][key] = graph_us(lambda: w.run(q, k, v, p2, out=out))
                except Exception as e:  # noqa: BLE001 (out of resources etc.)
                    row["us"][key] = None
                    row["err"][key] = f"{type(e).__name__}: {e}"[:200]
                    continue
                row["err"][key] = float((out.float() - ref).abs().max()) / scale
            res["rows"].append(row)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
            base = row["us"]["base"]
            best = min((x, kk) for kk, x in row["us"].items() if x is not None)
            bad = {kk: e for kk, e in row["err"].items() if not isinstance(e, float) or not e < 1e-2}
            print(f"{spec[:40]:40s} {hq}/{hkv} {plan.strategy:10s} base {base:6.1f} best {best[1]} {best[0]:6.1f} "
                  f"({base / best[0]:.2f}x) " + " ".join(f"{kk}={x:.1f}" for kk, x in row["us"].items()
                                                       if x is not None and kk != "base")
                  + (f" BAD {bad}" if bad else "") + f" [{time.time() - t0:.0f}s]", flush=True)
            torch.cuda.empty_cache()
    summary = {}
    for hq, hkv in heads:
        rows = [r for r in res["rows"] if (r["hq"], r["hkv"]) == (hq, hkv)]
        for max_m, warps, ds in VARIANTS:
            key = f"m{max_m}/w{warps}/s{ds:+d}"
            ratios = [r["us"]["base"] / r["us"][key] for r in rows if r["us"].get(key)]
            if ratios:
                summary[f"{hq}/{hkv} {key}"] = (math.exp(sum(map(math.log, ratios)) / len(ratios)), len(ratios),
                                                 min(ratios), max(ratios))
    res["geomean_speedup"] = summary
    for kk, x in summary.items():
        print(f"{kk:24s} geomean {x[0]:.3f} over {x[1]} (min {x[2]:.2f}, max {x[3]:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
