"""treeattn.distributed: sharded decode over torch.distributed (gloo, CPU processes) against the
single-process float64 reference, plus host-side unit tests (shard_tree, local parts, formulas,
the merge arithmetic) that simulate the ranks in one process."""
from __future__ import annotations

import datetime
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import forests, random_tree, rel_l2, spawn_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn import DecodingTree, TreeAttention, merge_states
from treeattn.distributed import (
    CommStats,
    comm_volume,
    local_tree_part,
    peak_memory,
    plan_tree_shard,
    run_local,
    shard_tree,
    sharded_attention,
    sharded_tree_attention,
)
from treeattn.distributed.combine import merge_running, pack_partial, unpack_merged
from treeattn.reference import reference_attention

TOL = 1e-5
D = 16


# ---------------------------------------------------------------- cases shared by parent and ranks
def _seq_cases(world: int) -> list[dict]:
    """Sharded-sequence cases: (name, heads, queries, shard lengths in rank order)."""
    cases = [
        {"name": "mha_even", "hq": 4, "hkv": 4, "b": 3, "lens": [23] * world},
        {"name": "gqa_uneven", "hq": 8, "hkv": 2, "b": 2, "lens": [5 + 17 * r for r in range(world)]},
        {"name": "gqa_empty_rank", "hq": 8, "hkv": 2, "b": 4, "lens": [0] + [31 + r for r in range(1, world)]},
        {"name": "one_token", "hq": 4, "hkv": 1, "b": 1, "lens": [0] * (world - 1) + [1]},
    ]
    return cases


