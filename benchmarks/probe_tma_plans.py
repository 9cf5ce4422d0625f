"""Probe: TMA loads (``Launch.tma``) in the real kernel, per suite plan.

probe_tma.py found tensor-descriptor loads 1.00-1.15x faster than pointer loads on standalone
tall tiles at equal configs, and 128-token KV tiles with 8 warps best with them (1.22-1.49x over
the planned 32/4/3 tile). This times ``auto``'s plan of every suite case (or ``--trees``) whose
TMA-enabled plan has a TMA launch, under CUDA-graph replay, with the launches of
``TreeAttention(tma=False)`` (``off``) and of ``TreeAttention(tma=True)`` (``on``), ``on`` for
the TILE_TALL_TMA launches only (``tall``) and for the others only (``rest``), and TMA on the tall
launches at their pointer config (``same``), and checks each variant's output against ``off``
(relative L2). (Which launches ``on`` covers is the planner's rule at the time: every contig
launch in the first two runs, NOTES.md session 19; the long tall ones since edbc4ea.)

Usage (H200)::

    python benchmarks/probe_tma_plans.py --out benchmarks/results/h200_probe_tma_plans.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import case_inputs
from treeattn.bench.timing import graph_us, provenance
from treeattn.plan.addressing import TILE_TALL_TMA
from treeattn.workloads import suite_trees, tree_from_spec

HEADS = ((32, 32), (32, 8), (64, 8))


def is_tall(ln) -> bool:
    return ln.tma and (ln.block_n, ln.num_warps, ln.num_stages) == TILE_TALL_TMA


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--trees", nargs="*", default=None, help="tree specs (default: the kernel suite)")
    args = ap.parse_args()
    rows = []
    for spec in args.trees or suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in HEADS:
            q, k, v, out = case_inputs(tree, hq, hkv)
            w_on = TreeAttention(device="cuda", tma=True)
            w_off = TreeAttention(device="cuda", tma=False)
            kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, strategy=args.strategy)
            on = w_on.plan(tree, **kw)
            off = w_off.plan(tree, **kw)
            if not any(ln.tma for ln in on.launches):
                continue
            variants = {
                "off": off, "on": on,
                "tall": dataclasses.replace(on, launches=tuple(
                    a if is_tall(a) else b for a, b in zip(on.launches, off.launches))),
                "rest": dataclasses.replace(on, launches=tuple(
                    b if is_tall(a) else a for a, b in zip(on.launches, off.launches))),
                # TMA everywhere, but the tall launches at their pointer config
                "same": dataclasses.replace(on, launches=tuple(
                    dataclasses.replace(b, tma=True) if is_tall(a) else a for a, b in zip(on.launches, off.launches))),
            }
            row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": on.strategy, "us": {}, "rel": {},
                   "launches": [[ln.block_m, ln.block_n, ln.num_warps, ln.num_stages, ln.contig, ln.tma,
                                 ln.split_tail, ln.work_end - ln.work_start] for ln in on.launches]}
            ref = None
            for name, plan in variants.items():
                if name in ("tall", "rest", "same") and plan.launches in (on.launches, off.launches):
                    continue
                o = torch.empty_like(out)
                w_off.run(q, k, v, plan, out=o)
                if ref is None:
                    ref = o.float()
                row["rel"][name] = float((o.float() - ref).norm() / ref.norm())
                row["us"][name] = graph_us(lambda: w_off.run(q, k, v, plan, out=o))
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("tree", "hq", "hkv", "strategy", "us", "rel")}), flush=True)
    summary = {}
    for name in ("on", "tall", "rest", "same"):
        for hq, hkv in HEADS:
            r = [x["us"]["off"] / x["us"][name] for x in rows if name in x["us"] and (x["hq"], x["hkv"]) == (hq, hkv)]
            if r:
                summary[f"{name} {hq}/{hkv}"] = {"n": len(r), "geomean_speedup": math.exp(sum(map(math.log, r)) / len(r)),
                                                 "min": min(r), "max": max(r)}
    for k_, v_ in summary.items():
        print(k_, json.dumps(v_))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
