"""Probe: plans with and without the persistent tall launch (``plan.addressing.persistent_tall``).

The rule runs a plan's one gathered tall launch over one program a SM where the leaf launches
after it read enough more KV, so that they run beside it (with PDL every launch's programs start
only once the launch before has started all of its), and drops the last launch's fold for the
merge launch. Session 35's probes set the rule from variants of ``auto``'s plans (at f2e533c:
``h200_probe_tall_room.json``); this times the plans the builder makes, with the rule and with
it switched off (the builder's ``persistent_tall`` replaced by the identity), alternately twice
in one process under CUDA-graph replay, and checks both against the fp32 reference.

Usage::

    python benchmarks/probe_persist.py [--trees ...] [--heads 32/8,64/8] [--strategies auto] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import math

import torch
from check_gpu import alternating_graph_us, checked_error, reference_fp32

import treeattn.plan.build as build
from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import provenance
from treeattn.workloads import tree_from_spec

TREES = ("1,8,512_32,512,256", "1,8,512_512,512,256", "1,8,512_32,2048,256",
         "1,4,16,64,256,1024_256,8,256,64,32,256", "1,4,16,64,256,1024_256,32,256,64,32,256",
         "1,4,16,512_1024,256,128,32")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="*", default=list(TREES))
    ap.add_argument("--heads", default="32/8,64/8")
    ap.add_argument("--strategies", default="auto")
    ap.add_argument("--out")
    args = ap.parse_args()
    rule = build.persistent_tall
    res = {**provenance(), "rows": []}
    for spec in args.trees:
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            q, k, v, out = case_inputs(tree, hq, hkv)
            ref = reference_fp32(q, k[:, 0], v[:, 0], tree, HEAD_DIM ** -0.5)
            for strategy in args.strategies.split(","):
                w = TreeAttention(device="cuda")
                plans = {}
                for name, fn in (("on", rule), ("off", lambda launches, *a, **kw: tuple(launches))):
                    build.persistent_tall = fn
                    plans[name] = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM,
                                         strategy=strategy)
                build.persistent_tall = rule
                if not any(ln.programs for ln in plans["on"].launches):
                    continue
                row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plans["on"].strategy,
                       "explain": plans["on"].explain(), "err": {}}
                for name, p in plans.items():
                    o = torch.empty_like(out)
                    w.run(q, k, v, p, out=o)
                    torch.cuda.synchronize()
                    row["err"][name] = checked_error(o, ref, f"{spec} {hq}/{hkv} {strategy} {name}")
                row["us"] = alternating_graph_us(lambda p: w.run(q, k, v, p, out=out), plans, 2)
                row["speedup"] = min(row["us"]["off"]) / min(row["us"]["on"])
                res["rows"].append(row)
                print(f"{spec[:40]:40s} {hq}/{hkv} {row['strategy']:7s} on {row['us']['on']} off {row['us']['off']} "
                      f"x{row['speedup']:.3f} err {row['err']['on']:.1e}", flush=True)
    g = [r["speedup"] for r in res["rows"]]
    if g:
        print(f"{len(g)} plans: geomean x{math.exp(sum(map(math.log, g)) / len(g)):.3f} [{min(g):.3f}, {max(g):.3f}]")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
