"""Fit ``CostModel.tma_speedup`` (src/treeattn/plan/cost.py): how much faster than the fitted
pointer-load rates the launches run that the builder gives TMA wide tiles, where the planner
knows their items read runs of slots (the lead chunks of token trees over one context).
Session 28 fitted 2.0 here when the factor sped up a whole program; since session 34 it speeds up
a program's memory part only (bytes and fixed work, not its MMAs), at 3.0, chosen from an H200 A/B
(benchmarks/probe_cost_ab.py, NOTES.md).

For every Medusa tree of ``probe_spec.py --parts splits`` (the leads of ``paths``' 128-row tiles
cut into k chunks, timed as planned and with TMA wide tiles; H100,
results/h100_probe_spec_splits_f4f5c60.json) rebuild the k-chunk items on the CPU as ``paths``
makes them, take the time of the plan the builder makes (the TMA timing where
:func:`~treeattn.plan.addressing.tma_pays`, else the planned one) and, for each candidate speedup,
the cost model's estimate (the engine's model: launches side by side, PDL). Reports the rms log
error on the TMA plans and, per tree, the chunking the model picks against the fastest one.

    PYTHONPATH=src:benchmarks python benchmarks/fit_tma_rate.py [--results PATH] [--speedups 1,2,3,4]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import torch
from probe_spec import HKV, HQ, D, spec_tree

from treeattn import CostModel, HeadConfig
from treeattn.plan.addressing import tma_pays
from treeattn.plan.auto import estimate_items
from treeattn.plan.leads import cut_at_leads, on_runs, run_leads
from treeattn.plan.paths import _runs_known, deferred_path_tiles
from treeattn.plan.split import split_long_items


def chunk_items(tree, heads, chunk: int):
    """``paths``' 128-row tiles of ``tree``, the leads (cut at their runs) split at ``chunk`` tokens,
    marked as reading runs as ``paths`` marks them."""
    tiles = deferred_path_tiles(tree, heads, 128)
    at = run_leads(tree, tiles)
    cut, splittable = cut_at_leads(tiles, at)
    items = split_long_items(cut, np.where(splittable, chunk, np.iinfo(np.int64).max))
    return _runs_known(items, on_runs(tree, tiles, at))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="benchmarks/results/h100_probe_spec_splits_f4f5c60.json")
    ap.add_argument("--speedups", default="1,1.5,2,2.5,3,3.5,4,5")
    args = ap.parse_args()
    heads = HeadConfig(HQ, HKV, D, torch.float16)
    base = CostModel(side_streams=True, tma=True)
    rows = json.load(open(args.results))["splits"]
    cases = []
    for r in rows:
        tree = spec_tree(r["size"], r["context"], 4096)
        points = []
        for k in sorted({int(n.split("/")[0]) for n in r["variants"]} - {1}):
            items = chunk_items(tree, heads, -(-r["context"] // k))
            tiles = (items.item_len[~items.masked] + 0)  # the chunks: one launch of 128-row tiles
            tma = bool(tma_pays(tiles.size * HKV, tiles.mean(), base.num_sms))
            us = r["variants"][f"{k}/{'tma' if tma else 'planned'}"]["us"]
            points.append((k, tma, us, items))
        cases.append((f"{r['size']}@{r['context']}", tree, points))
    for s in (float(x) for x in args.speedups.split(",")):
        cost = dataclasses.replace(base, tma_speedup=s)
        errs, regrets, picks = [], [], []
        for name, tree, points in cases:
            est = [estimate_items(tree, items, heads, cost)["total"] * 1e6 for _, _, _, items in points]
            errs += [math.log(e / us) for e, (_, tma, us, _) in zip(est, points) if tma]
            pick = int(np.argmin(est))
            best = min(us for _, _, us, _ in points)
            regrets.append(points[pick][2] / best)
            picks.append(f"{name} k={points[pick][0]}{'t' if points[pick][1] else ''} {points[pick][2]:.1f}/{best:.1f}")
        rms = math.sqrt(sum(e * e for e in errs) / len(errs))
        print(f"tma_speedup {s}: rms log error {rms:.3f} on {len(errs)} TMA plans, picks within 5% "
              f"{sum(r <= 1.05 for r in regrets)}/{len(regrets)}, geomean regret "
              f"{math.exp(sum(map(math.log, regrets)) / len(regrets)):.3f}, worst {max(regrets):.3f}")
        print("   " + "; ".join(picks))


if __name__ == "__main__":
    main()
