"""Sequence-sharded engine (:mod:`treeattn.engine.sharded`) and tensor parallelism
(:mod:`treeattn.engine.parallel`) on gloo CPU ranks: a tiny Llama decoded with branching and beam
search by 2 ranks (KV sequence-sharded, then tensor-parallel) and by a 2 x 2 TP x SP grid gives
the single-process engine's tokens, and each rank holds only its share of the weights and KV."""
from __future__ import annotations

import dataclasses
import datetime
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import free_port, save_tiny_llama, spawn_ranks

from treeattn.engine import (
    BeamSearchController,
    Sampler,
    SamplingController,
    TreeEngine,
    TreeModel,
    periodic_branching,
)
from treeattn.engine.config import ModelConfig, load_config
from treeattn.engine.parallel import TensorParallel, init_grid, make_grid
from treeattn.engine.sharded import ShardedKVCacheManager, ShardedTreeEngine
from treeattn.engine.weights import load_weights, random_weights

PAGE, BLOCK = 4, 4
#: the tensor-parallel runs' Llama: 2 KV heads (one per TP rank), every bias, an untied LM head
TP_LLAMA = dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)
#: weights split over the TP ranks (the rest is replicated, the row-parallel biases on rank 0)
SPLIT = ("qkv", "qkv_bias", "o", "gate_up", "gate_up_bias", "down", "embed", "lm_head")


def _model() -> TreeModel:
    return TreeModel.random("tiny", seed=3, std=0.2)


def _controllers():
    sample = SamplingController([list(range(3, 22)), [9, 8, 7, 6, 5]], n=2, sampler=Sampler(greedy=True),
                                max_new_tokens=12, callbacks=periodic_branching(4, 2, 8))
    beam = BeamSearchController([5, 17, 99, 3, 42, 7, 1, 100], num_beams=3, max_new_tokens=10)
    return {"sample": sample, "beam": beam}


def _tokens(name: str, result: dict):
    if name == "beam":
        return result["sequences"]
    return [leaf["tokens"] for leaf in result["leaves"]]


def _drive(engine) -> dict:
    """Run every workload; record tokens, the leaves' last logits and, for the sampling tree,
    local / total KV tokens."""
    out = {}
    for name, ctl in _controllers().items():
        counts = {}

        def on_step(step, stats, eng=engine, counts=counts):
            nodes = eng.kv.nodes
            local = sum(eng.kv.num_tokens(n) for n in nodes)
            total = sum(eng.kv.total_tokens(n) for n in nodes) if isinstance(
                eng.kv, ShardedKVCacheManager) else local
            counts[step] = (local, total, eng.pool.num_pages - eng.pool.num_free_pages)
        result = engine.run(ctl, on_step=on_step)
        out[name] = _tokens(name, result)
        if name == "sample":
            out["sample/logits"] = torch.stack([leaf["logits"] for leaf in result["leaves"]])
        out[f"{name}/counts"] = counts
        engine.reset()
        out[f"{name}/freed"] = engine.pool.num_free_pages == engine.pool.num_pages
    return out


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _shares(engine) -> dict:
    """Bytes of each kind of weight (summed over layers) and of the KV pool."""
    w = engine.model.weights
    out = {k: sum(_nbytes(getattr(layer, k)) for layer in w.layers)
           for k in ("qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down", "down_bias",
                     "attn_norm", "mlp_norm")}
    out.update(embed=_nbytes(w.embed), lm_head=_nbytes(w.lm_head), norm=_nbytes(w.norm),
               kv=engine.pool.k_cache(0).untyped_storage().nbytes())
    return out


def _tp_engine(model_dir: str, tp=None, sp_group=None):
    model = TreeModel.from_pretrained(model_dir, tp=tp)
    if sp_group is not None:
        return ShardedTreeEngine(model, group=sp_group, page_size=PAGE, kv_tokens=1024, block=BLOCK)
    return TreeEngine(model, page_size=PAGE, kv_tokens=1024, window=4)


def _worker(rank: int, world: int, port: int, out_dir: str, model_dir: str) -> None:
    """2 ranks: the sequence-sharded tiny model, then the tensor-parallel Llama; 4 ranks: the
    Llama on a TP 2 x SP 2 grid."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        out = {}
        if world == 2:
            out["sp"] = _drive(ShardedTreeEngine(_model(), page_size=PAGE, kv_tokens=1024, block=BLOCK))
            eng = _tp_engine(model_dir, make_grid(2, 1).tp)
        else:
            grid = make_grid(2, world // 2)
            eng = _tp_engine(model_dir, grid.tp, grid.sp_group)
        out["tp"] = _drive(eng)
        out["shares"] = _shares(eng)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp_path, model_dir: str) -> list[dict]:
    return spawn_ranks(_worker, world, (world, free_port(), str(tmp_path), model_dir), tmp_path, timeout=90.0)


@pytest.fixture(scope="module")
def tp_llama(tmp_path_factory) -> str:
    """The directory of the TP runs' Llama (transformers, fp32)."""
    d = tmp_path_factory.mktemp("tp_llama")
    save_tiny_llama(d, seed=3, **TP_LLAMA)
    return str(d)


