"""Probe: the attention kernel of this checkout against another version of
``treeattn/kernels/attention.py`` (``--baseline FILE``), the same plans timed alternately in one
process.

Each case's ``auto`` plan is made twice (two plans, two launch caches); ``treeattn.ops`` launches
the baseline's ``_tree_partial_attention_kernel`` for one and this checkout's for the other
(:func:`check_gpu.patched_ab`). Both outputs are checked against an fp32 reference; times are
CUDA-graph replays (L2 flushed), each plan once a round over ``--rounds`` rounds, and the best
round of each is compared.

Usage::

    python benchmarks/probe_kernel_ab.py --baseline OLD_attention.py [--trees ...] [--heads 32/8,64/8]
                                         [--rounds 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import json

from check_gpu import patched_ab, speedups

import treeattn.ops as ops
from treeattn.bench.timing import provenance
from treeattn.workloads import suite_trees, tree_from_spec


def load_kernel(path: str):
    """``_tree_partial_attention_kernel`` of the module at ``path`` (its imports resolve in this
    checkout's package)."""
    spec = importlib.util.spec_from_file_location("baseline_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._tree_partial_attention_kernel


def summary(rows: list) -> None:
    """Print the speedups of ``rows`` over all, by head config and over the >= 100K-token trees."""
    print(f"new over base: {len(rows)} plans, {speedups([r['speedup'] for r in rows])}")
    for hq, hkv in sorted({(r["hq"], r["hkv"]) for r in rows}):
        some = [r["speedup"] for r in rows if (r["hq"], r["hkv"]) == (hq, hkv)]
        print(f"  {hq}/{hkv}: {len(some)} plans, {speedups(some)}")
    big = [r["speedup"] for r in rows if r["tree_tokens"] >= 100_000]
    if big:
        print(f"  >= 100K tokens: {len(big)} plans, {speedups(big)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="another version of kernels/attention.py")
    ap.add_argument("--trees", nargs="*", default=None, help="suite specs (default: the whole suite)")
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    name = "_tree_partial_attention_kernel"
    patches = {"base": {name: load_kernel(args.baseline)}, "new": {name: getattr(ops, name)}}
    res = {**provenance(), "baseline": args.baseline, "rows": []}
    for spec in args.trees or suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            row = patched_ab(tree, spec, hq, hkv, patches, args.rounds, ops)
            row["speedup"] = min(row["us"]["base"]) / min(row["us"]["new"])
            res["rows"].append(row)
            print(f"{spec[:40]:40s} {hq}/{hkv} {row['strategy']:8s} base {min(row['us']['base']):8.1f} "
                  f"new {min(row['us']['new']):8.1f} x{row['speedup']:.3f}", flush=True)
            if args.out:  # (after every case: a probe cut short keeps what it measured)
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
    summary(res["rows"])


if __name__ == "__main__":
    main()
