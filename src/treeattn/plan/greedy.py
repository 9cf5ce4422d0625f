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
from treeattn.plan.plan import HeadConfig
from treeattn.tree import DecodingTree


def plan_greedy(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    topo = tree.topology
    a, b, g = cost.fasttree_alpha, cost.fasttree_beta, cost.fasttree_gamma
    tq, tc = cost.fasttree_tile_q, cost.fasttree_tile_kv
    rows = (tree.subtree_queries * heads.group).tolist()
    length = tree.lengths.tolist()
    indptr, kids = topo.child_indptr.tolist(), topo.child_indices.tolist()
    glued = np.zeros(tree.num_nodes, dtype=bool)
    internal = np.flatnonzero(np.diff(topo.child_indptr) > 0)
    # costs are in units of head_dim (every term has one factor d); the padding cost of a group
    # is alpha * Pad(TS_q, nQ) * len + beta * nQ * Pad(TS_c, min(len, TS_c)) (FastTree eqs. 3-7),
    # written out inline because this loop runs once per edge
    for v in internal[np.argsort(topo.depth[internal], kind="stable")].tolist():
        nq_cur, len_v = rows[v], length[v]
        pad_kv_v = tc - ((min(len_v, tc) - 1) % tc + 1)
        for l in kids[indptr[v]:indptr[v + 1]]:
            nq_l, len_l = rows[l], length[l]
            nq_rest, len_lv = nq_cur - nq_l, len_v + len_l
            split_kv = (a * (tq - ((nq_cur - 1) % tq + 1)) * len_v + b * nq_cur * pad_kv_v
                        + a * (tq - ((nq_l - 1) % tq + 1)) * len_l
                        + b * nq_l * (tc - ((min(len_l, tc) - 1) % tc + 1)) + g * nq_l)
            split_q = (a * (tq - ((nq_rest - 1) % tq + 1)) * len_v + b * nq_rest * pad_kv_v
                       + a * (tq - ((nq_l - 1) % tq + 1)) * len_lv
                       + b * nq_l * (tc - ((min(len_lv, tc) - 1) % tc + 1)))
            if split_kv > split_q:
                glued[l] = True
                nq_cur = nq_rest
                length[l] = len_lv
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
