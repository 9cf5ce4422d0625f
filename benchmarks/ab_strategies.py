"""A/B timing of two versions of the library on chosen (tree, heads, strategy) cases of the kernel
suite, timed as ``treeattn bench kernels`` times them (``bench_case``: eager and CUDA-graph replay,
``do_bench`` median, L2 flushed). The case list is what differs between the versions' plans, so
only changed plans are timed.

List the cases whose launches differ (on the host; no GPU), once per version, then compare::

    PYTHONPATH=<A>/src python benchmarks/ab_strategies.py --dump-launches A.pkl
    PYTHONPATH=<B>/src python benchmarks/ab_strategies.py --dump-launches B.pkl
    python benchmarks/ab_strategies.py --diff A.pkl B.pkl --cases cases.json

Time each version on the GPU (alternate them: A, B, A, ...), then compare::

    PYTHONPATH=<A>/src python benchmarks/ab_strategies.py --cases cases.json --out A1.json
    python benchmarks/ab_strategies.py --compare A1.json,A2.json B1.json

``--compare`` takes each case's fastest graph replay per version and prints B / A per case and
the geometric mean per strategy.
"""
from __future__ import annotations

import argparse
import json
import math
import pickle
from collections import defaultdict

STRATEGIES = ("flatten", "node_chunk", "node", "pack", "greedy", "paths", "auto")
HEADS = ((32, 32), (32, 8), (64, 8))


def dump_launches(path: str) -> None:
    """Every suite case's launches per strategy (host planning, no TMA), pickled."""
    from treeattn import TreeAttention
    from treeattn.bench.kernels import HEAD_DIM
    from treeattn.workloads import suite_trees, tree_from_spec

    out = {}
    for spec in suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in HEADS:
            for s in STRATEGIES:
                p = TreeAttention(device="cpu").plan(tree, num_qo_heads=hq, num_kv_heads=hkv,
                                                     head_dim=HEAD_DIM, strategy=s)
                out[(spec, hq, hkv, s)] = (p.strategy, tuple(
                    (ln.block_m, ln.block_n, ln.num_warps, ln.num_stages, ln.contig, ln.tma, ln.work_start,
                     ln.work_end) for ln in p.launches))
    with open(path, "wb") as f:
        pickle.dump(out, f)


def diff(a_path: str, b_path: str, cases_path: str) -> None:
    with open(a_path, "rb") as f:
        a = pickle.load(f)
    with open(b_path, "rb") as f:
        b = pickle.load(f)
    changed = sorted(k for k in a if a[k] != b.get(k))
    with open(cases_path, "w") as f:
        json.dump([list(k) for k in changed], f)
    print(f"{len(changed)} of {len(a)} (tree, heads, strategy) plans differ -> {cases_path}")


def time_cases(cases_path: str, out: str) -> None:
    from treeattn.bench.kernels import bench_case
    from treeattn.bench.timing import provenance

    with open(cases_path) as f:
        cases = json.load(f)
    by_case = defaultdict(list)
    for spec, hq, hkv, s in cases:
        by_case[(spec, hq, hkv)].append(s)
    res = {**provenance(), "rows": []}
    for (spec, hq, hkv), strategies in by_case.items():
        row = bench_case(spec, hq, hkv, strategies, 1.0, {})
        res["rows"].append({k: row[k] for k in ("tree", "hq", "hkv", "us", "graph_us")})
        print(spec, f"{hq}/{hkv}", {s: round(row["graph_us"][s], 1) for s in strategies}, flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def compare(a_files: str, b_files: str) -> None:
    def best(files):
        t = {}
        for path in files.split(","):
            with open(path) as f:
                for r in json.load(f)["rows"]:
                    for s, us in r["graph_us"].items():
                        key = (r["tree"], f"{r['hq']}/{r['hkv']}", s)
                        t[key] = min(t.get(key, math.inf), us)
        return t

    a, b = best(a_files), best(b_files)
    ratios = defaultdict(list)
    for key in sorted(a.keys() & b.keys()):
        ratios[key[2]].append(b[key] / a[key])
        print(f"{key[0]:60s} {key[1]:6s} {key[2]:10s} {a[key]:8.1f} -> {b[key]:8.1f} us  {b[key] / a[key]:.3f}")
    for s, r in ratios.items():
        print(f"{s}: geomean B/A {math.exp(sum(map(math.log, r)) / len(r)):.3f} over {len(r)} "
              f"({min(r):.3f}-{max(r):.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump-launches", metavar="PKL")
    ap.add_argument("--diff", nargs=2, metavar=("A", "B"))
    ap.add_argument("--cases", help="JSON list of [tree, hq, hkv, strategy]")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="comma-separated JSON files of each version")
    args = ap.parse_args()
    if args.dump_launches:
        dump_launches(args.dump_launches)
    elif args.diff:
        diff(*args.diff, args.cases)
    elif args.compare:
        compare(*args.compare)
    else:
        time_cases(args.cases, args.out)


if __name__ == "__main__":
    main()
