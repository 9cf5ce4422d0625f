"""``greedy``: FastTree's overhead-guided greedy binary edge assignment (its Alg. 1) and
long-context splitting.

Nodes are visited breadth-first; for each edge ``v -> l`` the cost of keeping ``l``'s context
separate (edge 0: padding of both groups plus the reduction of ``l``'s extra partial results) is
compared with concatenating ``v``'s context into ``l``'s group (edge 1: padding of the shrunken
``v`` group and of the longer ``l`` group). Query counts are measured in rows (queries x GQA
group) because that is what fills the kernel's query tile. When the resulting groups cannot fill
the GPU, long contexts are split.
"""
from __future__ import annotations

import numpy as np

from treeattn.plan.cost import CostModel
from treeattn.plan.items import WorkItems, glued_items, split_long_items
from treeattn.plan.pack import subtree_query_counts
from treeattn.plan.plan import HeadConfig
from treeattn.tree import DecodingTree


def _pad(tile: int, n: int) -> int:
    return tile - ((n - 1) % tile + 1)


def plan_greedy(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    topo = tree.topology
    d = heads.head_dim
    a, b, g = cost.fasttree_alpha, cost.fasttree_beta, cost.fasttree_gamma
    tq, tc = cost.fasttree_tile_q, cost.fasttree_tile_kv

    def pad_cost(nq: int, length: int) -> float:
        return a * _pad(tq, nq) * length * d + b * nq * _pad(tc, min(length, tc)) * d

    rows = (subtree_query_counts(tree) * heads.group).tolist()
    length = tree.lengths.tolist()
    indptr, kids = topo.child_indptr.tolist(), topo.child_indices.tolist()
    glued = np.zeros(tree.num_nodes, dtype=bool)
    bfs = np.argsort(topo.depth, kind="stable").tolist()
    for v in bfs:
        nq_cur, len_v = rows[v], length[v]
        for l in kids[indptr[v]:indptr[v + 1]]:
            nq_l, len_l = rows[l], length[l]
            split_kv = pad_cost(nq_cur, len_v) + pad_cost(nq_l, len_l) + g * nq_l * d
            split_q = pad_cost(nq_cur - nq_l, len_v) + pad_cost(nq_l, len_v + len_l)
            if split_kv > split_q:
                glued[l] = True
                nq_cur -= nq_l
                length[l] = len_l + len_v
    items = glued_items(tree, glued)
    note = ""
    item_len = items.item_len
    used = (item_len > 0) & (items.item_queries > 0)
    q_tile = max(1, 64 // heads.group)
    programs = int((-(-items.item_queries[used] // q_tile)).sum()) * heads.num_kv_heads
    if programs < cost.target_programs and used.any():
        per_head = max(1, cost.target_programs // heads.num_kv_heads)
        max_len = max(cost.min_split_tokens, -(-int(item_len[used].sum()) // per_head))
        items = split_long_items(items, max_len)
        note = f"; long contexts split at {max_len} tokens ({programs} programs < {cost.target_programs})"
    return items, f"greedy: {int(glued.sum())} edges assigned 1{note}"
