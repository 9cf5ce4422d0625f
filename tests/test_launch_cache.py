"""Launching a plan's compiled kernels directly (``ops.launch_cache``) gives what Triton's own
launch path gives, and keys every input Triton specialises on."""
import os

import numpy as np
import pytest
import torch

from helpers import rel_l2
from treeattn import TreeAttention, reference_attention
from treeattn.launchers import launch_cache
from treeattn.tree import tree_from_medusa, tree_from_spec

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")


def _inputs(tree, hq, hkv, d, dtype, device, offset=0):
    """q (a view ``offset`` elements into its storage), k and v caches of page size 1."""
    q = torch.randn(tree.num_queries * hq * d + offset, device=device, dtype=dtype)[offset:]
    k = torch.randn(int(tree.kv_indices.max()) + 1, 1, hkv, d, device=device, dtype=dtype)
    return q.view(tree.num_queries, hq, d), k, torch.randn_like(k)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's CPU interpreter")
def test_nothing_is_kept_under_the_interpreter():
    tree = tree_from_spec("1,4_40,6")
    w = TreeAttention(device="cpu", backend="triton")
    plan = w.plan(tree, num_qo_heads=4, num_kv_heads=2, head_dim=16, strategy="node")
    q, k, v = _inputs(tree, 4, 2, 16, torch.float32, "cpu")
    w.run(q, k, v, plan)
    assert launch_cache(plan) == {}


@cuda
@pytest.mark.parametrize("strategy", ["node", "paths", "sequence"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_direct_launches_match_tritons_path(strategy, dtype):
    tree = tree_from_medusa(32, context_len=300) if strategy == "paths" else tree_from_spec("1,8,32_300,40,9")
    w = TreeAttention(device="cuda")
    plan = w.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=128, dtype=dtype, strategy=strategy)
    q, k, v = _inputs(tree, 8, 2, 128, dtype, "cuda")
    first = w.run(q, k, v, plan, return_lse=True)  # Triton's path; keeps the compiled kernels
    kept = len(launch_cache(plan))
    assert kept == len(plan.launches) + (plan.merge_q_indices.numel() > 0)
    again = w.run(q, k, v, plan, return_lse=True)  # the kept kernels
    assert len(launch_cache(plan)) == kept
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # other tensors of the same kind reuse them; a misaligned q is another specialisation
    for offset, more in ((0, 0), (1, 1)):
        q2, k2, v2 = _inputs(tree, 8, 2, 128, dtype, "cuda", offset)
        out = w.run(q2, k2, v2, plan, return_lse=True)[0]  # (without the LSE: other kernels)
        assert len(launch_cache(plan)) == kept + more * len(plan.launches)
        assert rel_l2(out, reference_attention(q2, k2, v2, tree)[0]) <= 1e-2


@cuda
def test_a_patched_plan_keeps_its_own_kernels():
    tree = tree_from_spec("1,8_300,9")
    w = TreeAttention(device="cuda")
    plan = w.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=128, strategy="node")
    counts = np.zeros(tree.num_nodes, dtype=np.int64)
    counts[tree.query_nodes] = 1
    grown = tree.append(counts, tree.num_tokens + np.arange(tree.num_queries))
    q = torch.randn(tree.num_queries, 8, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(grown.num_tokens, 1, 2, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    w.run(q, k, v, plan)
    w.run(q, k, v, plan)
    patched = w.update(plan, grown)
    assert launch_cache(plan) and "_launch_cache" not in patched.__dict__
    for _ in range(2):
        out = w.run(q, k, v, patched)
        assert rel_l2(out, reference_attention(q, k, v, grown)[0]) <= 1e-2


class _FakeCompiled:
    """A compiled kernel's ``kernel[grid]`` runner, recording its calls."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a: self.calls.append((grid, a))


def test_kept_kernels_run_their_runner_with_addresses_and_their_constexprs():
    from treeattn.launchers import _Kept

    fake = _FakeCompiled()
    kept = _Kept(fake, (3, 2, 1), ("BLOCK", 64))
    kept.launch((0x1000, 5, 0.5))
    kept.launch((0x2000, 6, 0.5))
    assert fake.calls == [((3, 2, 1), (0x1000, 5, 0.5, "BLOCK", 64)), ((3, 2, 1), (0x2000, 6, 0.5, "BLOCK", 64))]
