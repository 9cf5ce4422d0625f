"""Engine pieces on their own: model-directory and template errors, samplers, the sequence tree and
KV cache managers."""
import contextlib
import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from treeattn import KVPool  # noqa: E402
from treeattn.engine import (KVCacheManager, ModelConfig, Sampler, SequenceTree, TreeEngine,  # noqa: E402
                             TreeModel, load_config)
from treeattn.engine.workloads import (SpeculativeReplayController, ToTReplayController,  # noqa: E402
                                       WorkloadSpec, build_workload)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   eos_token_id=None, bos_token_id=None, pad_token_id=None)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def _copy_config(src, dst, **changes):
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ---------------------------------------------------------------------- malformed model directories
def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TreeModel.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        TreeModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("changes, match", [
    ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
    ({"hidden_size": None}, "hidden_size must be a positive integer"),
    ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "lacks"),
])
def test_bad_config_values(tmp_path, hf_dir, changes, match):
    with pytest.raises(ValueError, match=match):
        load_config(_copy_config(hf_dir, tmp_path / "m", **changes))


def test_bad_config_json_and_missing_keys(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    with pytest.raises(ValueError, match="missing required key"):
        load_config(tmp_path)


def test_pickle_only_checkpoint_is_refused(tmp_path, hf_dir):
    d = _copy_config(hf_dir, tmp_path / "m")
    (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="never unpickles"):
        TreeModel.from_pretrained(d)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        TreeModel.from_pretrained(d)


def test_broken_shards_and_tensors(tmp_path, hf_dir):
    from safetensors.torch import load_file, save_file

    d = _copy_config(hf_dir, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="shard-1.safetensors"):
        TreeModel.from_pretrained(d)
    (d / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError, match="malformed safetensors index"):
        TreeModel.from_pretrained(d)
    (d / "model.safetensors.index.json").unlink()
    tensors = load_file(hf_dir / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 tensor"):
        TreeModel.from_pretrained(d)
    _copy_config(hf_dir, d, intermediate_size=48)
    save_file(load_file(hf_dir / "model.safetensors"), d / "model.safetensors")
    with pytest.raises(ValueError, match="has shape"):
        TreeModel.from_pretrained(d)


def test_presets_and_positions():
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("llama-1t")
    assert ModelConfig.preset("llama3-8b").num_parameters() == pytest.approx(8.03e9, rel=0.01)
    m = TreeModel.random(ModelConfig(
        arch="mistral", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=8, max_position_embeddings=64, sliding_window=8))
    eng = TreeEngine(m, kv_tokens=256)
    root = eng.tree.add_root()
    eng.prefill(root, list(range(9)))               # past the sliding window: windowed attention
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.prefill(root, [1] * 56)


# ---------------------------------------------------------------------- malformed workloads
def test_malformed_templates(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"data": {"0": {"id": 0, "value": 5, "children": [7]}}}]))
    with pytest.raises(ValueError, match="child 7, which is not a node"):
        ToTReplayController.from_template(str(bad), 0, vocab_size=16)
    bad.write_text(json.dumps([{"data": {"0": {"id": 0, "value": 5, "children": []},
                                         "1": {"id": 1, "value": 5, "children": []}}}]))
    with pytest.raises(ValueError, match="exactly one root"):
        ToTReplayController.from_template(str(bad), 0, vocab_size=16)
    with pytest.raises(FileNotFoundError, match="no workload"):
        ToTReplayController.from_template("no-such-template", 0, vocab_size=16)
    with pytest.raises(ValueError, match="no record 999"):
        SpeculativeReplayController.from_medusa(32, 999, vocab_size=16)
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload(WorkloadSpec("chess", vocab_size=16))
    with pytest.raises(ValueError, match="unknown ToT template"):
        build_workload(WorkloadSpec("tot-chess", vocab_size=16))


