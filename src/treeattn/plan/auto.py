"""``auto``: plans with every strategy's work items and keeps the one the cost model rates
fastest, saying why in ``plan.explain()``."""
from __future__ import annotations

import itertools

import numpy as np

from treeattn.plan.cost import CostModel, launches_by_group
from treeattn.plan.items import WorkItems
from treeattn.plan.plan import HeadConfig
from treeattn.tree import DecodingTree


def estimate_items(tree: DecodingTree, items: WorkItems, heads: HeadConfig, cost: CostModel, *,
                   visible_tokens: int | None = None, kv_tokens: int | None = None) -> dict:
    """The cost model's :meth:`~CostModel.breakdown` for ``items`` of ``tree`` (no Plan built).

    ``visible_tokens`` (tokens all queries see) and ``kv_tokens`` (unique tokens some query sees)
    are the tree's, computed when not given."""
    return estimate_many(tree, [items], heads, cost, visible_tokens=visible_tokens, kv_tokens=kv_tokens)[0]


def estimate_many(tree: DecodingTree, item_sets: list, heads: HeadConfig, cost: CostModel, *,
                  visible_tokens: int | None = None, kv_tokens: int | None = None) -> list:
    """:func:`estimate_items` of several item sets of ``tree``, rated together (one pass of the
    cost model's numpy work for all; a set given twice is rated once).

    Each set's inputs to the model: its used items' (with tokens and queries) lengths and
    queries, the longest merge chain, the queries, the unique KV tokens and whether (or which
    items) need the mask."""
    if visible_tokens is None:
        visible_tokens = int(tree.visible_tokens.sum())
    if kv_tokens is None:
        kv_tokens = int(tree.node_extent.sum())
    unique = list({id(it): it for it in item_sets}.values())
    sizes = [it.num_items for it in unique]
    bounds = [0, *itertools.accumulate(sizes)]
    length = np.concatenate([it.item_len for it in unique])
    nq = np.concatenate([it.item_queries for it in unique])
    used = (length > 0) & (nq > 0)
    rows = nq * used
    # per set: (item, query) pairs and tokens over the used items
    sums = np.zeros((2, length.size + 1), dtype=np.int64)
    rows.cumsum(out=sums[0, 1:])
    (rows * length).cumsum(out=sums[1, 1:])
    pairs_at, tokens_at = sums[:, bounds].tolist()
    flags = [it.masked for it in unique]
    flagged = None
    if any(f is not None for f in flags):
        flagged = np.zeros(length.size, dtype=bool)
        for a, b, f in zip(bounds, bounds[1:], flags):
            if f is not None:
                flagged[a:b] = f
        flagged &= used
    set_of = np.where(used, np.arange(len(unique)).repeat(sizes), len(unique))
    estimates = {}
    for i, (it, launches) in enumerate(zip(unique, launches_by_group(length, nq, set_of, len(unique), flagged, heads))):
        a, b = bounds[i], bounds[i + 1]
        pairs, tokens = pairs_at[i + 1] - pairs_at[i], tokens_at[i + 1] - tokens_at[i]
        # every visible token of a query is in exactly one of its items, so the items hold more
        # (item, query) tokens than the queries see iff some query sees only part of an item: the
        # plan needs the tree mask
        masked = bool(flagged[a:b].any()) if flags[i] is not None else tokens > visible_tokens
        estimates[id(it)] = cost.total(kv_tokens, pairs, it.used_merge_rows(used[a:b]), tree.num_queries, masked,
                                       flags[i] is not None, launches, heads)
    return [estimates[id(it)] for it in item_sets]


def needs_mask(tree: DecodingTree, items: WorkItems) -> bool:
    """Whether the cost model rates ``items`` as needing the tree mask (its ``masked``), without
    rating them."""
    if items.masked is not None:
        return bool((items.masked & (items.item_len > 0) & (items.item_queries > 0)).any())
    return int(items.item_len @ items.item_queries) > int(tree.visible_tokens.sum())


def plan_auto(tree: DecodingTree, heads: HeadConfig, cost: CostModel, planners: dict
              ) -> tuple[str, WorkItems, str, tuple]:
    """Returns ``(chosen strategy, its items, reason, candidates)``: ``candidates`` are
    ``(strategy, estimated seconds)`` of every planner, best estimate first.

    A planner with ``variants`` hands back two item sets: :class:`~treeattn.plan.packing.LeafPackingPlanner`
    its items with and without leaf packing, ``sequence`` its split items and, for short paths,
    the unsplit ones (one launch, no merge; ``sequence`` alone always splits). All are rated in
    one pass of the cost model, and such a planner's candidate is the better rated of its two."""
    made = [(name, *(planner.variants(tree, heads, cost) if hasattr(planner, "variants")
                     else (*planner(tree, heads, cost), None, "")))
            for name, planner in planners.items()]
    sets = [m[1] for m in made] + [m[3] for m in made if m[3] is not None]
    estimates = estimate_many(tree, sets, heads, cost)
    packed_est = iter(estimates[len(made):])
    scored = []
    for (name, items, note, packed, packed_note), est in zip(made, estimates):
        if packed is not None:
            alt = next(packed_est)
            if alt["total"] < est["total"]:  # (as the planner would choose)
                items, note, est = packed, packed_note, alt
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
