"""``auto``: plans with every strategy's work items and keeps the one the cost model rates
fastest, saying why in ``plan.explain()``."""
from __future__ import annotations

from treeattn.plan.format import HeadConfig
from treeattn.plan.select.cost import CostModel
from treeattn.plan.select.estimate import estimate_many
from treeattn.plan.strategies.items import WorkItems
from treeattn.tree import DecodingTree


def plan_auto(tree: DecodingTree, heads: HeadConfig, cost: CostModel, planners: dict
              ) -> tuple[str, WorkItems, str, tuple]:
    """Returns ``(chosen strategy, its items, reason, candidates)``: ``candidates`` are
    ``(strategy, estimated seconds)`` of every planner, best estimate first.

    A planner with ``variants`` hands back several item sets, ``[(items, note), ...]``:
    :class:`~treeattn.plan.strategies.leaf_packing.LeafPackingPlanner` its items with and without leaf packing,
    ``sequence`` its split items and, for short paths, the unsplit ones (one launch, no merge;
    ``sequence`` alone always splits), ``paths`` one per query-tile height and split. All are
    rated in one pass of the cost model, and such a planner's candidate is its best rated (the
    first of equals, as the planner on its own chooses)."""
    made = [(name, planner.variants(tree, heads, cost) if hasattr(planner, "variants")
             else [planner(tree, heads, cost)]) for name, planner in planners.items()]
    estimates = iter(estimate_many(tree, [v[0] for _, variants in made for v in variants], heads, cost))
    scored = []
    for name, variants in made:
        rated = [(next(estimates), items, note) for items, note in variants]
        est, items, note = min(rated, key=lambda r: r[0]["total"])
        scored.append((est["total"], name, items, note, est))
    scored.sort(key=lambda s: s[0])
    close = [s for s in scored if s[0] <= scored[0][0] * (1.0 + cost.choice_margin)]
    _, name, items, note, est = min(close, key=lambda s: (_kernels(s[4]), s[0]))
    table = ", ".join(f"{n} {s * 1e6:.1f}us" for s, n, _, _, _ in scored)
    why = (f"attention {est['attention'] * 1e6:.1f}us in {est['launches']} launch(es) + merge "
           f"{est['merge'] * 1e6:.1f}us")
    if name != scored[0][1]:
        why += f"; fewest kernels within {cost.choice_margin:.0%} of the best estimate"
    ranked = tuple((n, s) for s, n, _, _, _ in scored)
    return name, items, f"auto chose {name} ({why}; cost model estimates: {table}); {note}", ranked


def _kernels(est: dict) -> int:
    # launches that run side by side, tallest first, pay one launch's floor between them
    return (1 if est["tall_first"] else est["launches"]) + (est["merge"] > 0)