# ---------------------------------------------------------------------- samplers
def test_samplers():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    assert torch.equal(Sampler(greedy=True)(logits), logits.argmax(-1))
    assert torch.equal(Sampler(top_k=1, seed=3)(logits), logits.argmax(-1))
    assert torch.equal(Sampler(top_p=1e-6, seed=3)(logits), logits.argmax(-1))
    a, b = Sampler(seed=7), Sampler(seed=7)
    assert torch.equal(a(logits), b(logits))
    top3 = torch.topk(logits, 3).indices
    for _ in range(20):
        t = Sampler(top_k=3, seed=_)(logits)
        assert all(t[i] in top3[i] for i in range(5))
    draws = Sampler(seed=1)(torch.log(torch.tensor([[0.7, 0.3]])).expand(20000, 2))
    assert abs(draws.float().mean().item() - 0.3) < 0.02
    for bad in ({"temperature": 0}, {"top_k": -1}, {"top_p": 0}):
        with pytest.raises(ValueError):
            Sampler(**bad)


# ---------------------------------------------------------------------- tree and KV managers
def test_branch_prune_and_cascade_free_pages():
    pool = KVPool(64, 4, 1, 8, num_layers=1, dtype=torch.float32)
    tree = SequenceTree(KVCacheManager(pool))
    root = tree.add_root()
    tree.extend(root, list(range(10)))
    a, b = tree.branch(root, 2)
    tree.extend(a, [1, 2])
    a1, a2 = tree.branch(a, 2)
    tree.extend(a1, [3])
    tree.append_one([a2, b], torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="only leaves grow"):
        tree.extend(a, [9])
    assert tree.tokens(a1) == list(range(10)) + [1, 2, 3] and tree.tokens(b) == list(range(10)) + [5]
    assert tree.path_len(a2) == 13 and tree.active() == [b, a1, a2]
    dt = tree.decoding_tree([a1, a2, b])
    assert dt.num_queries == 3 and dt.num_tokens == 10 + 2 + 1 + 1 + 1
    tree.prune(a1)
    tree.prune(a2)                      # a is frozen and childless now: it goes too
    assert a not in tree and root in tree
    tree.finish(b, score=1.0)
    assert tree.result_tokens(tree.results[0])[-1] == 5
    tree.prune(b)                       # ... and so does the root
    assert tree.num_nodes == 0
    pool.check()
    assert pool.num_free_pages == pool.num_pages
    with pytest.raises(ValueError, match="unknown node"):
        tree.prune(b)


def test_decoding_tree_merges_chains_without_queries():
    """A prompt cached in blocks (a chain of single-child nodes) is one node of the decoding tree;
    every query still sees its whole path, in order, and keeps its own node and window slots."""
    pool = KVPool(64, 4, 1, 8, num_layers=1, dtype=torch.float32)
    kv = KVCacheManager(pool)
    tree = SequenceTree(kv)
    root = tree.add_root()
    tree.extend(root, list(range(5)))
    chain = [root]
    for i in range(3):                                   # root -> b0 -> b1 -> b2, blocks of 3
        (nxt,) = tree.branch(chain[-1], 1)
        tree.extend(nxt, [10 + i] * 3)
        chain.append(nxt)
    x, y = tree.branch(chain[-1], 2)                     # a branch point, then a chain below x
    tree.extend(x, [7, 7])
    (x2,) = tree.branch(x, 1)
    tree.extend(x2, [8])
    (q1,) = tree.branch(x2, 1)
    tree.extend(q1, [1])
    tree.extend(y, [2])
    extra = {q1: kv.reserve(q1, 2)}
    dt = tree.decoding_tree([q1, y], extra=extra)
    assert dt.num_nodes == 4                            # root+b0..b2 | x+x2 | q1 | y
    assert dt.num_tokens == 14 + 3 + 3 + 1
    for j, q in enumerate((q1, y)):
        owner, nodes = dt.paths(np.array([dt.query_nodes[j]]))
        seen = np.concatenate([dt.kv_indices[dt.kv_indptr[n]: dt.kv_indptr[n + 1]] for n in nodes])
        want = np.concatenate((tree.path_slots(q), extra.get(q, np.zeros(0, dtype=np.int64))))
        assert np.array_equal(seen, want)
        assert dt.lengths[dt.query_nodes[j]] == kv.num_tokens(q) + extra.get(q, np.zeros(0)).size
    # a query inside the chain keeps its node: nothing above it merges into it
    dt = tree.decoding_tree([chain[2], q1])
    assert dt.num_nodes == 4 and dt.lengths[dt.query_nodes[0]] == 3    # root+b0 | b1 | b2+x+x2 | q1



