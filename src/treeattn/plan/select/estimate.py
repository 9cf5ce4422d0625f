"""The cost model's rating of work-item sets without building plans: what ``auto`` compares and
what a planner with several variants uses to keep its best."""
from __future__ import annotations

import itertools

import numpy as np

from treeattn.plan.format import HeadConfig
from treeattn.plan.lower.addressing import tma_loads
from treeattn.plan.select.cost import CostModel
from treeattn.plan.select.launches import launch_slots
from treeattn.plan.strategies.items import WorkItems
from treeattn.tree import DecodingTree

__all__ = ["estimate_items", "estimate_many", "needs_mask", "best_variant"]


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
    item_tokens = nq * length
    used = item_tokens > 0  # (with tokens and queries)
    # per set: (item, query) pairs and tokens over the used items (an unused item adds no
    # tokens: its length or queries are 0), summed over the runs of the sets with items
    pairs_of, tokens_of = [0] * len(unique), [0] * len(unique)
    filled = [i for i, n in enumerate(sizes) if n]
    if filled:
        starts = [bounds[i] for i in filled]
        for i, p, t in zip(filled, np.add.reduceat(nq * used, starts).tolist(),
                           np.add.reduceat(item_tokens, starts).tolist()):
            pairs_of[i], tokens_of[i] = p, t
    flagged = lead = None
    if any(it.masked is not None for it in unique):
        flagged = np.zeros(length.size, dtype=bool)
        if any(it.mask_lead is not None for it in unique):
            lead = np.full(length.size, -1, dtype=np.int64)
        for a, b, it in zip(bounds, bounds[1:], unique):
            if it.masked is not None:
                flagged[a:b] = it.masked
            if lead is not None and it.mask_lead is not None:
                lead[a:b] = it.mask_lead
        flagged &= used
    set_of = np.arange(len(unique)).repeat(sizes)
    set_of[~used] = len(unique)  # (unused items count in no set)
    # sets whose unmasked items the planner knows to read runs of slots: their launches may load
    # through TMA, rated from their units' mean length
    runs = [it.unmasked_runs for it in unique] if tma_loads(heads, cost) else []
    slots = launch_slots(length, nq, set_of, len(unique), flagged, heads, lead, profile=cost.profile,
                         tokens=any(runs))
    flagged_sets = slots.flags.any(axis=1).tolist()  # (a set's launch applies the mask iff it has a flagged item)
    sets = []
    for i, it in enumerate(unique):
        a, b = bounds[i], bounds[i + 1]
        pairs, tokens = pairs_of[i], tokens_of[i]
        # every visible token of a query is in exactly one of its items, so the items hold more
        # (item, query) tokens than the queries see iff some query sees only part of an item: the
        # plan needs the tree mask
        per_item = it.masked is not None
        masked = flagged_sets[i] if per_item else tokens > visible_tokens
        sets.append((kv_tokens, pairs, it.used_merge_rows(used[a:b]), tree.num_queries, masked, per_item))
    estimates = dict(zip(map(id, unique), cost.totals(sets, slots, heads, runs=runs if any(runs) else None)))
    return [estimates[id(it)] for it in item_sets]


def needs_mask(tree: DecodingTree, items: WorkItems) -> bool:
    """Whether the cost model rates ``items`` as needing the tree mask (its ``masked``), without
    rating them."""
    if items.masked is not None:
        return bool((items.masked & (items.item_len > 0) & (items.item_queries > 0)).any())
    return int(items.item_len @ items.item_queries) > int(tree.visible_tokens.sum())


def best_variant(tree: DecodingTree, variants: list, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    """The ``(items, note)`` of ``variants`` that the cost model rates fastest (the first of equals)."""
    if len(variants) == 1:
        return variants[0]
    est = estimate_many(tree, [v[0] for v in variants], heads, cost)
    return variants[min(range(len(variants)), key=lambda i: est[i]["total"])]
