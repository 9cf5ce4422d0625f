"""``greedy``: FastTree's overhead-guided greedy binary edge assignment (its Alg. 1) and
long-context splitting.

Nodes are visited breadth-first; for each edge ``v -> l`` the cost of keeping ``l``'s context
separate (edge 0: padding of both groups plus the reduction of ``l``'s extra partial results) is
compared with concatenating ``v``'s context into ``l``'s group (edge 1: padding of the shrunken
``v`` group and of the longer ``l`` group). Query counts are measured in rows (queries x GQA
group) because that is what fills the kernel's query tile. When the resulting groups cannot fill
the GPU, long contexts are split; otherwise contexts whose programs are longer than a fair share
of the work are (a few tall query tiles over one long context among many tiny items: the
queries of a speculative token tree).
"""
from __future__ import annotations

import numpy as np

from treeattn.plan.select.cost import CostModel
from treeattn.plan.strategies.items import WorkItems, chain_jumps, glued_items
from treeattn.plan.strategies.leaf_packing import LeafPackingPlanner
from treeattn.plan.format import HeadConfig
from treeattn.plan.strategies.split import spread_items
from treeattn.tree import DecodingTree


def _padding(n: np.ndarray, tile: int) -> np.ndarray:
    """Padding of ``n`` up to a multiple of ``tile``: FastTree's ``tile - ((n - 1) % tile + 1)``
    (floor modulo, as Python's), which is ``-n % tile`` for every integer ``n`` (``-n & (tile -
    1)`` when ``tile`` is a power of two: a few times cheaper)."""
    if (tile & (tile - 1)) == 0:
        return -n & (tile - 1)
    return -n % tile


def _assign_edges(tree: DecodingTree, rows: np.ndarray, cost: CostModel) -> np.ndarray:
    """bool [N]: FastTree's Alg. 1 decision for every edge ``parent(l) -> l`` (True: assigned
    1); :func:`_edge_rounds` without the tops."""
    return _edge_rounds(tree, rows, cost)[0]


