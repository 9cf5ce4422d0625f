"""Eager ``run()`` of a few kernel-suite plans: host time a call (GPU kept busy) and do_bench
latency, for A/B runs of two versions (run under each ``PYTHONPATH`` in turn), and the size of
the plan's launch cache after repeated runs where the version has one.

    python benchmarks/probe_launch_ab.py [--heads 32/8,64/8] --out ab.json
"""
from __future__ import annotations

import argparse
import json

import triton

from treeattn.bench.kernels import case_inputs, case_run
from treeattn.bench.timing import host_us, provenance
from treeattn.workloads import tree_from_spec

CASES = ["1,256_256,32", "1,10_4096,416", "1,4,16,512_1024,256,128,32", "1,16,64_1024,256,32",
         "8,16,32,256_512,512,256,32", "1,2,4,8,16,32,64,128,1024_16,16,16,16,16,16,16,16,16"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/8,64/8")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    res = {**provenance(), "rows": []}
    for spec in CASES:
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            _, plan, run = case_run(tree, hq, hkv, case_inputs(tree, hq, hkv))
            for _ in range(10):
                run()
            host = min(host_us(run, 200) for _ in range(3))
            eager = triton.testing.do_bench(run, return_mode="median") * 1e3
            kept = len(plan.__dict__.get("_launch_cache", {}))
            res["rows"].append({"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy,
                                "launches": len(plan.launches), "host_us": host, "eager_us": eager,
                                "kept_kernels": kept})
            print(f"{spec[:34]:34s} {hq}/{hkv} {plan.strategy:8s} launches {len(plan.launches)} "
                  f"host {host:6.1f} us eager {eager:6.1f} us kept {kept}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
