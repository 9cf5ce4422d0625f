"""Per-work-unit mask start (``Plan.work_mask_start``): every entry before it is visible to every
row of its unit, it is tight where the tree makes that obvious, and the kernel really uses it."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import random_tree

from treeattn import DecodingTree, HeadConfig, TreeAttention
from treeattn.engine.planning import StepPlanner
from treeattn.plan import STRATEGIES, make_plan
from treeattn.reference import reference_attention, visibility_mask
from treeattn.tree.topology import ranges
from treeattn.tree import tree_from_medusa

HEADS = HeadConfig(8, 2, 32, torch.float32)


def assert_unmasked_prefix_visible(plan, seen: DecodingTree) -> None:
    """Entries ``[work_kv_start, work_mask_start)`` of each unit are visible to all its rows under
    ``seen``'s prefixes (slots are unique per token here)."""
    start, end = plan.work_kv_start.numpy().astype(np.int64), plan.work_kv_end.numpy().astype(np.int64)
    mask_start = plan.work_mask_start.numpy().astype(np.int64)
    assert np.all((start <= mask_start) & (mask_start <= end))
    indptr = plan.work_row_indptr.numpy().astype(np.int64)
    row_work = np.repeat(np.arange(start.size), np.diff(indptr))
    entry = ranges(start[row_work], mask_start[row_work])  # (row, entry) pairs before the start
    row_q = np.repeat(plan.row_q_indices.numpy(), (mask_start - start)[row_work])
    token = np.empty(int(seen.kv_indices.max()) + 1, dtype=np.int64)
    token[seen.kv_indices] = np.arange(seen.kv_indices.size)
    tok = token[plan.kv_indices.numpy()[entry]]
    assert visibility_mask(seen)[row_q, tok].all()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["leaves", "inner", "medusa"])
def test_entries_before_the_mask_start_are_visible_to_every_row(rng, strategy, kind):
    for _ in range(4):
        if kind == "medusa":
            size = str(rng.choice(["APPS_tree_size10", "32"]))
            tree = tree_from_medusa(size, context_len=int(rng.integers(1, 500)))
        else:
            tree = random_tree(rng, int(rng.integers(1, 60)), 90, roots=int(rng.integers(1, 3)),
                               inner_queries=kind == "inner")
        plan = make_plan(tree, HEADS, strategy=strategy)
        assert_unmasked_prefix_visible(plan, tree)
        if not plan.has_mask:  # nothing to mask: every start is at its unit's end
            assert np.array_equal(plan.work_mask_start.numpy(), plan.work_kv_end.numpy())


@pytest.mark.parametrize("strategy", ["sequence", "node", "greedy", "flatten", "pack", "auto"])
def test_window_mask_starts_keep_hidden_slots_masked(rng, strategy):
    """Window plans: the entries before a unit's mask start are visible at the window's first
    step (the least prefixes), for leaf queries and for queries inside nodes."""
    for inner in (False, True):
        tree = random_tree(rng, 40, 60, roots=2, inner_queries=inner)
        # (a query must see some token)
        least = tree.topology.path_tokens[tree.query_nodes] == 0
        first = np.maximum(tree.query_prefix - rng.integers(0, 8, tree.num_queries), least)
        plan = StepPlanner(HEADS, strategy=strategy, device="cpu").plan(tree, first_prefix=first)
        assert_unmasked_prefix_visible(plan, tree.with_queries(tree.query_nodes, first))
        assert np.array_equal(plan.host.work_mask_start, plan.work_mask_start.numpy())