def _edge_rounds(tree: DecodingTree, rows: np.ndarray, cost: CostModel) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`_assign_edges`, and the top of each node's chain of edges assigned 1
    (:func:`~treeattn.plan.strategies.items.glued_items`'s; None when the first round assigns none).

    The algorithm visits edges breadth-first, a parent's children in id order; an edge's decision
    depends on its parent's length (longer when the parent's own edge was assigned 1) and on its
    earlier siblings' decisions (``nq_cur`` shrinks by every assigned sibling's rows). All edges
    are decided at once from a guess of those decisions, repeatedly, until nothing changes: the
    dependencies form a DAG, so the fixed point is unique and reached, and it is the sequential
    algorithm's result. Costs are in units of head_dim (every term has one factor d): the padding
    cost of a group is ``alpha * Pad(TS_q, nQ) * len + beta * nQ * Pad(TS_c, min(len, TS_c))``
    (FastTree eqs. 3-7). They are compared as the sequential algorithm does (bit-identical
    decisions): with its float operations in its order, or, when every term is an integer that
    float64 holds exactly (integral coefficients, the default), as their exact difference in
    int64, which takes half the numpy calls.
    """
    topo = tree.topology
    glued = np.zeros(tree.num_nodes, dtype=bool)
    kids = topo.child_indices  # by (parent, id)
    if kids.size == 0:
        return glued, None
    par = tree.parents[kids]
    sib = topo.child_indptr[par]  # each edge's first sibling
    nq, len_l, rows_v = rows[kids], tree.lengths[kids], rows[par]
    # a node's group reads the tokens from the top of its glued chain: path tokens since the top
    through = topo.path_tokens + tree.lengths
    costs = _exact_costs if _exact(cost, int(rows.max()), int(through.max())) else _float_costs
    decide = costs(cost, nq, len_l)
    jumps = chain_jumps(tree)
    ids = np.arange(glued.size)
    moved = np.zeros(kids.size + 1, dtype=np.int64)  # (rows glued edges take, summed over the edges before each)
    # the first guess, nothing assigned: a parent's chain is the parent, its rows all its own
    assigned, len_v, nq_cur, top = np.zeros(kids.size, dtype=bool), tree.lengths[par], rows_v, None
    while True:
        now = decide(len_v, nq_cur)
        if now.tobytes() == assigned.tobytes():  # (np.array_equal, a few times cheaper on bools)
            return glued, top
        glued[kids] = assigned = now
        top = np.where(glued, tree.parents, ids)
        for _ in range(jumps):
            top = top[top]
        len_v = (through - topo.path_tokens[top])[par]
        (nq * assigned).cumsum(out=moved[1:])  # rows that glued children take from the parent
        nq_cur = rows_v - (moved[:-1] - moved[sib])  # earlier siblings only


def _exact(cost: CostModel, rows: int, tokens: int) -> bool:
    """Whether every cost term, sum and difference is an integer below 2**53 (float64 exact)."""
    a, b, g = cost.fasttree_alpha, cost.fasttree_beta, cost.fasttree_gamma
    if not all(float(c).is_integer() for c in (a, b, g)):
        return False
    tq, tc = cost.fasttree_tile_q, cost.fasttree_tile_kv
    bound = 8 * (abs(a) * tq * 2 * tokens + abs(b) * rows * tc + abs(g) * rows + 1)
    return bound < 2 ** 52


def _float_costs(cost: CostModel, nq: np.ndarray, len_l: np.ndarray):
    """``decide(len_v, nq_cur)``: edge 1 is cheaper, with the sequential algorithm's float
    operations in its order."""
    a, b, g = cost.fasttree_alpha, cost.fasttree_beta, cost.fasttree_gamma
    tq, tc = cost.fasttree_tile_q, cost.fasttree_tile_kv
    # terms of the child on its own (``a_pad_q_l`` and ``b_nq`` are the leading products of two
    # terms of split_q)
    pad_q_l = _padding(nq, tq)
    pad_l = a * pad_q_l * len_l
    kv_l = b * nq * _padding(np.minimum(len_l, tc), tc)
    reduce_l = g * nq
    a_pad_q_l, b_nq = a * pad_q_l, b * nq

    def decide(len_v, nq_cur):
        len_lv = len_v + len_l
        pad_kv_v = _padding(np.minimum(len_v, tc), tc)
        nq_rest = nq_cur - nq
        split_kv = (a * _padding(nq_cur, tq) * len_v + b * nq_cur * pad_kv_v + pad_l + kv_l
                    + reduce_l)
        split_q = (a * _padding(nq_rest, tq) * len_v + b * nq_rest * pad_kv_v
                   + a_pad_q_l * len_lv + b_nq * _padding(np.minimum(len_lv, tc), tc))
        return split_kv > split_q
    return decide


def _exact_costs(cost: CostModel, nq: np.ndarray, len_l: np.ndarray):
    """:func:`_float_costs` for integral terms: ``split_kv - split_q > 0`` in int64, expanded
    (``nq_rest = nq_cur - nq``; the ``alpha * Pad(nq_l) * len_l`` terms cancel) to ``a * len_v *
    (Pad(nq_cur) - Pad(nq_rest) - Pad(nq_l)) + b * nq_l * (Pad(min(len_v, TS_c)) - Pad(min(len_v +
    len_l, TS_c))) + b * nq_l * Pad(min(len_l, TS_c)) + g * nq_l``. As ``Pad(x) = -x mod TS_q``,
    ``Pad(nq_rest) = Pad(nq_cur) - Pad(nq_l) mod TS_q``: the first factor is ``-TS_q`` where
    ``Pad(nq_cur) < Pad(nq_l)``, else 0."""
    a, b, g = int(cost.fasttree_alpha), int(cost.fasttree_beta), int(cost.fasttree_gamma)
    tq, tc = cost.fasttree_tile_q, cost.fasttree_tile_kv
    pad_q_l, b_nq = _padding(nq, tq), b * nq
    const = b_nq * _padding(np.minimum(len_l, tc), tc) + g * nq
    # the terms of len_v alone, for the last one (the later rounds mostly change no parent's chain)
    terms = {}

    def decide(len_v, nq_cur):
        key = len_v.tobytes()
        if terms.get("len_v") != key:
            pad_kv = _padding(np.minimum(len_v, tc), tc) - _padding(np.minimum(len_v + len_l, tc), tc)
            terms.update(len_v=key, kv=b_nq * pad_kv + const, q=a * tq * len_v)
        return terms["kv"] > terms["q"] * (_padding(nq_cur, tq) < pad_q_l)
    return decide


def _plan_greedy(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    glued, top = _edge_rounds(tree, tree.subtree_queries * heads.group, cost)
    items, note = spread_items(glued_items(tree, glued, top), heads, cost)
    return items, f"greedy: {np.count_nonzero(glued)} edges assigned 1{note}"


plan_greedy = LeafPackingPlanner(_plan_greedy)