def test_decoding_tree_after_branch_add_and_prune_matches_a_fresh_tree():
    """The paths cached for the queries stay true as the tree changes (leaves branch, requests
    join a cached prompt, subtrees go): every step's tree equals one built with no cache, each
    query sees its whole path, and no chain of single-child nodes without a query is left."""
    rng = np.random.default_rng(0)
    pool = KVPool(512, 4, 1, 8, num_layers=1, dtype=torch.float32)
    tree = SequenceTree(KVCacheManager(pool))
    root = tree.add_root()
    tree.extend(root, [1, 2, 3])
    (leaf,) = tree.branch(root, 1)
    tree.extend(leaf, [4])
    for step in range(60):
        leaves = tree.active()
        op = rng.integers(4)
        if op == 0:                                      # a leaf branches
            for k in tree.branch(leaves[rng.integers(len(leaves))], int(rng.integers(1, 3))):
                tree.extend(k, [5] * int(rng.integers(1, 3)))
        elif op == 1:                                    # a new request under an inner node
            inner = [n for n in range(tree._next) if n in tree and tree.children(n)]
            (k,) = tree.add_children(inner[rng.integers(len(inner))], 1)
            tree.extend(k, [6])
        elif op == 2 and len(leaves) > 1:                # a request ends (cached prompt stays or not)
            tree.prune(leaves[rng.integers(len(leaves))], cascade=bool(rng.integers(2)))
        else:
            tree.append_one(leaves, torch.arange(len(leaves)))
        qs = tree.active()
        dt = tree.decoding_tree(qs)
        fresh = SequenceTree(tree.kv)
        fresh._nodes = tree._nodes
        ref = fresh.decoding_tree(qs)
        for name in ("parents", "lengths", "kv_indptr", "kv_indices", "query_nodes", "query_prefix"):
            assert np.array_equal(getattr(dt, name), getattr(ref, name)), (step, name)
        owner, nodes = dt.paths(dt.query_nodes)
        for j, q in enumerate(qs):
            seen = [dt.kv_indices[dt.kv_indptr[n]: dt.kv_indptr[n + 1]] for n in nodes[owner == j]]
            assert np.array_equal(np.concatenate(seen), tree.path_slots(q))
        kids = np.bincount(dt.parents[dt.parents >= 0], minlength=dt.num_nodes)
        is_query = np.isin(np.arange(dt.num_nodes), dt.query_nodes)
        child = dt.parents >= 0
        assert not (child & (kids[dt.parents] == 1) & ~is_query[dt.parents] & ~is_query).any()

def test_reserved_slots_become_tokens_or_holes():
    pool = KVPool(32, 4, 1, 8, num_layers=2, dtype=torch.float32)
    kv = KVCacheManager(pool)
    kv.new_root(0)
    kv.append(0, 3)
    res = kv.reserve(0, 5)
    assert np.array_equal(kv.append(0, 2), res[:2]) and kv.num_tokens(0) == 5
    kv.drop_reserved(0)
    assert kv.append(0, 1)[0] not in res and pool.length(kv._branch[0]) == 3 + 5 + 1
    src, dst = torch.tensor([0, 1]), torch.tensor([5, 6])
    pool.k_cache(1).view(-1, 1, 8)[src] = 1.0
    kv.copy(src, dst)
    assert torch.all(pool.k_cache(1).view(-1, 1, 8)[dst] == 1.0)
    kv.remove(0)
    kv.release_private()
    assert pool.num_free_pages == pool.num_pages


