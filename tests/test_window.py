"""Sliding-window trees (:func:`treeattn.tree.window.window_tree`): each query of the clipped tree
sees exactly the last ``W`` tokens of its path, checked in float64 against attention with an
explicit window mask, on random forests (speculative-style queries at inner nodes included)."""
import numpy as np
import pytest
import torch
from helpers import forests
from hypothesis import given
from hypothesis import strategies as st

from treeattn import DecodingTree, HeadConfig, TreeAttention, make_plan
from treeattn.reference import reference_attention, visibility_mask
from treeattn.tree.window import window_tree

pytestmark = pytest.mark.usefixtures("one_thread")


def windowed_mask(tree: DecodingTree, window: int) -> np.ndarray:
    """bool [Q, T]: query ``q`` sees token ``t`` (node-id order) and ``t`` is among the last
    ``window`` tokens of its path."""
    tok_node = np.repeat(np.arange(tree.num_nodes), tree.lengths)
    path_pos = tree.topology.path_tokens[tok_node] + np.arange(tree.num_tokens) - tree.kv_indptr[tok_node]
    return visibility_mask(tree) & (path_pos[None, :] >= (tree.visible_tokens - window)[:, None])


def seen_slots(tree: DecodingTree, mask: np.ndarray) -> set:
    q, t = np.nonzero(mask)
    return set(zip(q.tolist(), tree.kv_indices[t].tolist()))


def masked_attention(q, k, v, mask):
    """float64 attention of ``q [Q, H, D]`` over ``k, v [T, H, D]`` where ``mask [Q, T]``."""
    s = torch.einsum("qhd,thd->hqt", q, k) / q.shape[-1] ** 0.5
    s = s.masked_fill(~torch.as_tensor(mask)[None], float("-inf"))
    return torch.einsum("hqt,thd->qhd", torch.softmax(s, -1), v)


def check_window(tree: DecodingTree, window: int, seed: int = 0) -> DecodingTree:
    clipped = window_tree(tree, window)
    assert clipped.num_queries == tree.num_queries and clipped.page_size == tree.page_size
    expected = windowed_mask(tree, window)
    assert seen_slots(clipped, visibility_mask(clipped)) == seen_slots(tree, expected)
    assert np.array_equal(clipped.visible_tokens, np.minimum(tree.visible_tokens, window))
    gen = torch.Generator().manual_seed(seed)
    slots = int(tree.kv_indices.max()) + 1
    q = torch.randn(tree.num_queries, 2, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(slots, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(slots, 2, 8, generator=gen, dtype=torch.float64)
    kv = torch.from_numpy(tree.kv_indices.copy())
    ref = masked_attention(q, k[kv], v[kv], expected)
    out, _ = reference_attention(q, k[:, None], v[:, None], clipped)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    return clipped


@given(forests(max_nodes=20, max_len=10), st.integers(1, 40))
def test_window_tree_sees_the_last_w_tokens(tree, window):
    check_window(tree, window)


def test_degenerate_windows():
    # a 12-token prompt, two branches of 3 and 5 tokens, one with a child of 4: queries at depths
    # 15, 17 and 21 (different window starts) and one inside the prompt (a speculative-style query)
    tree = DecodingTree.from_parents([-1, 0, 0, 2], [12, 3, 5, 4], query_nodes=[1, 2, 3, 0],
                                     query_prefix=[3, 5, 4, 7])
    assert window_tree(tree, 21) is tree                          # W >= every path: unchanged
    one = check_window(tree, 1)                                   # each query sees its own token
    assert one.node_extent.sum() == 4 and np.array_equal(one.visible_tokens, [1, 1, 1, 1])
    six = check_window(tree, 6)
    assert np.array_equal(six.visible_tokens, [6, 6, 6, 6])
    for w in (2, 9, 13, 16, 20):
        check_window(tree, w)


def test_lockstep_queries_keep_sharing_and_skip_what_no_window_reaches():
    # 3 samples of a 20-token prompt, 2 tokens each: one window start, the prompt read once
    tree = DecodingTree.from_parents([-1, 0, 0, 0], [20, 2, 2, 2])
    clipped = check_window(tree, 5)
    assert clipped.num_nodes == 4 and clipped.num_tokens == 3 + 3 * 2
    assert np.array_equal(clipped.kv_indices[:3], [17, 18, 19])
    # a window inside the leaves: the prompt is not in the tree at all
    leaves = check_window(tree, 2)
    assert leaves.num_nodes == 3 and leaves.num_tokens == 6 and (leaves.parents == -1).all()


@pytest.mark.parametrize("strategy", ["auto", "sequence", "node", "flatten"])
def test_planned_window_tree_matches_masked_attention(rng, strategy):
    tree = DecodingTree.from_parents([-1, 0, 0, 1, 1, 2], [30, 6, 9, 2, 4, 3], page_size=4, num_slots=64)
    tree = tree.with_queries([3, 4, 5, 2], [2, 4, 3, 5])
    clipped = window_tree(tree, 10)
    plan = make_plan(clipped, HeadConfig(4, 2, 16, torch.float32), strategy=strategy)
    q = torch.from_numpy(rng.standard_normal((4, 4, 16)))
    k = torch.from_numpy(rng.standard_normal((16, 4, 2, 16)))
    v = torch.from_numpy(rng.standard_normal((16, 4, 2, 16)))
    out = TreeAttention(backend="torch").run(q, k, v, plan)
    kv = torch.from_numpy(tree.kv_indices.copy())
    flat_k, flat_v = k.reshape(64, 2, 16)[kv], v.reshape(64, 2, 16)[kv]
    ref = masked_attention(q, flat_k.repeat_interleave(2, 1), flat_v.repeat_interleave(2, 1),
                           windowed_mask(tree, 10))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_window_must_be_positive():
    tree = DecodingTree.from_parents([-1], [3])
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="window must be a positive integer"):
            window_tree(tree, bad)
