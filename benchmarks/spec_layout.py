"""How many KV tokens of the engine's speculative plans go through affine-address (contig) launches?

Runs a speculative workload through :class:`~treeattn.engine.engine.TreeEngine` on the CPU with
the tiny random model, keeps every ``--every``-th tree the engine plans, and plans each again
with Llama-3-8B's heads (32/8, head_dim 128, bf16) and the engine's cost model (launches one after
another with PDL, TMA). Reports the strategies and the share of KV tokens in contig launches, for
the engine's slot layout and for the same trees with the context relaid as one run of slots.
A launch takes affine addresses only when each of its work units is one run of slots.

Usage::

    python benchmarks/spec_layout.py [--workload speculative-32] [--steps 700] [--every 10]
"""
from __future__ import annotations

import argparse
import collections

import numpy as np
import torch

from treeattn import CostModel, DecodingTree, HeadConfig
from treeattn.engine.engine import TreeEngine
from treeattn.engine.model import TreeModel
from treeattn.engine.workloads import WorkloadSpec, build_workload
from treeattn.plan import make_plan


def one_run(tree: DecodingTree) -> DecodingTree:
    """``tree`` with node 0 (the context) in slots ``0..n-1`` and the other nodes' tokens after."""
    kv = tree.kv_indices.copy()
    n0 = int(tree.lengths[0])
    kv[:n0] = np.arange(n0)
    kv[n0:] = int(kv.max()) + 1 + np.arange(kv.size - n0)
    return DecodingTree.from_parents(tree.parents, tree.lengths, kv_indices=kv, query_nodes=tree.query_nodes,
                                     query_prefix=tree.query_prefix)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="speculative-32")
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args()
    model = TreeModel.random("tiny", device=torch.device("cpu"), dtype=torch.float32, seed=0)
    engine = TreeEngine(model, strategy="auto")
    ctl, _ = build_workload(WorkloadSpec(name=args.workload, vocab_size=model.config.vocab_size, seed=0))
    trees, plan = [], engine.planner.plan

    def keep(tree, **kw):
        trees.append(tree)
        return plan(tree, **kw)

    engine.planner.plan = keep
    engine.run(ctl, max_steps=args.steps)
    heads = HeadConfig(32, 8, 128, torch.bfloat16)
    cost = CostModel(side_streams=True, tma=True)
    for layout, relaid in (("engine", lambda t: t), ("context one run", one_run)):
        tokens = contig = 0
        chosen = collections.Counter()
        for tree in trees[:: args.every]:
            p = make_plan(relaid(tree), heads, cost=cost)
            length = p.host.work_kv_end - p.host.work_kv_start
            for ln in p.launches:
                n = int(length[ln.work_start: ln.work_end].sum())
                tokens += n
                contig += n * ln.contig
            chosen[p.strategy] += 1
        print(f"{args.workload}, {layout}: {len(trees[:: args.every])} of {len(trees)} trees, "
              f"{contig / max(tokens, 1):.0%} of {tokens} KV tokens in contig launches; {dict(chosen)}")


if __name__ == "__main__":
    main()
