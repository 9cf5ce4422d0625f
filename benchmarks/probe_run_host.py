"""Where an eager ``TreeAttention.run()`` spends host time now (after the launch cache): host
microseconds a call and a cProfile of the calls (GPU kept busy by a sleep, so only host time
counts), per case and side-stream setting. Prints; --out writes JSON."""
from __future__ import annotations

import argparse
import json

from treeattn.bench.kernels import case_inputs, case_run
from treeattn.bench.timing import host_profile, host_us, provenance
from treeattn.workloads import tree_from_spec

CASES = ["1,256_256,32", "1,16,64_1024,256,32", "8,16,32,256_512,512,256,32"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--out")
    args = ap.parse_args()
    hq, hkv = map(int, args.heads.split("/"))
    rows = []
    for spec in CASES:
        tree = tree_from_spec(spec)
        inputs = case_inputs(tree, hq, hkv)
        for streams in (3, 0):
            _, plan, run = case_run(tree, hq, hkv, inputs, streams=streams)
            for _ in range(3):
                run()
            us = [host_us(run, n=max(10, 200 // (len(plan.launches) + 1))) for _ in range(3)]
            prof = host_profile(run, n=max(10, 200 // (len(plan.launches) + 1)), top=22)
            rows.append({"tree": spec, "streams": streams, "launches": len(plan.launches),
                         "merged": int(plan.num_rows != tree.num_queries), "host_us": us, "profile": prof})
            print(f"{spec} streams={streams} launches={len(plan.launches)} host us {[round(x, 1) for x in us]}")
            print("\n".join(prof[:40]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "heads": args.heads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
