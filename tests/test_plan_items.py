"""Work-item helpers against their straightforward versions."""
import numpy as np
import pytest
import torch
from helpers import random_tree

from treeattn import HeadConfig
from treeattn.plan import PLANNERS, CostModel
from treeattn.plan.strategies.items import DeferredItems, WorkItems, items_from_groups
from treeattn.plan.strategies.split import split_long_items
from treeattn.tree.topology import ranges


def split_reference(items: WorkItems, max_len, *, align: int = 16) -> WorkItems:
    """split_long_items as first written (every step spelled out, generic grouping at the end)."""
    n = items.num_items
    length = items.item_len
    max_len = np.maximum(np.broadcast_to(np.asarray(max_len, dtype=np.int64), (n,)), 1)
    chunks = np.maximum(1, -(-length // max_len))
    if np.all(chunks == 1):
        return items
    chunk_len = -(-length // chunks)
    chunk_len = np.minimum(np.maximum(align, -(-chunk_len // align) * align), np.maximum(length, 1))
    chunks = np.maximum(1, -(-length // chunk_len))
    seg_len = items.seg_hi - items.seg_lo
    seg_item = np.repeat(np.arange(n), np.diff(items.seg_indptr))
    csum = np.concatenate(([0], np.cumsum(seg_len)))
    seg_start = csum[:-1] - csum[items.seg_indptr[:-1]][seg_item]
    live = np.flatnonzero(seg_len > 0)
    cl = chunk_len[seg_item[live]]
    c0, c1 = seg_start[live] // cl, (seg_start[live] + seg_len[live] - 1) // cl
    piece_seg = np.repeat(live, c1 - c0 + 1)
    piece_chunk = ranges(c0, c1 + 1)
    piece_cl = np.repeat(cl, c1 - c0 + 1)
    start = np.maximum(piece_chunk * piece_cl, seg_start[piece_seg])
    end = np.minimum((piece_chunk + 1) * piece_cl, seg_start[piece_seg] + seg_len[piece_seg])
    piece_lo = items.seg_lo[piece_seg] + (start - seg_start[piece_seg])
    base = np.concatenate(([0], np.cumsum(chunks)))[:-1]
    chunk_item = np.repeat(np.arange(n), chunks)
    q_new_item = np.repeat(np.arange(chunk_item.size), items.item_queries[chunk_item])
    q_new = items.q_indices[ranges(items.q_indptr[chunk_item], items.q_indptr[chunk_item + 1])]
    q_tokens = None
    if items.q_tokens is not None and np.array_equal(items.q_tokens, np.repeat(length, items.item_queries)):
        local = np.arange(chunk_item.size) - base[chunk_item]
        q_tokens = np.minimum(chunk_len[chunk_item], length[chunk_item] - local * chunk_len[chunk_item])[q_new_item]
    return items_from_groups(base[seg_item[piece_seg]] + piece_chunk, items.seg_node[piece_seg], piece_lo,
                             piece_lo + (end - start), q_new_item, q_new, int(chunks.sum()), q_tokens=q_tokens)


def assert_same_items(a: WorkItems, b: WorkItems) -> None:
    for name in ("seg_indptr", "seg_node", "seg_lo", "seg_hi", "q_indptr", "q_indices", "q_tokens"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype == np.int64, name
            np.testing.assert_array_equal(x, y, err_msg=name)


HEADS = HeadConfig(32, 8, 128, torch.bfloat16)


@pytest.mark.parametrize("strategy", sorted(PLANNERS))
def test_split_long_items_matches_reference(rng, strategy):
    for _ in range(10):
        tree = random_tree(rng, int(rng.integers(1, 40)), 300, roots=int(rng.integers(1, 3)),
                           inner_queries=True)
        items, _ = PLANNERS[strategy](tree, HEADS, CostModel())
        for max_len in (1, 16, 100, rng.integers(1, 200, items.num_items)):
            assert_same_items(split_long_items(items, max_len), split_reference(items, max_len))


def test_split_long_items_with_empty_items_and_segments():
    items = items_from_groups([0, 0, 2, 2], [0, 1, 2, 3], [0, 5, 0, 0], [40, 5, 70, 3], [0, 2, 2],
                              [0, 1, 2], 4, q_tokens=np.array([40, 73, 73]))
    for max_len in (16, 30, [10, 1, 20, 5]):
        for align in (1, 16, 24):
            assert_same_items(split_long_items(items, max_len, align=align),
                              split_reference(items, max_len, align=align))


def test_take_keeps_content(rng):
    tree = random_tree(rng, 30, 50, inner_queries=True)
    items, _ = PLANNERS["pack"](tree, HEADS, CostModel())
    same = items.take(np.arange(items.num_items))
    assert_same_items(same, items)
    perm = rng.permutation(items.num_items)
    taken = items.take(perm)
    np.testing.assert_array_equal(taken.item_len, items.item_len[perm])
    np.testing.assert_array_equal(taken.item_queries, items.item_queries[perm])


@pytest.mark.parametrize("strategy", sorted(PLANNERS))
def test_deferred_items_summary_matches_made_items(rng, strategy):
    # what the cost model reads before the items are made (lengths, query counts, merge rows)
    # agrees with the made items, for the used items and for any subset
    for _ in range(10):
        tree = random_tree(rng, int(rng.integers(1, 40)), 300, roots=int(rng.integers(1, 3)),
                           inner_queries=True)
        items, _ = PLANNERS[strategy](tree, HEADS, CostModel(min_split_tokens=16, deft_chunk_tokens=24))
        for deferred in (items, split_long_items(items, int(rng.integers(1, 64)))):
            if not isinstance(deferred, DeferredItems):
                continue
            made = deferred.made
            assert type(made) is WorkItems
            np.testing.assert_array_equal(deferred.item_len, WorkItems.__dict__["item_len"].func(made))
            np.testing.assert_array_equal(deferred.item_queries, made.q_indptr[1:] - made.q_indptr[:-1])
            assert deferred.num_items == made.num_items
            used = (deferred.item_len > 0) & (deferred.item_queries > 0)
            assert deferred.used_merge_rows() == made.merge_rows_max(used)
            for subset in (used, used & (rng.random(used.size) < 0.5), np.zeros_like(used)):
                assert deferred.merge_rows_max(subset) == made.merge_rows_max(subset)
