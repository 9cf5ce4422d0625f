"""``sequence``: Q-guided grouping with Flash-Decoding's KV split (the vLLM / SGLang baseline).

Every query attends to its own root-to-node path as if it were an ordinary sequence, so a KV token
shared by ``s`` queries is read ``s`` times. Long paths are split so that the grid has about
``cost.target_programs`` programs, as Flash-Decoding does. ``auto`` also rates short paths unsplit
(:func:`sequence_variants`).
"""
from __future__ import annotations

import numpy as np

from treeattn.plan.select.cost import CostModel
from treeattn.plan.strategies.items import DeferredItems, WorkItems, items_from_groups
from treeattn.plan.format import HeadConfig
from treeattn.plan.strategies.split import split_long_items
from treeattn.tree import DecodingTree


def plan_sequence(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    return sequence_variants(tree, heads, cost)[0]


def sequence_variants(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> list:
    """``[(split items, note), (unsplit items, note)]``: ``sequence``'s items, and for ``auto`` each
    query's whole path as one item (one launch writing the output, no merge), left out when the
    split leaves every path whole or a path is longer than ``2 x cost.min_split_tokens``.

    Unsplit paths of up to ~300 tokens beat every split plan on small trees (one launch instead
    of two and a merge: 21.2 against 26.1 us on ``1,2,64_8,256,32`` at 32/8); longer ones make a
    few slow programs the cost model rates too fast (Medusa trees over 1000 tokens: 36-48 us
    against 26-28 for the best plan, on an H200)."""
    path = tree.visible_tokens
    queries = np.arange(tree.num_queries)

    def make() -> WorkItems:
        q, node, visible = tree.visible_pairs
        return items_from_groups(q, node, np.zeros_like(node), visible, queries, queries, tree.num_queries,
                                 q_tokens=path)

    # one item per query: its path (the segments made when first read)
    items = DeferredItems(path, np.ones(tree.num_queries, dtype=np.int64), make, queries)
    longest = int(path.max())
    splits = max(1, -(-cost.target_programs // (tree.num_queries * heads.num_kv_heads)))
    max_len = max(cost.min_split_tokens, -(-longest // splits))
    split = split_long_items(items, max_len)
    out = [(split, f"sequence: KV split at {max_len} tokens")]
    if split is not items and longest <= 2 * cost.min_split_tokens:
        out.append((items, "sequence: no KV split"))
    return out


# plan_auto rates every item set of a planner with ``variants``; ``sequence`` on its own always
# splits
plan_sequence.variants = sequence_variants