@pytest.fixture(scope="module")
def tp_reference(tp_llama):
    """``(model directory, single-process results, weight / KV bytes)`` of the TP runs' Llama."""
    d = tp_llama
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eng = _tp_engine(str(d))
        return str(d), _drive(eng), _shares(eng)
    finally:
        torch.set_num_threads(before)


def _check_tp(res: list, ref: dict, shares: dict, tp: int) -> None:
    """Every rank's tokens and leaf logits equal the single process's; TP rank ``r % tp`` holds
    ``1 / tp`` of the split weights and of the KV heads, the replicated ones whole."""
    for r, out in enumerate(res):
        for name in ("sample", "beam"):
            assert out["tp"][name] == ref[name], (name, r)
            assert out["tp"][f"{name}/freed"]
        err = (out["tp"]["sample/logits"] - ref["sample/logits"]).abs().max().item()
        assert err <= 1e-4, (r, err)
        got = out["shares"]
        for k in SPLIT + ("kv",):
            assert got[k] * tp == shares[k], (r, k, got[k], shares[k])
        for k in ("attn_norm", "mlp_norm", "norm"):
            assert got[k] == shares[k], (r, k)
        for k in ("o_bias", "down_bias"):
            assert got[k] == (shares[k] if r % tp == 0 else 0), (r, k)
            assert shares[k] > 0


@pytest.mark.slow
def test_two_ranks_match_single_process(tmp_path, tp_reference):
    """2 ranks: the KV sequence-sharded (tiny model), then tensor parallelism (the Llama)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = _drive(TreeEngine(_model(), page_size=PAGE, kv_tokens=1024, window=4))
    finally:
        torch.set_num_threads(before)
    world = 2
    model_dir, tp_ref, shares = tp_reference
    res = _spawn(world, tmp_path, model_dir)
    for name in ("sample", "beam"):
        assert len(ref[name]) > 1
        for r in range(world):
            assert res[r]["sp"][name] == ref[name], (name, r)
            assert res[r]["sp"][f"{name}/freed"]
    # a real tree: the sampling workload branched into more leaves than prompts * n
    assert len(ref["sample"]) > 4
    # every rank stored only its share of the tree's KV tokens, the shares add up to the tree
    for step, (_, total, _) in ref["sample/counts"].items():
        locs = [res[r]["sp"]["sample/counts"][step][0] for r in range(world)]
        assert all(res[r]["sp"]["sample/counts"][step][1] == total for r in range(world))
        assert sum(locs) == total
        assert max(locs) <= total // 2 + 3 * BLOCK * 8, (step, locs, total)
    last = max(ref["sample/counts"])
    locs = [res[r]["sp"]["sample/counts"][last][0] for r in range(world)]
    assert min(locs) > 0 and sum(locs) == ref["sample/counts"][last][1]
    _check_tp(res, tp_ref, shares, 2)


@pytest.mark.slow
def test_tp_sp_grid_matches_single_process(tmp_path, tp_reference):
    """4 ranks, TP 2 x SP 2: rank r is TP rank r % 2 of SP rank r // 2."""
    model_dir, ref, shares = tp_reference
    res = _spawn(4, tmp_path, model_dir)
    _check_tp(res, ref, shares, 2)
    assert len(ref["sample"]) > 4
    for step, (total, _, _) in ref["sample/counts"].items():
        loc = [res[r]["tp"]["sample/counts"][step][0] for r in range(4)]
        # the two TP ranks of an SP rank own the same tokens; the SP ranks' add up to the tree
        assert loc[0] == loc[1] and loc[2] == loc[3] and loc[0] + loc[2] == total, (step, loc)
    last = max(ref["sample/counts"])
    assert min(res[r]["tp"]["sample/counts"][last][0] for r in range(4)) > 0


def test_ownership_is_block_cyclic():
    from treeattn import KVPool
    pool = KVPool(8, 2, 1, 4, num_layers=1, dtype=torch.float32)
    kv = ShardedKVCacheManager(pool, 1, 2, 3)
    np.testing.assert_array_equal(kv.owner(np.arange(12)), [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1])
    kv.new_root(0)
    slots = kv.append(0, 5)                  # positions 0..4: rank 1 owns 3, 4
    assert kv.num_tokens(0) == 2 and kv.total_tokens(0) == 5
    assert (slots[:3] == kv.pad_slot).all() and not np.isin(slots[3:], kv.pad_slot).any()
    kv.fork(0, 1)
    kv.append(1, 2)                          # positions 5, 6: rank 1 owns 5
    assert kv.num_tokens(1) == 1
    with pytest.raises(NotImplementedError):
        kv.reserve(1, 2)


def test_grid_needs_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    grid = init_grid(1, 1, "cpu")
    assert (grid.rank, grid.world, grid.tp, grid.sp_group) == (0, 1, None, None)
    with pytest.raises(ValueError, match="--tp 2 --sp 1 needs 2 processes started by torchrun"):
        init_grid(2, 1, "cpu")


