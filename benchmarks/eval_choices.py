"""``auto``'s choices under this checkout's cost model, read against a run of every strategy.

``treeattn bench kernels`` (all strategies) times each strategy's plan of every suite case in one
process. ``auto`` rates the same candidates (the ``paths``, leaf-packing and ``sequence`` variants
it weighs are the ones each strategy takes on its own), so a changed cost model's choices can be
scored on the CPU against those timings: for each case the chosen strategy's measured time over
the fastest strategy's. Prints the cases more than 5% off, the count within 5% and the worst
ratio, and per head config and strategy the mean and spread of log(estimate / measured).

    PYTHONPATH=src python benchmarks/eval_choices.py benchmarks/results/kernels_all_strategies_h200_*.json

The cost model is the one the wrapper builds on an H200 (TMA, PDL, one stream); ``--set
name=value`` changes a constant (e.g. ``--set direct_saving_pdl_s=6e-6``: a direct plan credited
6 us, as before PDL launches were rated; a tile as ``--set tile_tall_contig=[32,4,2]``).
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np

from treeattn.plan import CostModel, HeadConfig, make_plan
from treeattn.plan.select.profiles import H200, DeviceProfile
from treeattn.tree import tree_by_name

HIT = 1.05
HEAD_DIM = 128


def evaluate(rows: list, cost: CostModel) -> tuple[list, dict]:
    """``[(tree, hq, hkv, chosen strategy, measured / fastest)]`` and ``{(hq, hkv, strategy):
    [log(estimate / measured)]}`` for ``rows`` of ``bench kernels`` results."""
    choices, errors = [], {}
    for r in rows:
        heads = HeadConfig(r["hq"], r["hkv"], HEAD_DIM)
        plan = make_plan(tree_by_name(r["tree"]), heads, strategy="auto", cost=cost)
        measured = {s: t for s, t in r["graph_us"].items() if s != "auto"}
        choices.append((r["tree"], r["hq"], r["hkv"], plan.strategy,
                        measured[plan.strategy] / min(measured.values())))
        for s, est in plan.candidates:
            errors.setdefault((r["hq"], r["hkv"], s), []).append(math.log(est * 1e6 / measured[s]))
    return choices, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="bench kernels JSON files timing every strategy")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a DeviceProfile constant to change, the value as JSON (repeatable)")
    args = ap.parse_args()
    rows = [r for path in args.results for r in json.load(open(path))["rows"]]
    changes = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    # (through from_json: tiles given as lists become tuples, and bad values are named)
    profile = DeviceProfile.from_json(json.dumps({**json.loads(H200.to_json()), **changes}), source="--set")
    cost = CostModel(tma=True, pdl=True, side_streams=True, profile=profile)
    choices, errors = evaluate(rows, cost)
    for tree, hq, hkv, strategy, ratio in choices:
        if ratio > HIT:
            print(f"{tree[:44]:44s} {hq}/{hkv} {strategy:10s} {ratio:.3f}x the fastest")
    worst = max(choices, key=lambda c: c[4])
    print(f"within {HIT - 1:.0%} of the fastest on {sum(c[4] <= HIT for c in choices)}/{len(choices)}, "
          f"worst {worst[4]:.3f}x ({worst[0]} {worst[1]}/{worst[2]} {worst[3]})")
    for (hq, hkv, s), e in sorted(errors.items()):
        print(f"{hq}/{hkv} {s:10s} log(estimate / measured) mean {np.mean(e):+.3f} sd {np.std(e):.3f} ({len(e)} cases)")


if __name__ == "__main__":
    main()
