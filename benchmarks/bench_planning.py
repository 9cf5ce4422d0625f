"""Host planning cost: ``TreeAttention.plan()`` per strategy and the lazy ``update()`` after one
decode step (one token appended to every leaf), on the largest kernel-suite trees, pinned to one
CPU core.

Usage::

    python benchmarks/bench_planning.py [--trees SPEC ...] [--strategies auto,...] [--repeats 50] [--core 0]
                                        [--out planning.json]

Each time is the median (and, for CPU time, also the minimum) of ``--repeats`` runs after warm-up. ``plan`` times start from a freshly built
:class:`~treeattn.tree.decoding_tree.DecodingTree` each run (only what its constructor caches is reused);
``update`` times patch the plan of the original tree for a freshly built grown tree (which the
update checks against the plan's tree); ``append`` times patch it for the tree that
:meth:`~treeattn.tree.decoding_tree.DecodingTree.append` made from it (no check needed), as a serving loop does
after each step. Building the trees is not timed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np
import torch

from treeattn import TreeAttention
from treeattn.plan import STRATEGIES
from treeattn.tree import DecodingTree
from treeattn.tree import tree_from_spec

#: the largest suite trees: most leaves/levels (greedy's edge loop), most tokens, most queries
DEFAULT_TREES = (
    "1,2,4,8,16,32,64,128,1024_16,16,16,16,16,16,16,16,16",
    "1,2,4,8,16,32,64,128,1024_256,128,64,16,16,16,16,16,16",
    "1,4,16,64,256,1024_256,32,256,64,32,256",
    "1,4,16,64,256,1024_256,8,256,64,32,256",
    "256_4096",
)
HEADS = {"num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": torch.float16}


def copy_tree(tree: DecodingTree) -> DecodingTree:
    """The same tree as a new object (so no cached topology or visibility is reused)."""
    return DecodingTree(tree.parents, tree.lengths, tree.kv_indptr, tree.kv_indices,
                        tree.query_nodes, tree.query_prefix, tree.page_size, tree.num_slots)


def grow_leaves(tree: DecodingTree) -> DecodingTree:
    """``tree`` after one decode step, built afresh: every query's node gains one token in a fresh
    slot (an update must check it against the plan's tree)."""
    counts, slots = leaf_step(tree)
    appended = tree.append(counts, slots)
    return DecodingTree.from_parents(tree.parents, appended.lengths, query_nodes=tree.query_nodes,
                                     kv_indices=appended.kv_indices, page_size=tree.page_size)


def leaf_step(tree: DecodingTree) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, slots)`` for :meth:`DecodingTree.append`: one token in a fresh slot for every
    query's node."""
    counts = np.zeros(tree.num_nodes, dtype=np.int64)
    counts[tree.query_nodes] = 1
    return counts, int(tree.kv_indices.max()) + 1 + np.arange(int(counts.sum()))


def median_ms(fn, repeats: int, setup=lambda: None, warmup: int = 3) -> tuple[float, float, float]:
    """Milliseconds of ``fn(setup())`` (``setup`` not timed): the median wall clock, and the
    median and minimum of this thread's CPU time (robust to other processes sharing the core; on
    a shared virtual machine the medians still move by up to 2x between runs, the minima by a
    few percent)."""
    for _ in range(warmup):
        fn(setup())
    wall, cpu = [], []
    for _ in range(repeats):
        arg = setup()
        t0, c0 = time.perf_counter(), time.thread_time()
        fn(arg)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3, min(cpu) * 1e3


def bench_tree(spec: str, repeats: int, strategies=STRATEGIES) -> dict:
    tree = tree_from_spec(spec)
    grown = grow_leaves(tree)
    step = leaf_step(tree)
    wrapper = TreeAttention(device="cpu")
    row = {"tree": spec, "nodes": tree.num_nodes, "tokens": tree.num_tokens, "queries": tree.num_queries,
           "chosen": None, **{f"{what}_{k}ms": {} for what in ("plan", "update", "append") for k in ("", "cpu_", "cpu_min_")}}
    for strategy in strategies:
        row["plan_ms"][strategy], row["plan_cpu_ms"][strategy], row["plan_cpu_min_ms"][strategy] = median_ms(
            lambda t, s=strategy: wrapper.plan(t, strategy=s, **HEADS), repeats, lambda: copy_tree(tree))
        plan = wrapper.plan(tree, strategy=strategy, **HEADS)
        if strategy == "auto":
            row["chosen"] = plan.strategy
        assert wrapper.update(plan, grown).num_work == plan.num_work  # patched, not re-planned
        row["update_ms"][strategy], row["update_cpu_ms"][strategy], row["update_cpu_min_ms"][strategy] = median_ms(
            lambda t, p=plan: wrapper.update(p, t), repeats, lambda: copy_tree(grown))
        row["append_ms"][strategy], row["append_cpu_ms"][strategy], row["append_cpu_min_ms"][strategy] = median_ms(
            lambda t, p=plan: wrapper.update(p, t), repeats, lambda: tree.append(*step))
    return row


def host_provenance() -> dict:
    """The host's CPU model, library versions and the planning code's commit (``TREEATTN_COMMIT``
    overrides ``git``: the code may come from another checkout on ``PYTHONPATH``)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    commit = os.environ.get("TREEATTN_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {"cpu": cpu, "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
            "commit": commit}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", default=list(DEFAULT_TREES), help="kernel-suite specs")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--core", type=int, default=0, help="the CPU core to run on")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated (default: all)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    cols = args.strategies.split(",")
    rows = [bench_tree(spec, args.repeats, cols) for spec in args.trees]
    print("ms per call: median wall clock (median / minimum CPU time of this thread in parentheses)")
    print(f"{'tree':44s} {'what':6s} " + " ".join(f"{c:>23s}" for c in cols))
    for r in rows:
        name = f"{r['tree'][:24]} ({r['tokens'] // 1000}K tok, {r['queries']} q)"
        for what in ("plan", "update", "append"):
            wall, cpu, low = r[what + "_ms"], r[what + "_cpu_ms"], r[what + "_cpu_min_ms"]
            print(f"{name:44s} {what:6s} " + " ".join(f"{wall[c]:7.3f} ({cpu[c]:5.3f} / {low[c]:5.3f})" for c in cols))
        print(f"{'':44s} auto chose {r['chosen']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**host_provenance(), "unit": "ms (median; *_cpu_min_ms: minimum)", "repeats": args.repeats, "heads": {k: str(v) for k, v in HEADS.items()},
                       "trees": rows}, f, indent=1)


if __name__ == "__main__":
    main()