def test_tp_refuses_models_that_do_not_split():
    """Sizes that do not divide by the TP ranks are named before any weight is drawn or read."""
    tiny = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match=r"over 2 ranks needs num_key_value_heads \(1\) divisible by 2"):
        TreeModel.random(tiny, tp=TensorParallel(0, 2))
    odd = dataclasses.replace(tiny, num_heads=6, num_kv_heads=3, intermediate_size=130, vocab_size=255)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\), num_key_value_heads \(3\), "
                                         r"intermediate_size \(130\), vocab_size \(255\) divisible by 4"):
        TensorParallel(1, 4).check(odd)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        TensorParallel(2, 2)
    # a rank's share is not a whole model
    half = random_weights(ModelConfig.preset("small"), tp=TensorParallel(0, 2))
    with pytest.raises(ValueError, match="q/k/v projection has 384 rows, but 8 query and 2 KV heads"):
        TreeModel(ModelConfig.preset("small"), half)


def _check_slices(full, shares, config) -> None:
    """``shares`` (the Weights of TP ranks 0, 1) are the two halves of ``full``'s."""
    q, kv, i = config.q_size, config.kv_size, config.intermediate_size
    for layer in range(config.num_layers):
        f, s = full.layers[layer], [w.layers[layer] for w in shares]
        for name, sizes in (("qkv", (q, kv, kv)), ("gate_up", (i, i))):
            parts = [getattr(x, name).split([n // 2 for n in sizes]) for x in s]
            whole = torch.cat([torch.cat([p[j] for p in parts]) for j in range(len(sizes))])
            assert torch.equal(whole, getattr(f, name)), name
        for name in ("o", "down"):
            assert torch.equal(torch.cat([getattr(x, name) for x in s], dim=1), getattr(f, name)), name
            assert getattr(s[0], name).is_contiguous()
        assert s[1].o_bias is None and s[1].down_bias is None
        if f.o_bias is not None:
            assert torch.equal(s[0].o_bias, f.o_bias) and torch.equal(s[0].down_bias, f.down_bias)
        assert torch.equal(s[1].attn_norm, f.attn_norm)
    assert torch.equal(torch.cat([w.embed for w in shares]), full.embed)
    assert torch.equal(torch.cat([w.lm_head for w in shares]), full.lm_head)


def test_tp_shares_are_slices_of_the_weights(tp_llama):
    """Each TP rank's weights, read with ``get_slice`` or drawn at random, are its slices of the
    unsplit model's: q/k/v and gate/up by rows of each part, o and down by columns, the vocabulary
    by rows (a tied head is the embedding's slice), the row-parallel biases on rank 0."""
    config = load_config(tp_llama)
    shares = [load_weights(tp_llama, config, tp=TensorParallel(r, 2)) for r in range(2)]
    _check_slices(load_weights(tp_llama, config), shares, config)
    tied = dataclasses.replace(ModelConfig.preset("small"), tie_word_embeddings=True)
    shares = [random_weights(tied, seed=2, tp=TensorParallel(r, 2)) for r in range(2)]
    _check_slices(random_weights(tied, seed=2), shares, tied)
    assert all(w.lm_head is w.embed for w in shares)


@pytest.mark.slow
def test_cli_tp_sp_under_torchrun(tmp_path):
    """``treeattn run --tp 2 --sp 2`` under torchrun (gloo, 4 ranks): rank 0 alone writes the JSON,
    whose leaves equal a single-process run's (the random weights are the same seed's, split)."""
    import json
    import subprocess
    import sys

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    args = ["run", "--random-weights", "small", "--device", "cpu", "--workload", "sample", "--greedy",
            "--prompt-ids", "1,2,3,4,5,6,7;9,8", "--branch-every", "3", "--max-new-tokens", "6", "--quiet",
            "--page-size", "4"]
    one = subprocess.run([sys.executable, "-m", "treeattn.cli", *args, "--json", str(tmp_path / "w1.json")],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert one.returncode == 0, one.stderr
    four = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                           "--master-port", str(free_port()), "-m", "treeattn.cli", *args, "--tp", "2", "--sp", "2",
                           "--json", str(tmp_path / "w4.json")], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert four.returncode == 0, four.stderr[-2000:]
    assert four.stdout.count("wrote") == 1
    a, b = (json.loads((tmp_path / f"w{n}.json").read_text()) for n in (1, 4))
    assert (b["world_size"], b["tp"], b["sp"]) == (4, 2, 2)
    assert [leaf["tokens"] for leaf in b["leaves"]] == [leaf["tokens"] for leaf in a["leaves"]]


def test_cli_refuses_bad_grids(monkeypatch, capsys):
    """Outside torchrun, and with a model that does not split, ``run`` fails before any work."""
    from treeattn.cli.main import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ["run", "--random-weights", "small", "--device", "cpu", "--workload", "sample", "--quiet"]
    assert main([*args, "--sp", "2"]) == 2
    assert "--tp 1 --sp 2 needs 2 processes started by torchrun" in capsys.readouterr().err
    assert main([*args[:2], "tiny", *args[3:], "--tp", "2"]) == 2
    assert "num_key_value_heads (1) divisible by 2" in capsys.readouterr().err
