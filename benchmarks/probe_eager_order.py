"""Why eager `auto` latencies of multi-launch plans read 2-3x higher in an all-strategy
`bench kernels` run than in an `auto`-only one (session 23): eager `auto` of a few suite cases
timed (a) first in a fresh state, (b) after the other seven strategies of the previous case ran
as `bench kernels` runs them, (c) as (b) with `gc.collect()` first, (d) as (b) with the garbage
collector off while timing; then without side streams (serial launches, and programmatic
dependent launches) and once more as (a). Run it with and without CUDA_DEVICE_MAX_CONNECTIONS=32. Prints a table; --out writes JSON."""
from __future__ import annotations

import argparse
import gc
import json
import os

import torch
import triton

from treeattn.bench.kernels import case_inputs, case_run
from treeattn.bench.timing import provenance, time_run
from treeattn.plan import STRATEGIES
from treeattn.workloads import tree_from_spec

CASES = ["1,16,64_1024,256,32", "1,4,8,256_8,256,256,32", "8,16,32,256_512,512,256,32", "1,2,64_8,256,32",
         "1,256_256,32"]


def eager_auto(spec: str, hq: int, hkv: int, streams: int = 3, pdl: bool = False) -> float:
    tree = tree_from_spec(spec)
    _, _, run = case_run(tree, hq, hkv, case_inputs(tree, hq, hkv), streams=streams, pdl=pdl)
    return triton.testing.do_bench(run, return_mode="median") * 1e3


def other_strategies(spec: str, hq: int, hkv: int) -> None:
    """The previous case's strategies, timed as bench kernels times them (eager, then a graph)."""
    tree = tree_from_spec(spec)
    inputs = case_inputs(tree, hq, hkv)
    for s in STRATEGIES[1:]:
        w, plan, _ = case_run(tree, hq, hkv, inputs, strategy=s, streams=3)
        time_run(w, plan, *inputs)
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--out")
    args = ap.parse_args()
    hq, hkv = map(int, args.heads.split("/"))
    rows = []
    for spec in CASES:
        eager_auto(spec, hq, hkv)  # compile
        row = {"tree": spec, "fresh": eager_auto(spec, hq, hkv)}
        other_strategies(spec, hq, hkv)
        row["after_others"] = eager_auto(spec, hq, hkv)
        other_strategies(spec, hq, hkv)
        gc.collect()
        row["after_others_gc_collect"] = eager_auto(spec, hq, hkv)
        other_strategies(spec, hq, hkv)
        gc.disable()
        row["after_others_gc_off"] = eager_auto(spec, hq, hkv)
        gc.enable()
        row["serial"] = eager_auto(spec, hq, hkv, streams=0)
        row["pdl"] = eager_auto(spec, hq, hkv, streams=0, pdl=True)
        row["again"] = eager_auto(spec, hq, hkv)
        rows.append(row)
        print(f"{spec:32s} " + " ".join(f"{k} {v:7.1f}" for k, v in row.items() if isinstance(v, float)), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "heads": args.heads, "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
