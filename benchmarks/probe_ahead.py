"""Probe: gathered launches that load each KV tile's slots an iteration ahead (``Launch.ahead``)
against the planned ones, the same plans timed alternately in one process.

Premise (session 39, compiled offline for sm_90): in a gathered loop each tile's K/V addresses
come from a slot load of the same iteration, and Triton's software pipeline then waits for every
copy in flight (``async_wait {num = 0}``) before each tile: one memory round trip a tile (the ~1.6
us a 64-token gathered tile of a lone program, sessions 20-21). Loading the next tile's slots in
the current iteration (a loop-carried value) lets it wait for the current tile's K/V only (``num =
2``, as contig loops do). Prediction: the gathered launches, most of all the deep trees' masked
64-row path launches (two programs a SM, latency-bound: ``h200_ncu_s38.txt``), run faster; the
deeper pipeline needs more shared memory (64 x 64 tiles: 84 -> 117 KB, one program a SM), so
32-token tiles (67 KB, three programs a SM) are a variant too.

Variants, applied to every gathered (not contig) launch of ``auto``'s plan:
``ahead`` the planned tile with ``ahead``; ``ahead32`` 64-token tiles as 32-token ones in 3 stages,
with ``ahead``; ``ahead32s4`` the same in 4 stages; ``tile32`` the 32-token tiles without ``ahead``
(a control). Each variant's output is checked against an fp32 reference; times are CUDA-graph
replays (L2 flushed), every variant once a round.

Usage::

    python benchmarks/probe_ahead.py [--trees ...] [--heads 32/8,64/8] [--variants ...] [--rounds 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re

import torch
from check_gpu import alternating_graph_us, case_with_reference, checked_runs, speedups

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM
from treeattn.bench.timing import provenance
from treeattn.kernels.attention import _tree_partial_attention_kernel
from treeattn.workloads import suite_trees, tree_from_spec

VARIANTS = ("ahead", "ahead32", "ahead32s4", "tile32")


def variant(plan, name: str):
    """``plan`` with its gathered launches as ``name`` says; None where it has none."""
    if not any(not ln.contig for ln in plan.launches):
        return None
    ahead = name.startswith("ahead")
    stages = 4 if name.endswith("s4") else 3
    narrow = "32" in name

    def change(ln):
        if ln.contig:
            return ln
        if narrow and ln.block_n == 64:
            ln = dataclasses.replace(ln, block_n=32, num_stages=stages)
        return dataclasses.replace(ln, ahead=ahead)
    return dataclasses.replace(plan, launches=tuple(map(change, plan.launches)))


def compiled_waits() -> list:
    """The ``async_wait`` lines (which copies each waits for, and how many may stay in flight),
    registers and shared memory of every compiled attention kernel: the device's Triton may
    pipeline differently from the one the premise was compiled with."""
    out = []
    for cache in _tree_partial_attention_kernel.device_caches.values():
        for key, k in cache[0].items():
            try:
                out.append({"key": str(key)[-600:], "regs": k.n_regs, "shared": k.metadata.shared,
                            "stages": k.metadata.num_stages, "warps": k.metadata.num_warps,
                            "waits": re.findall(r"async_wait[^\n]*?num = \d+", k.asm.get("ttgir", ""))})
            except (AttributeError, KeyError, RuntimeError) as e:  # (a Triton without these fields)
                out.append({"error": repr(e)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="*", default=None, help="suite specs (default: the whole suite)")
    ap.add_argument("--heads", default="32/8,64/8")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    res = {**provenance(), "rows": []}
    for spec in args.trees or suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            w = TreeAttention(device="cuda")
            base = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            plans = {"base": base, **{v: variant(w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM), v)
                                      for v in args.variants.split(",")}}
            if plans[args.variants.split(",")[0]] is None:
                continue
            q, k, v, out, ref = case_with_reference(tree, hq, hkv)

            def run(p, o=out):
                w.run(q, k, v, p, out=o)

            row = {"tree": spec, "hq": hq, "hkv": hkv, "tree_tokens": tree.num_tokens, "strategy": base.strategy,
                   "gathered": [(ln.block_m, ln.block_n, ln.num_warps, ln.num_stages, ln.work_end - ln.work_start,
                                 ln.programs) for ln in base.launches if not ln.contig],
                   "err": checked_runs(run, plans, ref, f"{spec} {hq}/{hkv}"),
                   "us": alternating_graph_us(run, plans, args.rounds)}
            best = {name: min(t) for name, t in row["us"].items()}
            row["speedup"] = {name: best["base"] / t for name, t in best.items() if name != "base"}
            res["rows"].append(row)
            print(f"{spec[:40]:40s} {hq}/{hkv} {base.strategy:7s} base {best['base']:7.1f} "
                  + " ".join(f"{n} x{s:.3f}" for n, s in row["speedup"].items()), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
            del q, k, v, out, ref
            torch.cuda.empty_cache()
    for name in args.variants.split(","):
        print(f"{name} over base: {speedups([r['speedup'][name] for r in res['rows']])}")
    res["compiled"] = compiled_waits()
    for c in res["compiled"]:
        print("compiled:", {k: c.get(k) for k in ("regs", "shared", "stages", "warps", "waits", "error")})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
