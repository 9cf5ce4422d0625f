"""Sequence-sharded engine (:mod:`treeattn.engine.sharded`): 2 gloo ranks on CPU decode a tiny
random Llama with branching and beam search; their tokens equal the single-process engine's and
each rank's KV pool holds only its share of the tokens."""
from __future__ import annotations

import datetime
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import free_port, spawn_ranks

from treeattn.engine import (
    BeamSearchController,
    Sampler,
    SamplingController,
    TreeEngine,
    TreeModel,
    periodic_branching,
)
from treeattn.engine.sharded import (
    ShardedKVCacheManager,
    ShardedTreeEngine,
    init_distributed,
)

PAGE, BLOCK = 4, 4


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
    """Run every workload; record tokens and, for the sampling tree, local / total KV tokens."""
    out = {}
    for name, ctl in _controllers().items():
        counts = {}

        def on_step(step, stats, eng=engine, counts=counts):
            nodes = eng.kv.nodes
            local = sum(eng.kv.num_tokens(n) for n in nodes)
            total = sum(eng.kv.total_tokens(n) for n in nodes) if isinstance(
                eng.kv, ShardedKVCacheManager) else local
            counts[step] = (local, total, eng.pool.num_pages - eng.pool.num_free_pages)
        out[name] = _tokens(name, engine.run(ctl, on_step=on_step))
        out[f"{name}/counts"] = counts
        engine.reset()
        out[f"{name}/freed"] = engine.pool.num_free_pages == engine.pool.num_pages
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        eng = ShardedTreeEngine(_model(), page_size=PAGE, kv_tokens=1024, block=BLOCK)
        torch.save(_drive(eng), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp_path) -> list[dict]:
    return spawn_ranks(_worker, world, (world, free_port(), str(tmp_path)), tmp_path, timeout=90.0)


@pytest.mark.slow
def test_sharded_engine_matches_single_process(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = _drive(TreeEngine(_model(), page_size=PAGE, kv_tokens=1024, window=4))
    finally:
        torch.set_num_threads(before)
    world = 2
    res = _spawn(world, tmp_path)
    for name in ("sample", "beam"):
        assert len(ref[name]) > 1
        for r in range(world):
            assert res[r][name] == ref[name], (name, r)
            assert res[r][f"{name}/freed"]
    # a real tree: the sampling workload branched into more leaves than prompts * n
    assert len(ref["sample"]) > 4
    # every rank stored only its share of the tree's KV tokens, the shares add up to the tree
    for step, (_, total, _) in ref["sample/counts"].items():
        locs = [res[r]["sample/counts"][step][0] for r in range(world)]
        assert all(res[r]["sample/counts"][step][1] == total for r in range(world))
        assert sum(locs) == total
        assert max(locs) <= total // 2 + 3 * BLOCK * 8, (step, locs, total)
    last = max(ref["sample/counts"])
    locs = [res[r]["sample/counts"][last][0] for r in range(world)]
    assert min(locs) > 0 and sum(locs) == ref["sample/counts"][last][1]


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


def test_world_size_needs_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed(1, "cpu") == (0, 1)
    with pytest.raises(ValueError, match="torchrun"):
        init_distributed(2, "cpu")


@pytest.mark.slow
def test_cli_world_size_under_torchrun(tmp_path):
    """``treeattn run --world-size 2`` under torchrun (gloo): rank 0 alone writes the JSON, whose
    leaves equal a single-process run's."""
    import json
    import subprocess
    import sys

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    args = ["run", "--random-weights", "tiny", "--device", "cpu", "--workload", "sample", "--greedy",
            "--prompt-ids", "1,2,3,4,5,6,7;9,8", "--branch-every", "3", "--max-new-tokens", "6", "--quiet",
            "--page-size", "4"]
    one = subprocess.run([sys.executable, "-m", "treeattn.cli", *args, "--json", str(tmp_path / "w1.json")],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "-m", "treeattn.cli", *args, "--world-size", "2",
                          "--json", str(tmp_path / "w2.json")], env=env, capture_output=True, text=True,
                         timeout=90, check=False)
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("wrote") == 1
    a, b = (json.loads((tmp_path / f"w{n}.json").read_text()) for n in (1, 2))
    assert b["world_size"] == 2
    assert [leaf["tokens"] for leaf in b["leaves"]] == [leaf["tokens"] for leaf in a["leaves"]]
    bad = subprocess.run([sys.executable, "-m", "treeattn.cli", *args, "--world-size", "2"], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "torchrun" in bad.stderr
