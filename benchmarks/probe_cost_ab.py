"""``auto``'s plans under two cost models, timed in one process (one GPU call).

A cost-model change moves a few choices; this times, for each case, ``auto``'s plan under the
wrapper's default model (A) and under the same model with ``--b`` fields replaced (B), alternating
A and B twice, under CUDA-graph replay in ``bench kernels``' launch mode (``do_bench`` median, L2
flushed), outputs checked against each other. Cases are suite trees (``SPEC:HQ/HKV``) and Medusa
token trees over a context laid out as the engine lays it out (``medusaN@CTX``, 32/8).

    python benchmarks/probe_cost_ab.py --b tma_speedup=2 [--cases 1,2,64_1024,256,256:64/8 medusa128@800 ...] [--out FILE]

(Session 34 ran it at 92dfc35-7e37e90 with ``--b tma_memory_only=1,tma_speedup=3``, a field
that since became the model's only TMA rating: results/h200_probe_cost_ab_*.json.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

from treeattn import CostModel, TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import graph_us, provenance
from treeattn.workloads import tree_from_spec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_spec import spec_tree  # noqa: E402 (the engine's layout of a Medusa tree)


def parse_fields(text: str) -> dict:
    """``"a=1,b=2.5"`` -> CostModel fields, each converted to its field's type."""
    types = {f.name: f.type for f in dataclasses.fields(CostModel)}
    out = {}
    for kv in text.split(","):
        key, value = kv.split("=")
        kind = types[key]
        out[key] = bool(int(value)) if kind in (bool, "bool") else int(value) if kind in (int, "int") else float(value)
    return out


def case_tree(case: str) -> tuple:
    """``(tree, hq, hkv, q, k, v, out)`` of a case name."""
    if case.startswith("medusa"):
        size, ctx = (int(x) for x in case[len("medusa"):].split("@"))
        scratch = ctx + 64
        tree, hq, hkv = spec_tree(size, ctx, scratch), 32, 8
        k = torch.randn(scratch + 512, 1, hkv, HEAD_DIM, device="cuda", dtype=torch.float16)
        q = torch.randn(tree.num_queries, hq, HEAD_DIM, device="cuda", dtype=torch.float16)
        return tree, hq, hkv, q, k, torch.randn_like(k), torch.empty_like(q)
    spec, heads = case.split(":")
    hq, hkv = (int(x) for x in heads.split("/"))
    tree = tree_from_spec(spec)
    return (tree, hq, hkv, *case_inputs(tree, hq, hkv))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b", required=True, help="CostModel fields of model B, e.g. tma_speedup=1.5")
    ap.add_argument("--cases", nargs="+", required=True)
    ap.add_argument("--out")
    args = ap.parse_args()
    fields = parse_fields(args.b)
    res = {**provenance(), "b": fields, "rows": []}
    for case in args.cases:
        tree, hq, hkv, q, k, v, out = case_tree(case)
        wa = TreeAttention(device="cuda")
        wb = TreeAttention(device="cuda", cost=dataclasses.replace(wa.cost, **fields))
        plans = {name: (w, w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM))
                 for name, w in (("a", wa), ("b", wb))}
        row = {"case": case, "us": {"a": [], "b": []},
               "plans": {n: {"strategy": p.strategy, "explain": p.explain()} for n, (_, p) in plans.items()}}
        ref = None
        for _ in range(2):
            for name, (w, p) in plans.items():
                row["us"][name].append(graph_us(lambda: w.run(q, k, v, p, out=out)))
                if ref is None:
                    ref = out.float().clone()
                elif not float((out.float() - ref).abs().max()) <= 5e-3:
                    raise SystemExit(f"{case} {name}: output differs")
        res["rows"].append(row)
        a, b = min(row["us"]["a"]), min(row["us"]["b"])
        print(f"{case}: A {row['plans']['a']['strategy']} {a:.1f} us, B {row['plans']['b']['strategy']} {b:.1f} us "
              f"({a / b:.3f}x)", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