def test_prefill_rejects_token_ids_outside_the_vocabulary():
    import pytest

    from treeattn.engine import BeamSearchController, TreeEngine, TreeModel

    engine = TreeEngine(TreeModel.random("tiny", device="cpu"))
    with pytest.raises(ValueError, match="out of the model's vocabulary"):
        engine.run(BeamSearchController([1, 10**6], num_beams=2, max_new_tokens=2))
    with pytest.raises(ValueError, match="out of the model's vocabulary"):
        engine.run(BeamSearchController([-3, 1], num_beams=2, max_new_tokens=2))


def _batch_with_failures(model, batched: bool):
    """In one batch: a two-block chain whose second block is pruned before the pass (evicted) and
    whose freed page the last prefill takes, a prefill whose logits are forgotten, and one that
    runs out of pages. Returns (engine, the last prefill's logits, the forgotten node, the slots
    of the tokens left, the prefill calls' token counts)."""
    from treeattn import KVPoolOutOfMemory

    eng = TreeEngine(model, page_size=4, kv_tokens=64)
    pool, calls, prefill = eng.pool, [], model.prefill
    model.prefill = lambda *a, **kw: (calls.append(a[0].shape[0]), prefill(*a, **kw))[1]
    try:
        with eng.batched_prefill() if batched else contextlib.nullcontext():
            a = eng.prefill_chain(None, [list(range(1, 9)), [9, 10, 11, 12]])
            b = eng.prefill_chain(None, [[20, 21, 22, 23, 24]])
            eng.forget_logits(b[-1])
            free = pool.num_free_pages
            with pytest.raises(KVPoolOutOfMemory):
                eng.prefill_chain(b[-1], [[1] * 200])
            assert pool.num_free_pages == free and len(eng.tree.children(b[-1])) == 0
            gone = eng.kv.own_slots(a[1]).copy()
            eng.tree.prune(a[1], cascade=False)
            c = eng.prefill_chain(a[0], [[30, 31, 32, 33, 34]])
            assert np.isin(eng.kv.own_slots(c[0]), gone).any()     # its slots were a[1]'s
            logits = eng.logits_of(c[0])                          # runs the queued pass
            assert not eng._queued
    finally:
        del model.prefill
    slots = np.concatenate([eng.tree.path_slots(b[0]), eng.tree.path_slots(c[0])])
    return eng, logits, b[0], slots, calls


def test_batched_prefill_leaves_out_pruned_tokens_and_keeps_forgotten_kv():
    model = TreeModel.random("tiny")
    (eng, lb, forgot, slots, calls), (sep, ls, _, sslots, scalls) = (_batch_with_failures(model, b)
                                                                     for b in (True, False))
    assert calls == [8 + 5 + 5] and scalls == [12, 5, 5]
    assert (slots == sslots).all() and (lb - ls).abs().max().item() <= 1e-5
    for (k, v), (sk, sv) in zip(eng.kv.caches, sep.kv.caches):
        assert (k[slots] - sk[slots]).abs().max().item() <= 1e-5 and (v[slots] - sv[slots]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="no logits"):
        eng.logits_of(forgot)
    eng.pool.check()
    eng.reset()
    assert eng.pool.num_free_pages == eng.pool.num_pages
    ar = torch.arange(6)
    with pytest.raises(ValueError, match="as many segment lengths"):
        model.prefill(ar, ar, ar, [ar[:0], ar[:2]], eng.kv.caches, lengths=[6])
    with pytest.raises(ValueError, match="sum to the 6 tokens"):
        model.prefill(ar, ar, ar, [ar[:0], ar[:2]], eng.kv.caches, lengths=[3, 2])


def test_precompile_kernels_is_a_no_op_on_the_torch_backend():
    from treeattn.engine import TreeEngine, TreeModel

    eng = TreeEngine(TreeModel.random("tiny"), kv_tokens=256, backend="torch")
    assert eng.precompile_kernels() == 0


