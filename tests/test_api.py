"""The public API: tree_attention's contract, plan/run validation, merge_states."""
import os

import numpy as np
import pytest
import torch

from helpers import rel_l2
from treeattn.launchers import merge_partials
from treeattn.plan.lower.merge_config import merge_config
from treeattn import (STRATEGIES, DecodingTree, KVPool, KVPoolOutOfMemory, TreeAttention,
                      merge_states, reference_attention, tree_attention)
from treeattn.tree import tree_from_spec


def dense_path_attention(q, k, v, parents, lengths, query_nodes, query_prefix):
    """Attention of each query over its explicitly gathered path (independent of the tree code)."""
    starts = np.concatenate(([0], np.cumsum(lengths)))
    outs = []
    for i, (node, prefix) in enumerate(zip(query_nodes, query_prefix)):
        toks = list(range(starts[node], starts[node] + prefix))
        u = parents[node]
        while u >= 0:
            toks = list(range(starts[u], starts[u + 1])) + toks
            u = parents[u]
        kk = k[toks].double().repeat_interleave(q.shape[1] // k.shape[1], 1)
        vv = v[toks].double().repeat_interleave(q.shape[1] // k.shape[1], 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[i].double(), kk) / q.shape[2] ** 0.5, -1)
        outs.append(torch.einsum("ht,thd->hd", p, vv))
    return torch.stack(outs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tree_attention_contract(backend, strategy, device):
    parents = [3, 3, 0, -1, 0]  # parents after children; node 3 is the root
    lengths = [4, 6, 2, 9, 1]
    q = torch.randn(3, 4, 64)
    k, v = torch.randn(22, 2, 64), torch.randn(22, 2, 64)
    on = (lambda *ts: [t.to(device) for t in ts]) if backend == "triton" else (lambda *ts: ts)
    out = tree_attention(*on(q, k, v), parents, lengths, strategy=strategy, backend=backend).cpu()
    ref = dense_path_attention(q, k, v, parents, lengths, [1, 2, 4], [6, 2, 1])  # leaves in id order
    assert rel_l2(out, ref) <= 1e-4
    out = tree_attention(*on(q, k, v), parents, lengths, query_nodes=[0, 3, 1], query_prefix=[2, 5, 0],
                         strategy=strategy, backend=backend).cpu()
    ref = dense_path_attention(q, k, v, parents, lengths, [0, 3, 1], [2, 5, 0])
    assert rel_l2(out, ref) <= 1e-4


def test_tree_attention_bad_inputs():
    q, k = torch.randn(2, 4, 16), torch.randn(10, 2, 16)
    with pytest.raises(ValueError, match="lengths sum to 9"):
        tree_attention(q, k, k, [-1, 0, 0], [5, 2, 2])
    with pytest.raises(ValueError, match="q has 2 queries but the tree has 1"):
        tree_attention(q, k, k, [-1, 0], [5, 5])
    with pytest.raises(ValueError, match="do not match"):
        tree_attention(torch.randn(2, 3, 16), k, k, [-1, 0, 0], [6, 2, 2])
    with pytest.raises(TypeError, match="dtype mismatch"):
        tree_attention(q.double(), k, k, [-1, 0, 0], [6, 2, 2])
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        tree_attention(q.numpy(), k, k, [-1, 0, 0], [6, 2, 2])
    with pytest.raises(ValueError, match="unknown strategy"):
        tree_attention(q, k, k, [-1, 0, 0], [6, 2, 2], strategy="radix")
    with pytest.raises(ValueError, match="unknown backend"):
        tree_attention(q, k, k, [-1, 0, 0], [6, 2, 2], backend="cuda")
    with pytest.raises(ValueError, match="cycle"):
        tree_attention(q, k, k, [1, 2, 0], [6, 2, 2])
    with pytest.raises(TypeError, match="dtype"):
        tree_attention(q.int(), k.int(), k.int(), [-1, 0, 0], [6, 2, 2])


def test_run_validates_against_the_plan():
    tree = DecodingTree.from_parents([-1, 0, 0], [8, 3, 3])
    w = TreeAttention(backend="triton")
    plan = w.plan(tree, num_qo_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    q, kc = torch.randn(2, 4, 32), torch.randn(14, 1, 2, 32)
    with pytest.raises(ValueError, match="3 queries"):
        w.run(torch.randn(3, 4, 32), kc, kc, plan)
    with pytest.raises(ValueError, match="head shape mismatch"):
        w.run(torch.randn(2, 4, 32), torch.randn(14, 1, 4, 32), torch.randn(14, 1, 4, 32), plan)
    with pytest.raises(ValueError, match="page out of range"):
        w.run(q, kc[:10], kc[:10], plan)
    with pytest.raises(ValueError, match="page size 2"):
        w.run(q, kc.view(7, 2, 2, 32), kc.view(7, 2, 2, 32), plan)
    with pytest.raises(ValueError, match="contiguous in its last"):
        w.run(torch.randn(2, 32, 4).transpose(1, 2), kc, kc, plan)
    with pytest.raises(ValueError, match="out must be"):
        w.run(q, kc, kc, plan, out=torch.empty(2, 4, 16))
    with pytest.raises(TypeError, match="plan must be a Plan"):
        w.run(q, kc, kc, "plan")
    with pytest.raises(ValueError, match="workspace"):
        TreeAttention(torch.empty(4), backend="triton").plan(tree, num_qo_heads=4, num_kv_heads=2,
                                                              head_dim=32)


def test_triton_run_on_cpu_tensors_without_the_interpreter_names_the_problem(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tree = DecodingTree.from_parents([-1, 0, 0], [30, 3, 7])
    w = TreeAttention(backend="triton")
    plan = w.plan(tree, num_qo_heads=2, num_kv_heads=1, head_dim=16, dtype=torch.float32, strategy="node")
    k = torch.randn(40, 1, 1, 16)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        w.run(torch.randn(2, 2, 16), k, k, plan)


def test_caller_owned_workspace_and_lse(device):
    tree = DecodingTree.from_parents([-1, 0, 0, 1], [30, 3, 7, 2])
    ws = torch.empty(1 << 16, device=device)
    w = TreeAttention(ws, backend="triton")
    plan = w.plan(tree, num_qo_heads=2, num_kv_heads=1, head_dim=16, dtype=torch.float32, strategy="node")
    assert plan.workspace_bytes() <= ws.numel() * 4
    q, k, v = torch.randn(2, 2, 16), torch.randn(42, 1, 1, 16), torch.randn(42, 1, 1, 16)
    out, lse = (t.cpu() for t in w.run(q.to(device), k.to(device), v.to(device), plan, return_lse=True))
    o_ref, lse_ref = reference_attention(q, k, v, tree)
    assert rel_l2(out, o_ref) <= 1e-4 and rel_l2(lse, lse_ref) <= 1e-5
    assert lse.dtype == torch.float32


def test_partial_buffers_are_made_once_per_plan_and_workspace():
    w = TreeAttention(backend="triton")
    heads = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16)
    small = w.plan(DecodingTree.from_parents([-1, 0, 0], [30, 3, 7]), strategy="node", **heads)
    first = w.partial_buffers(small)
    assert all(a is b for a, b in zip(first, w.partial_buffers(small)))
    big = w.plan(tree_from_spec("1,64_300,20"), strategy="node", **heads)  # grows the workspace
    again = w.partial_buffers(small)
    assert all(a is not b for a, b in zip(first, again))
    assert again[0].untyped_storage().data_ptr() == w._workspace.data_ptr() == w.partial_buffers(big)[0].data_ptr()


@pytest.mark.parametrize("dtype,head_dim", [(torch.float16, 33), (torch.bfloat16, 16), (torch.float32, 33)])
def test_partial_buffers_keep_16_bit_outputs_and_aligned_fp32_lse(dtype, head_dim):
    """16-bit inputs get 16-bit partial outputs (half the partial traffic), fp32 inputs fp32; the
    fp32 LSEs after them stay 4-byte aligned and overlap nothing, and a poisoned workspace never
    reaches the output."""
    tree = DecodingTree.from_parents([-1, 0, 0, 1], [30, 3, 7, 2])
    w = TreeAttention(backend="triton")
    plan = w.plan(tree, num_qo_heads=3, num_kv_heads=1, head_dim=head_dim, dtype=dtype, strategy="node")
    o_part, lse_part = w.partial_buffers(plan)
    assert o_part.dtype == plan.heads.partial_dtype == (torch.float32 if dtype == torch.float32 else dtype)
    assert o_part.shape == (plan.num_rows, 3, head_dim) and lse_part.shape == (plan.num_rows, 3)
    assert lse_part.dtype == torch.float32 and lse_part.data_ptr() % 4 == 0
    o_end = o_part.data_ptr() + o_part.numel() * o_part.element_size()
    assert o_end <= lse_part.data_ptr()
    assert lse_part.data_ptr() + lse_part.numel() * 4 <= w._workspace.data_ptr() + plan.workspace_bytes()
    assert plan.io.partial_write == plan.num_rows * 3 * (head_dim * o_part.element_size() + 4)
    if os.environ.get("TRITON_INTERPRET") == "1":
        w._workspace.fill_(float("nan"))
        q = torch.randn(2, 3, head_dim).to(dtype)
        k, v = torch.randn(42, 1, 1, head_dim).to(dtype), torch.randn(42, 1, 1, head_dim).to(dtype)
        out = w.run(q, k, v, plan)
        o_ref, _ = reference_attention(q.double(), k.double(), v.double(), tree)
        assert torch.isfinite(out).all()
        assert rel_l2(out, o_ref) <= (1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_merge_states(backend, device):
    n, s, h, d = 5, 3, 4, 24
    k, v = torch.randn(n, s * 7, h, d, dtype=torch.float64), torch.randn(n, s * 7, h, d, dtype=torch.float64)
    q = torch.randn(n, h, d, dtype=torch.float64)
    scores = torch.einsum("nhd,nthd->nht", q, k)
    full_lse = torch.logsumexp(scores, -1)
    full_o = torch.einsum("nht,nthd->nhd", torch.softmax(scores, -1), v)
    parts = scores.view(n, h, s, 7)
    lse = torch.logsumexp(parts, -1).permute(0, 2, 1)  # [n, s, h]
    o = torch.einsum("nhst,nsthd->nshd", torch.softmax(parts, -1), v.view(n, s, 7, h, d))
    lse[0, 1] = float("-inf")  # an empty partial state contributes nothing
    o[0, 1] = 0
    full_lse[0] = torch.logsumexp(torch.stack([parts[0, :, 0], parts[0, :, 2]], 1).reshape(h, -1), -1)
    full_o[0] = (torch.exp(lse[0, 0] - full_lse[0])[:, None] * o[0, 0]
                 + torch.exp(lse[0, 2] - full_lse[0])[:, None] * o[0, 2])
    dev = device if backend == "triton" else "cpu"
    mo, ml = (t.cpu() for t in merge_states(o.float().to(dev), lse.float().to(dev), backend=backend))
    assert rel_l2(mo, full_o) <= 1e-5 and rel_l2(ml, full_lse) <= 1e-6
    with pytest.raises(ValueError, match="N, S, H, D"):
        merge_states(o[0], lse[0])


def test_pool_stays_consistent_after_errors():
    pool = KVPool(num_pages=4, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    b = pool.new_branch()
    pool.append(b, 10)
    with pytest.raises(KVPoolOutOfMemory):
        pool.append(pool.fork(b), 100)
    pool.check()
    tree = pool.tree()
    w = TreeAttention(backend="triton")
    plan = w.plan(tree, num_qo_heads=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype mismatch"):
        w.run(torch.randn(tree.num_queries, 1, 8, dtype=torch.float16), pool.k_cache(0), pool.v_cache(0), plan)
    pool.check()


@pytest.mark.slow
@pytest.mark.parametrize("s", [1, 16, 37])
def test_merge_states_many_rows_matches_torch(device, s):
    """Queries with many partial rows, one of them with no KV at all, against the torch backend
    (12 heads: a head block and a partial one)."""
    n, heads, d = 12, 12, 48
    o = torch.randn(n, s, heads, d)
    lse = torch.randn(n, s, heads) * 3
    lse[1] = float("-inf")  # no KV at all: output 0, lse -inf
    lse[2, : s // 2] = float("-inf")
    mo, ml = (t.cpu() for t in merge_states(o.to(device), lse.to(device), backend="triton"))
    ro, rl = merge_states(o, lse, backend="torch")
    assert torch.isinf(ml[1]).all() and (ml[1] < 0).all() and not mo[1].abs().any()
    keep = torch.ones(n, dtype=torch.bool)
    keep[1] = False
    assert rel_l2(mo[keep], ro[keep]) <= 1e-5 and rel_l2(ml[keep], rl[keep]) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("block_h,num_warps,row_tile", [(4, 2, 0), (1, 1, 0), (2, 1, 2), (1, 1, 4), (None, None, 32)])
def test_merge_states_launch_configs_match_torch(device, block_h, num_warps, row_tile):
    """The merge's other launch configs: the row loop (4 heads and 2 warps a program: what many
    queries get), and row tiles smaller than a query's rows (several blocks, the last one
    partial) or larger."""
    n, s, heads, d = 30, 3, 16, 16
    o = torch.randn(n, s, heads, d, device=device)
    lse = torch.randn(n, s, heads, device=device) * 3
    lse[5, 1] = float("-inf")
    lse[7, :, 2] = float("-inf")  # a head that saw nothing in any row
    idx = torch.arange(n * s + 1, dtype=torch.int32, device=device)
    out = torch.empty(n, heads, d, device=device)
    lse_out = torch.empty(n, heads, device=device)
    with pytest.raises(ValueError, match="merge_indptr must be a contiguous int32"):
        merge_partials(o.view(n * s, heads, d), lse.view(n * s, heads), idx[:n], idx[::s], idx[:-1], out, None)
    merge_partials(o.view(n * s, heads, d), lse.view(n * s, heads), idx[:n], idx[::s].contiguous(), idx[:-1],
                   out, lse_out, block_h=block_h, num_warps=num_warps, row_tile=row_tile)
    ro, rl = merge_states(o.cpu(), lse.cpu(), backend="torch")
    finite = torch.isfinite(rl)
    assert not torch.isnan(out).any() and torch.equal(torch.isfinite(lse_out.cpu()), finite)
    assert rel_l2(out.cpu(), ro) <= 1e-5 and rel_l2(lse_out.cpu()[finite], rl[finite]) <= 1e-6


def test_merge_config_tiles():
    """Many queries: the row loop, 4 heads and 2 warps a program; few: one warp, and a row tile
    that takes a query's rows in one block where it fits the register budget."""
    assert merge_config(1024, 32, 128) == (4, 2, 0) and merge_config(256, 32, 128, 3) == (8, 4, 0)
    assert merge_config(64, 32, 128) == (2, 1, 4) and merge_config(10, 32, 128, 3) == (1, 1, 4)
    assert merge_config(10, 32, 128, 18) == (1, 1, 32)
    assert merge_config(64, 32, 128, 18) == (2, 1, 16)  # (2 heads of 128 a warp: at most 16 rows)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sequence", "greedy", "flatten"])
def test_layer_read_on_the_device_selects_that_layers_caches(strategy, device):
    """``run(..., layer=t, layer_stride=s)`` over layer 0's caches equals running on layer
    ``t[0]``'s caches (the pool's stacked layout): one CUDA graph can then serve every layer."""
    tree = DecodingTree.from_parents([-1, 0, 0, 1, 1], [21, 5, 9, 3, 4], page_size=4, num_slots=64)
    layers, hkv, d = 3, 2, 32
    stacked = torch.randn(2 * layers, 16, 4, hkv, d, device=device)  # [K0, V0, K1, V1, ...]
    stride = stacked[2].data_ptr() // 4 - stacked[0].data_ptr() // 4
    w = TreeAttention(device=device, backend="triton")
    plan = w.plan(tree, num_qo_heads=4, num_kv_heads=hkv, head_dim=d, dtype=torch.float32, strategy=strategy)
    q = torch.randn(tree.num_queries, 4, d, device=device)
    layer = torch.empty(1, dtype=torch.int32, device=device)
    for l in range(layers):
        layer.fill_(l)
        got = w.run(q, stacked[0], stacked[1], plan, layer=layer, layer_stride=stride)
        want, _ = reference_attention(q.double().cpu(), stacked[2 * l].double().cpu(),
                                      stacked[2 * l + 1].double().cpu(), tree)
        assert rel_l2(got.cpu(), want) <= 1e-4
    with pytest.raises(ValueError, match="int32"):
        w.run(q, stacked[0], stacked[1], plan, layer=layer.long(), layer_stride=stride)


def test_inputs_checked_once_per_kind_and_again_for_a_patched_plan():
    """A kind of input that passed for a plan passes at once; a plan patched to read further
    slots checks its inputs against its own sizes."""
    import numpy as np

    from treeattn.tree import tree_from_spec

    tree = tree_from_spec("1,4_40,6")
    w = TreeAttention(device="cpu")
    plan = w.plan(tree, num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    q = torch.randn(tree.num_queries, 4, 16)
    k = torch.randn(tree.num_tokens, 1, 2, 16)
    w.run(q, k, k, plan)
    w.run(q, k, k, plan)
    assert len(plan.__dict__["_checked_inputs"]) == 1
    counts = np.zeros(tree.num_nodes, dtype=np.int64)
    counts[tree.query_nodes] = 1
    grown = tree.append(counts, tree.num_tokens + np.arange(tree.num_queries))
    patched = w.update(plan, grown)
    with pytest.raises(ValueError, match="page out of range"):
        w.run(q, k, k, patched)
    with pytest.raises(TypeError, match="dtype mismatch"):
        w.run(q, k.half(), k.half(), plan)