def _seq_inputs(case: dict, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = sum(case["lens"])
    q = torch.randn(case["b"], case["hq"], D, generator=g)
    k = torch.randn(n, case["hkv"], D, generator=g)
    v = torch.randn(n, case["hkv"], D, generator=g)
    return q, k, v


def _tree_cases(world: int) -> list[dict]:
    """Forest cases: a tree, its shards and heads."""
    out = []
    for i, (nodes, max_len, roots, inner) in enumerate([(12, 20, 1, False), (25, 12, 3, True),
                                                        (40, 6, 2, True)]):
        rng = np.random.default_rng(100 * world + i)
        tree = random_tree(rng, nodes, max_len, roots=roots, inner_queries=inner)
        out.append({"name": f"forest{i}", "tree": tree, "hq": 8, "hkv": 2 if i % 2 else 8,
                        "shards": shard_tree(tree.parents, tree.lengths, world), "strategy": "auto"})
    # fewer tokens than ranks: some rank holds nothing
    tiny = DecodingTree.from_parents([-1, 0, 0], [1, 0, world - 2], query_nodes=[1, 2, 2],
                                     query_prefix=[0, min(1, world - 2), world - 2])
    out.append({"name": "tiny", "tree": tiny, "hq": 4, "hkv": 2, "strategy": "node",
                    "shards": shard_tree(tiny.parents, tiny.lengths, world)})
    assert min(s.numel() for s in out[-1]["shards"]) == 0
    # an arbitrary (non-contiguous) partition, prefix-aware planner "pack"
    tree = out[1]["tree"]
    rng = np.random.default_rng(7 * world)
    perm = torch.from_numpy(rng.permutation(tree.num_tokens))
    out.append({"name": "scattered", "tree": tree, "hq": 8, "hkv": 2, "strategy": "pack",
                    "shards": list(torch.tensor_split(perm, world))})
    return out


def _tree_inputs(case: dict, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = case["tree"]
    q = torch.randn(t.num_queries, case["hq"], D, generator=g)
    k = torch.randn(t.num_tokens, case["hkv"], D, generator=g)
    v = torch.randn(t.num_tokens, case["hkv"], D, generator=g)
    return q, k, v


def _bench_module():
    """benchmarks/bench_distributed.py, imported by path."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "bench_distributed.py")
    spec = importlib.util.spec_from_file_location("bench_distributed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench_smoke(rank: int, world: int) -> list:
    """The benchmark's per-case logic (--cpu-smoke settings, tiny contexts) on this process group."""
    bench = _bench_module()
    args = bench.parse_args(["--cpu-smoke", "--contexts", "3,600", "--batches", "2"])
    timer = bench.Timer(args, torch.device("cpu"))
    return [bench.run_case(c, b, args, rank, world, torch.device("cpu"), torch.float32, "torch", timer)
            for c in args.context_list for b in args.batch_list]


# ---------------------------------------------------------------- the spawned job (one per world)
def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        results = {}
        for ci, case in enumerate(_seq_cases(world)):
            q, k, v = _seq_inputs(case, ci)
            lo = sum(case["lens"][:rank])
            kl, vl = k[lo:lo + case["lens"][rank]], v[lo:lo + case["lens"][rank]]
            for method in ("tree", "ring"):
                stats = CommStats()
                o = sharded_attention(q, kl, vl, method=method, stats=stats)
                results[f"seq/{case['name']}/{method}"] = o
                results[f"stats/{case['name']}/{method}"] = stats.summary()
        for ci, case in enumerate(_tree_cases(world)):
            q, k, v = _tree_inputs(case, 1000 + ci)
            t, shard = case["tree"], case["shards"][rank]
            stats = CommStats()
            o = sharded_tree_attention(q, k[shard], v[shard], t.parents, t.lengths, shard,
                                       query_nodes=t.query_nodes, query_prefix=t.query_prefix,
                                       strategy=case["strategy"], stats=stats)
            results[f"tree/{case['name']}"] = o
            results[f"stats/{case['name']}/tree"] = stats.summary()
        if world == 2:
            results["bench"] = _bench_smoke(rank, world)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp_path) -> list[dict]:
    return spawn_ranks(_worker, world, (world, str(tmp_path / "init"), str(tmp_path)), tmp_path, timeout=150.0)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_gloo(world, tmp_path):
    res = _spawn(world, tmp_path)
    for ci, case in enumerate(_seq_cases(world)):
        q, k, v = _seq_inputs(case, ci)
        tree = DecodingTree.from_parents([-1], [k.shape[0]], query_nodes=[0] * q.shape[0])
        ref, _ = reference_attention(q, k.unsqueeze(1), v.unsqueeze(1), tree)
        for method in ("tree", "ring"):
            key = f"seq/{case['name']}/{method}"
            for r in range(world):
                assert rel_l2(res[r][key], ref) <= TOL, (key, r)
                if method == "tree":  # the ring merges in a rank-dependent order: rounding differs
                    assert torch.equal(res[r][key], res[0][key]), (key, "ranks disagree")
        # what was communicated: the tree method's two all-reduces (eq. 13), the ring's KV
        st_tree = res[0][f"stats/{case['name']}/tree"]
        b, hq = q.shape[0], case["hq"]
        assert st_tree["all_reduce"]["calls"] == 2
        assert st_tree["all_reduce"]["numel"] == comm_volume(
            "tree", world, num_queries=b, num_qo_heads=hq, head_dim=D)["numel"]
        for r in range(world):
            sent = res[r][f"stats/{case['name']}/ring"].get("send", {"numel": 0})["numel"]
            passed = sum(case["lens"][(r - s) % world] for s in range(world - 1))
            assert sent == 2 * passed * case["hkv"] * D
    for ci, case in enumerate(_tree_cases(world)):
        q, k, v = _tree_inputs(case, 1000 + ci)
        ref, _ = reference_attention(q, k.unsqueeze(1), v.unsqueeze(1), case["tree"])
        key = f"tree/{case['name']}"
        for r in range(world):
            assert rel_l2(res[r][key], ref) <= TOL, (key, r)
            assert torch.equal(res[r][key], res[0][key]), (key, "ranks disagree")
    if world == 2:  # benchmarks/bench_distributed.py's case logic, as --cpu-smoke runs it
        rows = res[0]["bench"]
        assert [(c["context"], c["batch"]) for c in rows] == [(3, 2), (600, 2)]
        for row in rows:
            assert set(row["methods"]) == {"tree", "ring", "single"}
            for m in ("tree", "ring"):
                assert row["methods"][m]["rel_l2_vs_single"] <= TOL
                assert row["methods"][m]["comm"]["ratio"] == pytest.approx(1.0)
        targets = _bench_module().evaluate_targets(rows)
        assert targets["tree_volume_within_10pct_of_eq14"]["pass"] is True


# ---------------------------------------------------------------- host-side unit tests
def _flat_order_tokens(tree: DecodingTree) -> np.ndarray:
    """Node-ordered KV index of every depth-first position, by a per-node walk."""
    out = []
    for node in tree.topology.order:
        out.extend(range(int(tree.kv_indptr[node]), int(tree.kv_indptr[node + 1])))
    return np.asarray(out, dtype=np.int64)


@given(forests(max_nodes=60, max_len=40), st.integers(1, 6))
def test_shard_tree_balanced_cover_deterministic(tree, world):
    shards = shard_tree(tree.parents, tree.lengths, world)
    assert len(shards) == world
    sizes = [s.numel() for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == tree.num_tokens
    assert all(s.dtype == torch.int64 for s in shards)
    flat = torch.cat(shards).numpy()
    assert np.array_equal(flat, _flat_order_tokens(tree))  # contiguous depth-first ranges
    again = shard_tree(list(tree.parents), list(tree.lengths), world)
    assert all(torch.equal(a, b) for a, b in zip(shards, again))


def test_shard_tree_errors():
    with pytest.raises(ValueError):
        shard_tree([-1], [0], 2)
    with pytest.raises(ValueError):
        shard_tree([-1, 0], [3, 1], 0)
    with pytest.raises(ValueError):
        shard_tree([1, 0], [3, 1], 2)  # cycle
    with pytest.raises(ValueError):
        local_tree_part([-1], [4], torch.tensor([0, 0]))
    with pytest.raises(ValueError):
        local_tree_part([-1], [4], torch.tensor([4]))


@settings(max_examples=15)
@given(forests(max_nodes=30, max_len=20), st.integers(1, 4), st.booleans(),
       st.sampled_from(["auto", "node", "flatten", "pack"]))
def test_local_parts_merge_to_reference(tree, world, scatter, strategy):
    """Simulated ranks: local parts of any partition, merged by LSE, equal the reference; the
    packed numerator/denominator arithmetic of the all-reduce gives the same result."""
    rng = np.random.default_rng(tree.num_tokens * 7 + world)
    hq, hkv = 4, 2
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q = torch.randn(tree.num_queries, hq, D, generator=g)
    k = torch.randn(tree.num_tokens, hkv, D, generator=g)
    v = torch.randn(tree.num_tokens, hkv, D, generator=g)
    ref, _ = reference_attention(q, k.unsqueeze(1), v.unsqueeze(1), tree)
    if scatter:
        perm = torch.from_numpy(rng.permutation(tree.num_tokens))
        shards = list(torch.tensor_split(perm, world))
    else:
        shards = shard_tree(tree.parents, tree.lengths, world)
    outs, lses = [], []
    for shard in shards:
        part = local_tree_part(tree.parents, tree.lengths, shard, query_nodes=tree.query_nodes,
                               query_prefix=tree.query_prefix)
        assert part.lengths.sum() == shard.numel()
        w = TreeAttention(backend="torch")
        lp = plan_tree_shard(w, part, num_qo_heads=hq, num_kv_heads=hkv, head_dim=D,
                             dtype=torch.float32, strategy=strategy)
        o, lse = run_local(w, q, k[shard].unsqueeze(1), v[shard].unsqueeze(1), lp)
        outs.append(o)
        lses.append(lse)
    merged, _ = merge_states(torch.stack(outs, 1), torch.stack(lses, 1), backend="torch")
    assert rel_l2(merged, ref) <= TOL
    m = torch.stack(lses, 1).amax(1)
    packed = sum(pack_partial(o, lse, m, use_triton=False) for o, lse in zip(outs, lses))
    assert rel_l2(unpack_merged(packed, torch.float32, use_triton=False), ref) <= TOL
    acc_o, acc_lse = outs[0].float(), lses[0]
    for o, lse in zip(outs[1:], lses[1:]):
        acc_o, acc_lse = merge_running(acc_o, acc_lse, o, lse)
    assert rel_l2(acc_o, ref) <= TOL


def test_plan_local_paged_pool():
    """The engine path: a local part whose tokens live in a paged pool at scattered slots, with
    queries that see no local token (o = 0, lse = -inf)."""
    from treeattn.distributed import plan_local
    rng = np.random.default_rng(3)
    parents, lengths = [-1, 0, 0, 1], [5, 0, 7, 3]  # local token counts
    qn, qp = [1, 2, 3, 2, 1], [0, 4, 2, 0, 0]
    hq, hkv, page = 4, 2, 4
    num_slots = 64
    slots = rng.permutation(num_slots)[:15]
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(num_slots // page, page, hkv, D, generator=g)
    vc = torch.randn(num_slots // page, page, hkv, D, generator=g)
    q = torch.randn(len(qn), hq, D, generator=g)
    w = TreeAttention(backend="torch")
    lp = plan_local(w, parents, lengths, query_nodes=qn, query_prefix=qp, kv_indices=slots,
                    page_size=page, num_slots=num_slots, num_qo_heads=hq, num_kv_heads=hkv,
                    head_dim=D, dtype=torch.float32)
    o, lse = run_local(w, q, kc, vc, lp)
    tree = DecodingTree.from_parents(parents, lengths, query_nodes=qn, query_prefix=qp,
                                     kv_indices=slots, page_size=page, num_slots=num_slots)
    ref, ref_lse = reference_attention(q, kc, vc, tree)
    assert rel_l2(o, ref) <= TOL
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    o2, _ = run_local(w, q, kc, vc, plan_tree_shard(w, tree, num_qo_heads=hq, num_kv_heads=hkv,
                                                      head_dim=D, dtype=torch.float32))
    assert rel_l2(o2, ref) <= TOL  # a DecodingTree is a valid local part
    empty = plan_local(w, parents, [0, 0, 0, 0], query_nodes=qn, query_prefix=[0] * 5,
                       num_qo_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float32)
    o, lse = run_local(w, q, kc, vc, empty)
    assert empty.plan is None and (o == 0).all() and torch.isneginf(lse).all()
    part = plan_local(w, [-1, 0], [0, 2], query_nodes=[0, 1], query_prefix=[0, 1],
                      num_qo_heads=hq, num_kv_heads=hkv, head_dim=D, dtype=torch.float32)
    assert part.active.tolist() == [1]
    o, lse = run_local(w, q[:2], kc.reshape(-1, 1, hkv, D), vc.reshape(-1, 1, hkv, D), part)
    assert (o[0] == 0).all() and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()
    with pytest.raises(ValueError):
        plan_local(w, [-1], [3], query_nodes=[0], query_prefix=[4], num_qo_heads=hq,
                   num_kv_heads=hkv, head_dim=D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_triton_matches_torch(dtype, device):
    """The fused pack/unpack kernels (interpreter on CPU) against the PyTorch path, with -inf."""
    g = torch.Generator().manual_seed(0)
    o = torch.randn(3, 4, 20, generator=g).to(dtype)
    lse = torch.randn(3, 4, generator=g)
    m = lse + torch.rand(3, 4, generator=g)
    lse[0, 1] = float("-inf")
    o[0, 1] = 0
    lse[2, 2] = m[2, 2] = float("-inf")
    o[2, 2] = 0
    a = pack_partial(o.to(device), lse.to(device), m.to(device), use_triton=True).cpu()
    b = pack_partial(o, lse, m, use_triton=False)
    assert torch.isfinite(a).all() and torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    assert a[2, 2].abs().max() == 0
    ua = unpack_merged(a.to(device), dtype, use_triton=True).cpu()
    ub = unpack_merged(b, dtype, use_triton=False)
    assert ua.dtype == dtype and torch.allclose(ua.float(), ub.float(), rtol=1e-2, atol=1e-2)
    assert (ua[2, 2] == 0).all()


def test_triton_pack_of_cpu_tensors_without_the_interpreter_names_the_problem(monkeypatch):
    """CPU tensors with ``use_triton=True`` and the interpreter off: a clear error, not one from
    deep in Triton's launcher."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    o, lse = torch.randn(2, 3, 8), torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        pack_partial(o, lse, lse, use_triton=True)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        unpack_merged(torch.randn(2, 3, 9), torch.float32, use_triton=True)


def test_formulas_match_paper():
    # Tree: eq. 13 numel = b d + 2 b n_h, eq. 14 volume = 2 (p - 1) / p numel
    v = comm_volume("tree", 2, num_queries=1, num_qo_heads=32, head_dim=128)
    assert v["numel"] == 32 * 128 + 64
    assert v["per_rank_elements"] == v["numel"]
    v4 = comm_volume("tree", 4, num_queries=3, num_qo_heads=16, head_dim=128)
    assert v4["per_rank_elements"] == pytest.approx(1.5 * (3 * 16 * 128 + 2 * 3 * 16))
    assert v4["per_rank_bytes"] == 4 * v4["per_rank_elements"]
    # Ring: eq. 10 = 2 b t d p; a full pass is p - 1 steps
    r = comm_volume("ring", 4, num_queries=1, num_qo_heads=16, head_dim=128, num_tokens=4000)
    assert r["eq10_elements"] == 2 * 1000 * 16 * 128 * 4
    assert r["total_elements"] == 3 * r["eq10_elements"]
    r2 = comm_volume("ring", 2, num_queries=1, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                     num_tokens=1 << 20)
    assert r2["total_elements"] == r2["eq10_elements"] == 2 * (1 << 19) * 8 * 128 * 2
    assert r2["per_rank_bytes"] == 2 * (1 << 19) * 8 * 128 * 2
    # Memory: eq. 8 = 4 b t d + 2 b d, eq. 9 = 2 b t d + 2 b d + 2 b n_h
    mr = peak_memory("ring", 2, num_tokens=2000, num_queries=1, num_qo_heads=16, head_dim=64)
    mt = peak_memory("tree", 2, num_tokens=2000, num_queries=1, num_qo_heads=16, head_dim=64)
    d = 16 * 64
    assert mr["elements"] == 4 * 1000 * d + 2 * d
    assert mt["elements"] == 2 * 1000 * d + 2 * d + 2 * 16
    assert mt["bytes"] == 2 * mt["elements"]
    with pytest.raises(ValueError):
        comm_volume("star", 2, num_queries=1, num_qo_heads=1, head_dim=1)


def test_requires_process_group():
    q = torch.randn(1, 2, D)
    k = torch.randn(4, 2, D)
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        sharded_attention(q, k, k)

