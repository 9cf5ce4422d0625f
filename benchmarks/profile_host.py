"""Host cost of ``TreeAttention.run`` on a GPU: where the eager-minus-graph latency goes.

For a few kernel-suite cases and strategies it reports the launches per run, the host time to
issue one ``run()`` while the GPU is kept busy (so only the host is measured), the do_bench eager
and graph-replay latencies, and a cProfile of many runs (top functions by own time). Writes JSON.

    TREEATTN_SHARED=<shared> python benchmarks/profile_host.py --out host.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

try:
    import treeattn  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from treeattn.bench.kernels import case_inputs, case_run
from treeattn.bench.timing import capture, host_profile, host_us
from treeattn.workloads import tree_from_spec

CASES = ["1,2,64_8,256,32", "1,256_256,32", "8,16,32,256_512,512,256,32",
         "1,2,4,8,16,32,64,128,1024_16,16,16,16,16,16,16,16,16"]


def main(argv=None) -> int:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--strategies", default="sequence,node,flatten,greedy")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    rows = []
    for spec in CASES:
        tree = tree_from_spec(spec)
        inputs = case_inputs(tree, hq, hkv)
        for strategy in args.strategies.split(","):
            w, plan, run = case_run(tree, hq, hkv, inputs, strategy=strategy)
            run()
            h = host_us(run)
            eager = triton.testing.do_bench(run, return_mode="median") * 1e3
            graph = capture(w, plan, *inputs)
            replay = triton.testing.do_bench(graph.replay, return_mode="median") * 1e3
            profile = host_profile(run, 50, 14)
            merges = int(plan.merge_q_indices.numel() > 0)  # no merge launch without merged queries
            row = {"tree": spec, "strategy": strategy, "launches": len(plan.launches) + merges,
                   "host_us_per_run": h, "eager_us": eager, "graph_us": replay,
                   "profile": profile[-24:]}
            rows.append(row)
            print(f"{spec[:30]:30s} {strategy:9s} launches {row['launches']:2d} host {h:7.1f} us "
                  f"eager {eager:7.1f} graph {replay:7.1f}", flush=True)
    print("\n".join(rows[-1]["profile"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "triton": triton.__version__, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
