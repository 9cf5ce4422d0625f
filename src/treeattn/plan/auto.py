"""``auto``: plans with every strategy's work items and keeps the one the cost model rates
fastest, saying why in ``plan.explain()``."""
from __future__ import annotations

import numpy as np

from treeattn.plan.cost import CostModel
from treeattn.plan.items import WorkItems
from treeattn.plan.plan import HeadConfig
from treeattn.tree import DecodingTree


def plan_auto(tree: DecodingTree, heads: HeadConfig, cost: CostModel, planners: dict
              ) -> tuple[str, WorkItems, str]:
    """Returns ``(chosen strategy, its items, reason)``."""
    scored = []
    for name, planner in planners.items():
        items, note = planner(tree, heads, cost)
        length, nq = items.item_len, items.item_queries
        used = (length > 0) & (nq > 0)
        per_query = np.bincount(items.q_indices, minlength=tree.num_queries)
        t = cost.estimate(length[used], nq[used], heads, merge_rows_max=int(per_query.max()))
        scored.append((t, name, items, note))
    scored.sort(key=lambda s: s[0])
    best = scored[0]
    table = ", ".join(f"{name} {t * 1e6:.1f}us" for t, name, _, _ in scored)
    return best[1], best[2], f"auto chose {best[1]} (cost model estimates: {table}); {best[3]}"
