"""Share of the KV tile-entries the attention kernel applies the tree mask to, with per-unit mask
starts (``Plan.work_mask_start``) and without (every entry of a masked launch), on the engine's
plans: decode windows of few-shot and Tree-of-Thoughts trees, and speculative verification.

CPU only (plans are built, nothing runs). Usage::

    python benchmarks/mask_fraction.py [--window 16] [--strategies auto,sequence,node,greedy]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from treeattn import DecodingTree, HeadConfig, make_plan
from treeattn.engine.planning import StepPlanner
from treeattn.plan.plan import masked_entries
from treeattn.workloads import tree_from_medusa, tree_from_tot_template

HEADS = HeadConfig(32, 8, 128, torch.float16)  # Llama-3-8B's attention


def window_trees(window: int) -> dict:
    """``name -> (tree, first_prefix)``: trees as the engine plans them at a window's start, each
    query's node holding its next ``window - 1`` slots."""
    out = {}
    for step in (1, 100, 200, 300):  # few-shot: a 4000-token prompt and 20 sampled branches
        own = np.full(20, step)
        tree = DecodingTree.from_parents([-1] + [0] * 20, [4000] + (own + window - 1).tolist(),
                                         query_nodes=list(range(1, 21)))
        out[f"fewshot@{step}"] = (tree, own)
    for name in ("sorting", "docmerge", "keyword", "set"):  # ToT: the leaves' thoughts half written
        full = tree_from_tot_template(name)
        leaves = full.query_nodes
        own = np.maximum(1, full.lengths[leaves] // 2)
        lengths = full.lengths.copy()
        lengths[leaves] = own + window - 1
        out[f"tot-{name}"] = (DecodingTree.from_parents(full.parents, lengths, query_nodes=leaves), own)
    return out


def fractions(plan) -> tuple:
    """(masked share without mask starts, with them), of all KV tile-entries of ``plan``."""
    start, end = plan.work_kv_start.numpy(), plan.work_kv_end.numpy()
    total = int((end - start).sum())
    if not plan.has_mask:
        return 0.0, 0.0
    before = masked_entries(start, start, end, plan.launches)
    after = masked_entries(start, plan.work_mask_start.numpy(), end, plan.launches)
    return before / total, after / total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--strategies", default="auto,sequence,node,greedy")
    args = ap.parse_args(argv)
    strategies = args.strategies.split(",")
    print(f"{'plan':28s}" + "".join(f"{s:>18s}" for s in strategies))
    rows = [(name, lambda s, t=tree, f=first: StepPlanner(HEADS, strategy=s, device="cpu").plan(t, first_prefix=f))
            for name, (tree, first) in window_trees(args.window).items()]
    for size in ("32", "64", "128"):
        for ctx in (1000, 4000):
            tree = tree_from_medusa(size, context_len=ctx)
            rows.append((f"speculative-{size}@{ctx}", lambda s, t=tree: make_plan(t, HEADS, strategy=s)))
    for name, plan_of in rows:
        cells = []
        for s in strategies:
            before, after = fractions(plan_of(s))
            cells.append(f"{100 * before:6.1f}% -> {100 * after:5.1f}%")
        print(f"{name:28s}" + "".join(f"{c:>18s}" for c in cells))


if __name__ == "__main__":
    main()
