"""``pack``: PAT's pack scheduler (TreeHeuristic, its Alg. 1) with long-KV split.

Walking down from each root, a child ``c`` of node ``u`` is either packed on its own (scheme 1,
split) or merged with ``u``'s accumulated blocks (scheme 2), whichever PAT's memory-oriented profit
model prefers: merging re-reads the accumulated prefix (``len_s`` tokens) for ``c``'s queries but
saves their partial results, worth ``4 * c.size`` tokens. We count ``c.size`` in query heads per KV
head (queries x GQA group), which is the paper's rule for MHA. Items longer than the mean are then
split evenly below it (PAT's long-KV split); the builder rounds each item's query tile up (PAT's
tile selector).
"""
from __future__ import annotations

import numpy as np

from treeattn.plan.select.cost import CostModel
from treeattn.plan.strategies.items import WorkItems, glued_items
from treeattn.plan.format import HeadConfig
from treeattn.plan.strategies.split import split_long_items
from treeattn.tree import DecodingTree


def plan_pack(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    topo = tree.topology
    size = tree.subtree_queries * heads.group
    glued = np.zeros(tree.num_nodes, dtype=bool)
    chain = tree.lengths.copy()  # len_s: tokens of the blocks a node's pack reads
    saved = 4 * size  # tokens' worth of the partial results that merging saves
    for kids in topo.levels[1:]:  # (a level's nodes are decided independently of each other)
        len_s = chain[tree.parents[kids]]
        merge = saved[kids] >= len_s
        glued[kids] = merge
        chain[kids] += len_s * merge
    items = glued_items(tree, glued)
    length = items.item_len
    used = (length > 0) & (items.item_queries > 0)
    count = int(np.count_nonzero(used))
    # (the ceiling of the mean in integers: the float mean's below 2**53 tokens)
    mean = -(-int(length[used].sum()) // count) if count else 1
    items = split_long_items(items, max(mean, 16))
    return items, (f"pack: {np.count_nonzero(glued)} of {np.count_nonzero(tree.parents >= 0)} edges merged "
                   f"by the profit model; items split above the mean ({mean} tokens)")
