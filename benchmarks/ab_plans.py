"""A/B timing of two versions of the library on masked plans: CUDA-graph replay latency
(``do_bench``, median, L2 flushed) of ``auto``'s plan of each case, checked against the same
tree's ``sequence`` plan.

Run it once per source tree (``PYTHONPATH=<version>/src``), alternating versions, then compare::

    python benchmarks/ab_plans.py [--heads 32/8,64/8] [--medusa 32,64,128,256] [--contexts 1024,4096] --out A1.json
    python benchmarks/ab_plans.py --compare A1.json,A2.json B1.json,B2.json

Cases: the kernel suite's trees whose ``auto`` plan applies the tree mask somewhere (with
``--every``, all of them), and Medusa verification trees (tree-structured queries) over
contexts. ``--compare`` takes each case's
fastest run per version and prints the ratio B / A per case and its geometric mean.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM
from treeattn.bench.timing import capture, provenance
from treeattn.workloads import suite_trees, tree_from_medusa, tree_from_spec


def cases(args) -> list:
    out = [(f"medusa{n}@{c}", tree_from_medusa(n, context_len=c))
           for n in map(int, args.medusa.split(",")) for c in map(int, args.contexts.split(","))]
    return out + [(s, tree_from_spec(s)) for s in suite_trees(args.suite)]


def run(args) -> None:
    import triton

    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    res = {**provenance(), "rows": []}
    for name, tree in cases(args):
        for hq, hkv in heads:
            w = TreeAttention(device="cuda")
            kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            plan = w.plan(tree, strategy="auto", **kw)
            if not args.every and not (plan.has_mask and plan.io.mask):
                continue
            q = torch.randn(tree.num_queries, hq, HEAD_DIM, device="cuda", dtype=torch.float16)
            k = torch.randn(int(tree.kv_indices.max()) + 1, 1, hkv, HEAD_DIM, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            want = w.run(q, k, v, w.plan(tree, strategy="sequence", **kw))
            out = torch.empty_like(q)
            graph = capture(w, plan, q, k, v, out)
            us = triton.testing.do_bench(graph.replay, return_mode="median", warmup=10, rep=50) * 1e3
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            if not math.isfinite(err) or err > 1e-2:
                raise SystemExit(f"{name} {hq}/{hkv}: relative L2 error {err}")
            masked = plan.io.mask // (12 * hkv)  # masked KV tile-entries a KV head
            res["rows"].append({"case": name, "hq": hq, "hkv": hkv, "strategy": plan.strategy, "us": us,
                                "masked_entries": masked, "rel_l2": err})
            print(f"{name[:48]:48s} {hq}/{hkv} {plan.strategy:8s} {us:8.1f} us  masked {masked}", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


def compare(a_files: str, b_files: str) -> None:
    def best(files):
        t = {}
        for fn in files.split(","):
            for r in json.load(open(fn))["rows"]:
                key = (r["case"], r["hq"], r["hkv"])
                t[key] = min(t.get(key, math.inf), r["us"])
        return t

    a, b = best(a_files), best(b_files)
    logs = []
    for key in a.keys() & b.keys():
        logs.append(math.log(b[key] / a[key]))
        print(f"{key[0][:48]:48s} {key[1]}/{key[2]} {a[key]:8.1f} {b[key]:8.1f}  {b[key] / a[key]:.3f}")
    print(f"geomean B/A over {len(logs)} cases: {math.exp(sum(logs) / len(logs)):.4f} "
          f"(min {math.exp(min(logs)):.3f}, max {math.exp(max(logs)):.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/8,64/8")
    ap.add_argument("--suite", default="all")
    ap.add_argument("--medusa", default="32,64,128,256")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--every", action="store_true", help="every case, not only those whose plan applies the mask")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="comma-separated JSON files of each version")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        run(args)


if __name__ == "__main__":
    main()
