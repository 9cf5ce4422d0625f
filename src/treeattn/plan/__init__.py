"""Planners: a decoding tree -> work items -> a :class:`Plan` (host-side, one file per strategy)."""
from __future__ import annotations

from treeattn.plan.select.auto import plan_auto
from treeattn.plan.lower.build import build_plan
from treeattn.plan.select.cost import CostModel
from treeattn.plan.strategies.flatten import plan_flatten
from treeattn.plan.strategies.greedy import plan_greedy
from treeattn.plan.strategies.node import plan_node
from treeattn.plan.strategies.node_chunk import plan_node_chunk
from treeattn.plan.strategies.pat import plan_pack
from treeattn.plan.strategies.paths import plan_paths
from treeattn.plan.format import HeadConfig, Launch, Plan, PlanIO
from treeattn.plan.strategies.sequence import plan_sequence
from treeattn.tree import DecodingTree

__all__ = ["STRATEGIES", "PLANNERS", "make_plan", "Plan", "PlanIO", "Launch", "HeadConfig", "CostModel"]

PLANNERS = {
    "sequence": plan_sequence,
    "node": plan_node,
    "node_chunk": plan_node_chunk,
    "flatten": plan_flatten,
    "pack": plan_pack,
    "greedy": plan_greedy,
    "paths": plan_paths,
}
STRATEGIES = ("auto",) + tuple(PLANNERS)


def make_plan(tree: DecodingTree, heads: HeadConfig, *, strategy: str = "auto", device="cpu",
              cost: CostModel | None = None) -> Plan:
    """Plan one decode step of ``tree`` with ``strategy`` (one of :data:`STRATEGIES`)."""
    if not isinstance(tree, DecodingTree):
        raise TypeError(f"tree must be a DecodingTree, got {type(tree).__name__}")
    cost = cost or CostModel()
    if strategy == "auto":
        name, items, reason, ranked = plan_auto(tree, heads, cost, PLANNERS)
        return build_plan(tree, items, heads, strategy=name, device=device, reason=reason,
                          requested_strategy="auto", candidates=ranked, cost=cost)
    if strategy not in PLANNERS:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    items, reason = PLANNERS[strategy](tree, heads, cost)
    return build_plan(tree, items, heads, strategy=strategy, device=device, reason=reason, cost=cost)
