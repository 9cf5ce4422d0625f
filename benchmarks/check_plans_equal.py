"""Check that planning is unchanged between two versions of treeattn: dump every strategy's plan,
``auto``'s choice, each planner's cost estimate and each plan's lazy update over two steps (one
token appended to every query's node each) for the kernel suite at three head configs and for
random trees, then compare two dumps.

Usage::

    PYTHONPATH=<old>/src python benchmarks/check_plans_equal.py dump old.pkl
    PYTHONPATH=src python benchmarks/check_plans_equal.py dump new.pkl
    python benchmarks/check_plans_equal.py compare old.pkl new.pkl

(The random trees come from ``tests/helpers.py``, found next to this file.)
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import pickle
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_planning import grow_leaves  # noqa: E402
from helpers import random_tree  # noqa: E402

from treeattn.plan import PLANNERS, STRATEGIES, CostModel, HeadConfig, make_plan  # noqa: E402
from treeattn.plan.select.estimate import estimate_items  # noqa: E402
from treeattn.plan.lower.update import update_plan  # noqa: E402
from treeattn.tree import suite_trees, tree_from_spec  # noqa: E402

HEADS = [(32, 32, 128), (32, 8, 128), (64, 8, 128)]
RANDOM_HEADS = [(8, 2, 64), (32, 8, 128), (32, 32, 128)]
NUM_RANDOM = 150


def _plan_dict(plan) -> dict:
    out = {}
    for f in dataclasses.fields(plan):
        v = getattr(plan, f.name)
        if isinstance(v, torch.Tensor):
            v = v.cpu().numpy().copy()
        elif f.name == "host":  # (internal bookkeeping of the lazy update: its result is compared)
            continue
        elif f.name == "io":
            v = v.as_dict()
        out[f.name] = v
    return out


def _cases():
    for spec in suite_trees("all"):
        for h in HEADS:
            yield f"suite {spec} {h}", (lambda s=spec: tree_from_spec(s)), h
    for seed in range(NUM_RANDOM):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, 400))
        inner = bool(seed % 3 == 2)
        max_len = int(rng.choice([1, 4, 16, 64, 300]))
        roots = int(rng.integers(1, 5))
        h = RANDOM_HEADS[seed % len(RANDOM_HEADS)]
        yield (f"random {seed}", (lambda r=rng, n=n, m=max_len, ro=roots, i=inner:
                                  random_tree(r, n, m, roots=ro, inner_queries=i)), h)


def dump(path: str) -> None:
    cost = CostModel()
    out = {}
    for name, make_tree, h in _cases():
        tree = make_tree()
        heads = HeadConfig(*h, torch.float16)
        case = {"estimates": {}, "plans": {}, "updates": {}}
        grown = grow_leaves(tree)
        grown2 = grow_leaves(grown)
        for strategy in STRATEGIES:
            plan = make_plan(tree, heads, strategy=strategy, cost=cost)
            case["plans"][strategy] = _plan_dict(plan)
            upd = update_plan(plan, grown)
            # two steps: the second patches a patched plan
            upd2 = None if upd is None else update_plan(upd, grown2)
            case["updates"][strategy] = None if upd is None else [_plan_dict(upd), _plan_dict(upd2)]
            if strategy != "auto":
                items, _ = PLANNERS[strategy](tree, heads, cost)
                case["estimates"][strategy] = estimate_items(tree, items, heads, cost)
        out[name] = case
    with open(path, "wb") as f:
        pickle.dump(out, f)
    print(f"{len(out)} cases dumped to {path}")


def _diff(a, b, rel: float) -> str | None:
    """Why ``a`` and ``b`` differ (floats to ``rel``), or None. Keys only ``b`` has (fields added
    since ``a`` was dumped) are not compared."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() - b.keys():
            return f"keys {sorted(a.keys() - b.keys())} missing"
        for k in a:
            d = _diff(a[k], b[k], rel)
            if d:
                return f"{k}: {d}"
        return None
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        same = a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        return None if same else f"arrays differ ({a.dtype}{a.shape} vs {b.dtype}{b.shape})"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _diff(x, y, rel)
            if d:
                return f"[{i}] {d}"
        return None
    if isinstance(a, float) and isinstance(b, float):
        return None if math.isclose(a, b, rel_tol=rel, abs_tol=0.0) else f"{a!r} != {b!r}"
    return None if type(a) is type(b) and a == b else f"{a!r} != {b!r}"


def compare(old_path: str, new_path: str, rel: float) -> int:
    with open(old_path, "rb") as f:
        old = pickle.load(f)
    with open(new_path, "rb") as f:
        new = pickle.load(f)
    bad = 0
    if old.keys() != new.keys():
        print("case lists differ")
        return 1
    for name in old:
        for part in ("plans", "updates", "estimates"):
            for strategy in old[name][part]:
                d = _diff(old[name][part][strategy], new[name][part].get(strategy), rel)
                if d:
                    bad += 1
                    print(f"{name} {part} {strategy}: {d}")
    print("(host-side update bookkeeping is not compared; the plans and their updates are)")
    chosen = sum(old[n]["plans"]["auto"]["strategy"] == new[n]["plans"]["auto"]["strategy"] for n in old)
    print(f"{len(old)} cases, auto's choice identical on {chosen}; {bad} differences")
    return int(bad > 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("path")
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--rel", type=float, default=1e-9, help="relative tolerance of float fields")
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        dump(args.path)
        return 0
    return compare(args.old, args.new, args.rel)


if __name__ == "__main__":
    sys.exit(main())
