"""``auto``: plans with every strategy's work items and keeps the one the cost model rates
fastest, saying why in ``plan.explain()``."""
from __future__ import annotations

import numpy as np

from treeattn.plan.cost import CostModel
from treeattn.plan.items import WorkItems
from treeattn.plan.plan import HeadConfig
from treeattn.tree import DecodingTree


def estimate_items(tree: DecodingTree, items: WorkItems, heads: HeadConfig, cost: CostModel, *,
                   visible_tokens: int | None = None, kv_tokens: int | None = None) -> dict:
    """The cost model's :meth:`~CostModel.breakdown` for ``items`` of ``tree`` (no Plan built).

    ``visible_tokens`` (tokens all queries see) and ``kv_tokens`` (unique tokens some query sees)
    are the tree's, computed when not given. The estimate is kept with ``items`` (leaf packing
    rates the items a planner returns, and ``auto`` rates them again)."""
    key = (tree, heads, cost)
    est = items.estimates.get(key)
    if est is None:
        est = items.estimates[key] = _estimate(tree, items, heads, cost, visible_tokens, kv_tokens)
    return est


def _estimate(tree: DecodingTree, items: WorkItems, heads: HeadConfig, cost: CostModel,
              visible_tokens: int | None, kv_tokens: int | None) -> dict:
    length, nq, item_masked = items.item_len, items.item_queries, items.masked
    used = (length > 0) & (nq > 0)
    if used.all():
        q_used = items.q_indices
    else:
        length, nq = length[used], nq[used]
        q_used = items.q_indices[np.repeat(used, items.item_queries)]
        item_masked = None if item_masked is None else item_masked[used]
    per_query = np.bincount(q_used, minlength=tree.num_queries)
    # every visible token of a query is in exactly one of its items, so the items hold more
    # (item, query) tokens than the queries see iff some query sees only part of an item: the
    # plan needs the tree mask
    if visible_tokens is None:
        visible_tokens = int(tree.visible_tokens.sum())
    if kv_tokens is None:
        kv_tokens = int(tree.node_extent.sum())
    masked = item_masked if item_masked is not None else int(length @ nq) > visible_tokens
    return cost._breakdown(length, nq, heads, int(per_query.max()) if per_query.size else 0,
                           tree.num_queries, kv_tokens, masked)


def _same_estimate_inputs(a: WorkItems, b: WorkItems) -> bool:
    """Whether :func:`estimate_items` rates ``a`` and ``b`` alike (same lengths and queries)."""
    return a is b or (a.num_items == b.num_items and a.q_indices.size == b.q_indices.size
                      and np.array_equal(a.item_len, b.item_len) and np.array_equal(a.q_indptr, b.q_indptr)
                      and np.array_equal(a.q_indices, b.q_indices))


def plan_auto(tree: DecodingTree, heads: HeadConfig, cost: CostModel, planners: dict
              ) -> tuple[str, WorkItems, str, tuple]:
    """Returns ``(chosen strategy, its items, reason, candidates)``: ``candidates`` are
    ``(strategy, estimated seconds)`` of every planner, best estimate first."""
    scored = []
    tokens = {"visible_tokens": int(tree.visible_tokens.sum()), "kv_tokens": int(tree.node_extent.sum())}
    for name, planner in planners.items():
        items, note = planner(tree, heads, cost)
        # planners may make the same items (node_chunk when no node is long): rate them once
        est = next((e for _, _, it, _, e in scored if _same_estimate_inputs(it, items)), None)
        if est is None:
            est = estimate_items(tree, items, heads, cost, **tokens)
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
    return est["launches"] + (est["merge"] > 0)
