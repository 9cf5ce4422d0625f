"""Probe: whole-plan latency of ``auto`` with gathered slots and with the contig rule
(:func:`treeattn.plan.plan.contig_launches`). Session 10 compared three rules this way
(results/h200_probe_contig_rule.json: counting each launch's programs alone, all the plan's
programs, and the latter with a full pipeline only in one wave); the library keeps the first.

Usage (H200)::

    python benchmarks/probe_contig_rule.py --out benchmarks/results/h200_probe_contig_rule.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import torch

from probe_contig import HEADS
from treeattn import TreeAttention
from treeattn.bench.kernels import case_inputs
from treeattn.bench.timing import graph_us
from treeattn.plan.addressing import contig_launches, unit_runs
from treeattn.workloads import suite_trees, tree_from_spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for spec in suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in HEADS:
            q, k, v, out = case_inputs(tree, hq, hkv)
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128)
            h = plan.host
            runs = unit_runs(h.kv_slots, h.work_kv_start, h.work_kv_end)
            variants = {"gather": h.gather_launches,
                        "contig": contig_launches(h.gather_launches, runs, hkv, h.num_sms,
                                                  has_mask=plan.has_mask, elem_bytes=2)}
            row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy, "us": {}}
            for name, launches in variants.items():
                p = dataclasses.replace(plan, launches=launches)
                row["us"][name] = graph_us(lambda p=p: w.run(q, k, v, p, out=out))
            rows.append(row)
            u = row["us"]
            print(f"{spec[:44]:44s} {hq}/{hkv} {plan.strategy:10s} gather {u['gather']:8.1f} "
                  f"contig x{u['gather'] / u['contig']:.3f}", flush=True)
    for name in ("contig",):
        for hq, hkv in HEADS:
            r = [x["us"]["gather"] / x["us"][name] for x in rows if (x["hq"], x["hkv"]) == (hq, hkv)]
            print(name, f"{hq}/{hkv}", "geomean", float(np.exp(np.mean(np.log(r)))), "min", min(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