@pytest.mark.parametrize("strategy", ["sequence", "node", "greedy", "pack", "auto"])
def test_window_mask_over_scattered_slots(rng, strategy):
    """Window plans over pages in random order (runs of slots that cross node boundaries, as a
    paged pool lays out a served batch): each entry's mask record is its own node's range and
    position, and each unit's mask starts at or before its first entry the first step hides."""
    for inner in (False, True):
        base = random_tree(rng, 40, 60, roots=2, inner_queries=inner)
        n_tok = base.num_tokens
        pages = rng.permutation(-(-n_tok // 16) + 4)
        slots = (pages[:, None] * 16 + np.arange(16)).ravel()[:n_tok]
        tree = DecodingTree.from_parents(base.parents, base.lengths, query_nodes=base.query_nodes,
                                         query_prefix=base.query_prefix, kv_indices=slots, page_size=16)
        least = tree.topology.path_tokens[tree.query_nodes] == 0
        first = np.maximum(tree.query_prefix - rng.integers(0, 8, tree.num_queries), least)
        plan = StepPlanner(HEADS, strategy=strategy, device="cpu").plan(tree, first_prefix=first)
        token = np.empty(int(slots.max()) + 1, dtype=np.int64)
        token[slots] = np.arange(n_tok)
        tok = token[plan.kv_indices.numpy()]
        node = np.repeat(np.arange(tree.num_nodes), tree.lengths)[tok]
        pos = tok - tree.kv_indptr[node]
        rec, topo = plan.tree_mask.numpy(), tree.topology
        assert np.array_equal(rec[:, 0], topo.tin[node]) and np.array_equal(rec[:, 1], topo.tout[node])
        assert np.array_equal(rec[:, 2] + np.arange(tok.size), pos)
        hide_from = np.full(tree.num_nodes, n_tok + 1)
        np.minimum.at(hide_from, tree.query_nodes, first)
        hidden = pos >= hide_from[node]
        start, end, mask_start = (t.numpy() for t in (plan.work_kv_start, plan.work_kv_end, plan.work_mask_start))
        unit_masked = np.zeros(plan.num_work, dtype=bool)
        for ln in plan.launches:
            unit_masked[ln.work_start: ln.work_end] = ln.masked
        for w in range(plan.num_work):
            at = np.flatnonzero(hidden[start[w]: end[w]])
            if at.size:
                assert mask_start[w] <= start[w] + at[0] and unit_masked[w]
        assert_unmasked_prefix_visible(plan, tree.with_queries(tree.query_nodes, first))


def _window_tree(h: int) -> tuple[DecodingTree, np.ndarray]:
    # a 700-token prompt, 6 leaves each holding the slots of the window's h - 1 later tokens
    lengths = [700] + [20 + 5 * i + h - 1 for i in range(6)]
    tree = DecodingTree.from_parents([-1] + [0] * 6, lengths, query_nodes=list(range(1, 7)), page_size=16)
    return tree, tree.query_prefix - (h - 1)


def test_window_mask_start_is_the_first_hidden_slot():
    """Window plans of a prompt and 6 leaves: each unit reads unmasked up to the first slot of a
    later step (the prompt's units, not even split, need no mask at all)."""
    tree, first = _window_tree(4)
    for strategy in ("sequence", "node"):
        plan = StepPlanner(HEADS, strategy=strategy, device="cpu").plan(tree, first_prefix=first)
        start, end, mask_start = (t.numpy() for t in (plan.work_kv_start, plan.work_kv_end, plan.work_mask_start))
        lo, pos = plan.tree_mask.numpy()[:, 0], plan.tree_mask.numpy()[:, 2] + np.arange(plan.kv_indices.numel())
        for w in range(plan.num_work):
            q = plan.row_q_indices.numpy()[plan.work_row_indptr.numpy()[w]]  # one query per leaf item
            hidden = np.flatnonzero((lo[start[w]:end[w]] > 0) & (pos[start[w]:end[w]] >= first[q]))
            assert mask_start[w] == start[w] + (hidden[0] if hidden.size else end[w] - start[w])
        assert any(mask_start[w] - start[w] >= 256 for w in range(plan.num_work))  # a prompt tile


@pytest.mark.parametrize("strategy", ["node", "greedy"])
def test_speculative_context_is_read_unmasked(strategy):
    """Queries inside a draft tree under a 300-token context: the context's units need no mask,
    though the plan has one."""
    tree = tree_from_medusa(32, context_len=300)
    plan = make_plan(tree, HEADS, strategy=strategy)
    assert plan.has_mask
    start, end, mask_start = (t.numpy() for t in (plan.work_kv_start, plan.work_kv_end, plan.work_mask_start))
    context = plan.tree_mask.numpy()[start, 0] == 0
    assert context.any() and np.array_equal(mask_start[context], end[context])
    assert "tree mask on" in plan.explain()


def test_kernel_uses_the_mask_start(device):
    """A window's ``sequence`` plan: the planned mask start (after the 100-token prompt and 12
    leaf tokens: one unmasked tile of 64) matches the reference; one past entries its row cannot
    see (the unit's end: tiles up to 192 unmasked) is wrong, and the kernel's output shows it."""
    tree = DecodingTree.from_parents([-1, 0, 0], [100, 120, 30], query_nodes=[1, 2], page_size=16)
    first = np.array([12, 25])
    planner = StepPlanner(HEADS, strategy="sequence", device=device)
    plan = planner.plan(tree, first_prefix=first)
    planner.set_prefix(plan, first)
    unit = int(np.flatnonzero(plan.row_q_indices.cpu().numpy() == 0)[0])  # query 0's unit (one row each)
    assert plan.work_mask_start[unit] - plan.work_kv_start[unit] == 100 + 12
    assert all(ln.masked and ln.block_n == 64 for ln in plan.launches)
    q = torch.randn(tree.num_queries, 8, 32, dtype=torch.float64)
    k = torch.randn(-(-tree.num_tokens // 16), 16, 2, 32, dtype=torch.float64)
    v = torch.randn_like(k)
    ref = reference_attention(q, k, v, tree.with_queries(tree.query_nodes, first))[0]
    # (workspace: the plan is not its own)
    attn = TreeAttention(torch.empty(1 << 16, device=device), device=device, backend="triton")

    def err(p):
        out = attn.run(*(t.float().to(device) for t in (q, k, v)), p).cpu()
        return float((out.double() - ref).norm() / ref.norm())

    assert err(plan) < 1e-4
    late = plan.work_mask_start.clone()
    late[unit] = plan.work_kv_end[unit]
    assert err(dataclasses.replace(plan, work_mask_start=late)) > 1e-2