def test_precompile_kernels_passes_the_engines_compile_workers(monkeypatch):
    """``compile_workers`` (``--compile-workers``) reaches ``precompile``; its default is one a
    CPU core, up to 16."""
    import os

    import treeattn.api
    from treeattn.engine import TreeEngine, TreeModel

    seen = []
    monkeypatch.setattr(treeattn.api, "precompile", lambda heads, **kw: seen.append(kw["workers"]) or 1)
    model = TreeModel.random("tiny")
    assert TreeEngine(model, kv_tokens=256, backend="triton", compile_workers=3).precompile_kernels() == 1
    TreeEngine(model, kv_tokens=256, backend="triton").precompile_kernels()
    assert seen == [3, min(16, os.cpu_count() or 1)]


def test_verify_trees_share_structure_and_plan_as_fresh_trees():
    """Speculative verification steps build trees with the previous step's structure; their plans
    are those of trees built from scratch."""
    from treeattn import STRATEGIES, DecodingTree, HeadConfig, make_plan

    pool = KVPool(256, 16, 1, 8, num_layers=1, dtype=torch.float32)
    kv = KVCacheManager(pool)
    tree = SequenceTree(kv)
    ctx = tree.add_root()
    tree.extend(ctx, list(range(300)))
    drafts = np.array([-1, -1, 0, 0, 1, 2, 2, 5, -1, 4])
    heads = HeadConfig(32, 8, 128, torch.bfloat16)
    prev = None
    for accept in (3, 1, 4, 2):
        tree.append_run(ctx, torch.tensor([7]))
        dt = tree.decoding_tree([ctx], drafts=(ctx, drafts, kv.scratch(drafts.size)))
        if prev is not None:
            assert dt._structure is prev._structure
        fresh = DecodingTree(dt.parents, dt.lengths, dt.kv_indptr, dt.kv_indices, dt.query_nodes,
                             dt.query_prefix, dt.page_size, dt.num_slots)
        for strategy in STRATEGIES:
            a = make_plan(dt, heads, strategy=strategy)
            b = make_plan(fresh, heads, strategy=strategy)
            assert a.strategy == b.strategy and a.launches == b.launches
            for name in ("kv_indices", "work_kv_start", "work_kv_end", "work_row_indptr", "row_q_indices",
                         "merge_indptr", "merge_indices", "tree_mask", "query_pos",
                         "query_prefix"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (strategy, name)
        tree.append_run(ctx, torch.arange(accept - 1))
        prev = dt


def test_auto_decision_is_reused_until_the_tree_changes_scale():
    """The engine's planner reuses auto's choice while a verify loop's tree keeps its shape, and
    decides again once the growing prefix crosses a power of two of KV tokens."""
    from treeattn import HeadConfig
    from treeattn.engine.planning import StepPlanner
    from treeattn.tree import tree_from_medusa

    planner = StepPlanner(HeadConfig(32, 8, 128, torch.bfloat16), strategy="auto", device="cpu")
    first = planner.plan(tree_from_medusa(32, context_len=90))  # 90 + 32 tokens: 7 bits
    assert first.requested_strategy == "auto"
    again = planner.plan(tree_from_medusa(32, context_len=80))
    assert again.requested_strategy == first.strategy  # same shape, same octave: reused
    longer = planner.plan(tree_from_medusa(32, context_len=2800))
    assert longer.requested_strategy == "auto"  # decided again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_plans_are_64_byte_aligned():
    """Triton specialises kernels on pointer alignment: every tensor of a plan moved to the GPU
    starts 64-byte aligned, whatever the sizes of the tensors before it."""
    from treeattn import HeadConfig
    from treeattn.engine.planning import StepPlanner
    from treeattn.tree import tree_from_medusa

    planner = StepPlanner(HeadConfig(32, 8, 128, torch.bfloat16), strategy="flatten", device="cuda")
    for ctx in (45, 301, 1000):
        tree = tree_from_medusa(32, context_len=ctx)
        plan = planner.plan(tree, first_prefix=tree.query_prefix - 1)
        for name in ("kv_indices", "work_kv_start", "work_row_indptr", "row_q_indices", "row_direct",
                     "merge_q_indices", "tree_mask", "query_pos", "query_prefix"):
            assert getattr(plan, name).data_ptr() % 64 == 0, name


def test_layer_stride_matches_the_pool_layout_and_step_attention_falls_back_to_eager():
    """``KVCacheManager.layer_stride`` is the element distance between consecutive layers' K (and V)
    caches, which the engine's per-step attention graph adds on the device; without graphs (CPU)
    ``for_step`` runs every layer eagerly, as ``attend(layer, q, out)`` does."""
    from treeattn import DecodingTree

    eng = TreeEngine(TreeModel.random("tiny", device="cpu"), kv_tokens=256)
    k0, v0 = eng.pool.k_cache(0), eng.pool.v_cache(0)
    for layer in range(1, eng.pool.num_layers):
        for cache, first in ((eng.pool.k_cache(layer), k0), (eng.pool.v_cache(layer), v0)):
            assert cache.data_ptr() - first.data_ptr() == layer * eng.kv.layer_stride * first.element_size()
    assert eng._attn_graph is None  # CPU: no CUDA graphs
    c = eng.model.config
    tree = DecodingTree.from_parents([-1, 0], [5, 2], page_size=eng.pool.page_size,
                                     num_slots=eng.pool.num_slots)
    plan = eng.attention.plan(tree, num_qo_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                              head_dim=c.head_dim, dtype=eng.model.dtype)
    attend = eng._attend_fn(plan)
    q = torch.randn(tree.num_queries, c.num_heads, c.head_dim, dtype=eng.model.dtype)
    for layer in range(eng.pool.num_layers):
        want = attend(layer, q, torch.empty_like(q))
        out = torch.empty_like(q)
        eng._attend_fn(plan).for_step(q, out)(layer)
        assert torch.equal(out, want)


@pytest.mark.parametrize("sliding", [False, True])
def test_step_attention_replays_through_the_attention_graph_runner(sliding):
    """With an attention-graph runner, ``for_step`` captures once per step and plan (the full
    layers' and the sliding-window layers') and every layer replays its plan's graph through
    ``runner.replay`` (which records the barrier event after each replay on a GPU), between the
    layer's ``attn_begin`` and ``attn_end`` hooks. The runner here is a stand-in that attends
    eagerly (CPU has no CUDA graphs)."""
    from dataclasses import replace

    from treeattn import DecodingTree
    from treeattn.tree import window_tree

    config = ModelConfig.preset("tiny")
    if sliding:
        config = replace(config, sliding_window=4, layer_types=("full_attention", "sliding_attention"))
    eng = TreeEngine(TreeModel.random(config, device="cpu"), kv_tokens=256)
    c = eng.model.config
    tree = DecodingTree.from_parents([-1, 0, 0], [7, 3, 2], page_size=eng.pool.page_size,
                                     num_slots=eng.pool.num_slots)
    kw = dict(num_qo_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=eng.model.dtype)
    plan = eng.attention.plan(tree, **kw)
    window = eng.attention.plan(window_tree(tree, 4), **kw) if sliding else None
    plans = [window if sliding and layer == 1 else plan for layer in range(c.num_layers)]
    calls = []

    class Runner:
        def capture(self, attention, q, out, plan_, *, sm_scale=None):
            calls.append("capture")
            self.q, self.out, self.layer = q, out, 0
            return plan_

        def replay(self, graph):
            calls.append(("replay", graph is window, self.layer))
            eng.attention.run(self.q, *eng._paged[self.layer], graph, out=self.out)
            self.layer += 1

    eng._attn_graph = Runner()
    eng.hook = lambda event, layer: calls.append((event, layer))
    q = torch.randn(tree.num_queries, c.num_heads, c.head_dim, dtype=eng.model.dtype)
    out = torch.empty_like(q)
    step = eng._attend_fn(plan, window).for_step(q, out)
    for layer in range(eng.pool.num_layers):
        step(layer)
        want = eng.attention.run(q, *eng._paged[layer], plans[layer])
        assert torch.equal(out, want)
    expect = ["capture"] * (2 if sliding else 1)
    for layer in range(eng.pool.num_layers):
        expect += [("attn_begin", layer), ("replay", plans[layer] is window, layer), ("attn_end", layer)]
    assert calls == expect


def test_auto_decision_is_reused_across_similar_batches_and_not_across_sharing():
    """A serving batch that gains or loses a request keeps auto's choice (same powers of two of
    nodes, queries, tokens and sharing); a batch whose queries share much more decides again."""
    from treeattn import DecodingTree, HeadConfig
    from treeattn.engine.planning import StepPlanner

    planner = StepPlanner(HeadConfig(32, 8, 128, torch.bfloat16), strategy="auto", device="cpu")

    def batch(n, shared, own):  # n requests under one system prompt of ``shared`` tokens
        return DecodingTree.from_parents([-1] + [0] * n, [shared] + [own] * n)

    assert planner.plan(batch(5, 300, 2500)).requested_strategy == "auto"
    assert planner.plan(batch(6, 300, 2500)).requested_strategy != "auto"  # reused
    assert planner.plan(batch(6, 6000, 100)).requested_strategy == "auto"  # 10x the sharing


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["greedy", "node", "flatten", "sequence"])
def test_window_plans_mask_the_launches_that_read_hidden_slots(strategy, rng, device):
    """A decode window plans with every query seeing its own node's reserved slots and lowers each
    query's prefix before every step. Launches reading a slot some step hides apply the tree mask;
    a launch over shared ancestors only (few-shot's prompt) skips it. Every step of the window
    matches the reference at its prefix."""
    from treeattn import DecodingTree, HeadConfig, TreeAttention
    from treeattn.engine.planning import StepPlanner
    from treeattn.reference import reference_attention

    h = 4  # window: 3 reserved slots per leaf
    parents, lengths = [-1] + [0] * 6, [700] + [int(x) + h - 1 for x in rng.integers(1, 40, 6)]
    tree = DecodingTree.from_parents(parents, lengths, query_nodes=list(range(1, 7)), page_size=16)
    heads = HeadConfig(8, 2, 32, torch.float32)
    planner = StepPlanner(heads, strategy=strategy, device=device)
    first = tree.query_prefix - (h - 1)
    plan = planner.plan(tree, first_prefix=first)
    assert plan.has_mask
    lo, start, end = (t.cpu().numpy() for t in (plan.tree_mask[:, 0], plan.work_kv_start, plan.work_kv_end))
    root_only = [ln for ln in plan.launches if np.all(lo[start[ln.work_start]: end[ln.work_end - 1]] == 0)]
    assert all(not ln.masked for ln in root_only)
    assert all(ln.masked for ln in plan.launches if ln not in root_only)
    if strategy in ("greedy", "node"):
        assert root_only  # the prompt has launches of its own here
    q = torch.randn(tree.num_queries, 8, 32, dtype=torch.float64)
    k = torch.randn(-(-tree.num_tokens // 16), 16, 2, 32, dtype=torch.float64)
    v = torch.randn_like(k)
    # the Triton kernel (the interpreter on CPU): the torch backend ignores the launches' flags
    attn = TreeAttention(torch.empty(1 << 16, device=device), device=device, backend="triton")
    for step in range(h):
        prefix = first + step
        planner.set_prefix(plan, prefix)
        out = attn.run(*(t.float().to(device) for t in (q, k, v)), plan).cpu()
        seen = DecodingTree.from_parents(parents, lengths, query_nodes=list(range(1, 7)),
                                         query_prefix=prefix, page_size=16)
        ref = reference_attention(q, k, v, seen)[0]
        err = float((out.double() - ref).norm() / ref.norm())
        assert err < 1e-4, (step, err)


def test_engine_plans_for_launches_one_after_another():
    """The engine runs a plan's launches without side streams, so its planner's cost model rates
    them one after another and no plan runs tallest first."""
    from treeattn.engine import TreeEngine, TreeModel

    eng = TreeEngine(TreeModel.random("tiny"), kv_tokens=256, backend="torch")
    assert eng.planner.cost is eng.attention.cost and not eng.planner.cost.side_streams
