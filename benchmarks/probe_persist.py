"""Probe: plans with the persistent tall launch rule (``plan.addressing.persistent_tall``) of this
checkout against another version's rule, or against none.

The rule runs a plan's largest tall launch persistent where the leaf launches after it read
enough more KV, so that they run beside it (with PDL every launch's programs start only once the
launch before has started all of its), and drops the last launch's fold for the merge launch.
This plans every case with this checkout's rule (``on``), with the rule switched off (``off``:
the builder's ``persistent_tall`` replaced by the identity) and, with ``--baseline FILE`` (an
``addressing.py`` of another version, e.g. ``git show HEAD~1:src/treeattn/plan/addressing.py``),
with that version's rule (``base``); it times the plans of the cases where ``on`` differs from
the others alternately over ``--rounds`` rounds in one process under CUDA-graph replay and checks
each against the fp32 reference.

Usage::

    python benchmarks/probe_persist.py [--trees ...] [--all] [--heads 32/8,64/8] [--baseline FILE] [--out FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json

import torch
from check_gpu import alternating_graph_us, case_with_reference, checked_runs, speedups
from probe_direct_saving import trees as shaped_trees

import treeattn.plan.build as build
from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM
from treeattn.bench.timing import provenance
from treeattn.workloads import tree_from_spec

TREES = ("1,8,512_32,512,256", "1,8,512_512,512,256", "1,8,512_32,2048,256",
         "1,4,16,64,256,1024_256,8,256,64,32,256", "1,4,16,64,256,1024_256,32,256,64,32,256",
         "1,4,16,512_1024,256,128,32")


def baseline_rule(path: str):
    """``persistent_tall`` of the ``addressing.py`` at ``path``, given only the keyword arguments
    it takes of those the builder passes."""
    spec = importlib.util.spec_from_file_location("baseline_addressing", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    takes = inspect.signature(mod.persistent_tall).parameters
    return lambda *args, **kw: mod.persistent_tall(*args, **{k: v for k, v in kw.items() if k in takes})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="*", default=list(TREES))
    ap.add_argument("--all", action="store_true",
                    help="the suite's and probe_direct_saving's Medusa-, few-shot- and ToT-shaped trees")
    ap.add_argument("--heads", default="32/8,64/8")
    ap.add_argument("--strategies", default="auto")
    ap.add_argument("--baseline")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    rules = {"on": build.persistent_tall, "off": lambda launches, *a, **kw: tuple(launches)}
    if args.baseline:
        rules["base"] = baseline_rule(args.baseline)
    cases = shaped_trees() if args.all else ((s, lambda s=s: tree_from_spec(s)) for s in args.trees)
    res = {**provenance(), "baseline": args.baseline, "planned": 0, "rows": []}
    for name, make in cases:
        tree = make()
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            for strategy in args.strategies.split(","):
                w = TreeAttention(device="cuda")
                plans = {}
                for key, fn in rules.items():
                    build.persistent_tall = fn
                    plans[key] = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM,
                                        strategy=strategy)
                build.persistent_tall = rules["on"]
                res["planned"] += 1
                on = plans["on"]
                plans = {"on": on} | {k: p for k, p in plans.items()
                                      if (p.launches, p.merge_launch) != (on.launches, on.merge_launch)}
                if len(plans) == 1:
                    continue
                q, k, v, out, ref = case_with_reference(tree, hq, hkv)
                row = {"tree": name, "hq": hq, "hkv": hkv, "strategy": on.strategy, "explain": on.explain(),
                       "programs": {key: [ln.programs for ln in p.launches] for key, p in plans.items()},
                       "err": checked_runs(lambda p, o: w.run(q, k, v, p, out=o), plans, ref,
                                           f"{name} {hq}/{hkv} {strategy}")}
                row["us"] = alternating_graph_us(lambda p: w.run(q, k, v, p, out=out), plans, args.rounds)
                row["speedup"] = {key: min(ts) / min(row["us"]["on"]) for key, ts in row["us"].items() if key != "on"}
                res["rows"].append(row)
                print(f"{name[:40]:40s} {hq}/{hkv} {row['strategy']:7s} {row['programs']} "
                      + " ".join(f"{key} {min(ts):.1f}" for key, ts in row["us"].items())
                      + " " + " ".join(f"x{key} {s:.3f}" for key, s in row["speedup"].items()), flush=True)
                del q, k, v, out, ref
                torch.cuda.empty_cache()
    for key in rules:
        g = [r["speedup"][key] for r in res["rows"] if key in r["speedup"]]
        if g:
            print(f"on over {key}: {len(g)} plans, {speedups(g)}")
    print(f"{len(res['rows'])} of {res['planned']} plans differ")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
