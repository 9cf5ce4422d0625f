"""Host planning cost of the speculative-verification workloads of ``treeattn bench e2e``.

Replays ``speculative-<t>`` through :class:`~treeattn.engine.engine.TreeEngine` exactly as the e2e
benchmark does (same workload spec, page size, KV pool size, step schedule and planner), but with
a model stand-in that computes nothing, so each step's cost is the engine's host work: the tree
and KV bookkeeping (``kv_ms``) and attention planning (``plan_ms``, the e2e JSON's ``plan``).
Planning uses the benchmark model's heads (Llama-3-8B: 32 query / 8 KV heads, head_dim 128, bf16).

Usage::

    TREEATTN_SHARED=<shared> python benchmarks/bench_spec_planning.py [--sizes 32 64 128 256]
        [--strategies auto sequence] [--every-step] [--json out.json] [--profile]
        [--save-plans DIR | --check-plans DIR]

By default only the steps the e2e benchmark computes plan (``bench._schedule``: 5 windows of
warm-up, 10 timed and 2 breakdown steps); ``--every-step`` plans all of them. ``--save-plans``
stores every plan's index tensors and ``--check-plans`` compares against stored ones (planner
changes must not change plans). Device uploads are not measured: this runs on the CPU.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import sys

import numpy as np
import torch

try:
    import treeattn  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from treeattn.engine.bench import _schedule, _spec
from treeattn.engine.config import ModelConfig
from treeattn.engine.engine import TreeEngine
from treeattn.engine.workloads import build_workload

MODEL = "llama3-8b"
VOCAB = 1024  # the stand-in's logits are zeros; the vocabulary only sizes them


class NullModel:
    """The benchmark model's attention shape, one layer, and no computation (zero logits)."""

    def __init__(self, dtype=torch.bfloat16):
        self.config = dataclasses.replace(ModelConfig.preset(MODEL), num_layers=1, vocab_size=VOCAB)
        self.device, self.dtype = torch.device("cpu"), dtype

    def ensure_positions(self, n: int) -> None:
        pass

    def prefill(self, tokens, positions, slots, context_slots, caches) -> torch.Tensor:
        return torch.zeros(VOCAB)

    def decode(self, tokens, positions, slots, caches, attend) -> torch.Tensor:
        return torch.zeros(tokens.shape[0], VOCAB)


def plan_arrays(plan) -> dict:
    """Every index tensor of ``plan`` as int64 arrays, plus its strategy and launches."""
    out = {f.name: getattr(plan, f.name).numpy().astype(np.int64) for f in dataclasses.fields(plan)
           if isinstance(getattr(plan, f.name), torch.Tensor)}
    out["launches"] = np.array([dataclasses.astuple(x) for x in plan.launches], dtype=np.int64)
    out["strategy"] = np.array(plan.strategy)
    return out


def replay(model, size: int, strategy: str, *, every_step: bool, profile: cProfile.Profile | None,
           steps: int = 50, windows: int = 5, breakdown: int = 2) -> tuple[dict, list]:
    """Replay ``speculative-<size>``; returns its summary and the plans made."""
    engine = TreeEngine(model, strategy=strategy, page_size=16, kv_tokens=65536, cuda_graphs=False)
    ctl, total = build_workload(_spec(f"speculative-{size}", model.config.vocab_size, 0))
    kinds = _schedule(total, steps, windows, breakdown)
    plans = []
    plan_fn = engine.planner.plan

    def recording_plan(tree, **kw):
        if profile is not None:
            profile.enable()
        plan = plan_fn(tree, **kw)
        if profile is not None:
            profile.disable()
        plans.append(plan)
        return plan

    engine.planner.plan = recording_plan
    engine.run(ctl, max_steps=total, schedule=None if every_step else (lambda s: s in kinds))
    st = [s for s in engine.stats if s.computed and s.kind == "verify"]
    ms = np.array([s.plan_ms for s in st])
    used = {}
    for s in st:
        used[s.strategy] = used.get(s.strategy, 0) + 1
    return {"size": size, "strategy": strategy, "steps": len(st),
            "plan_ms_mean": float(ms.mean()), "plan_ms_median": float(np.median(ms)),
            "plan_ms_max": float(ms.max()), "kv_ms_mean": float(np.mean([s.kv_ms for s in st])),
            "tree_tokens_mean": float(np.mean([s.tree_tokens for s in st])),
            "strategies_used": used}, plans


def check_or_save(plans: list, path: str, save: bool) -> int:
    """Save ``plans`` to ``path`` (npz) or compare them with the saved ones; returns mismatches."""
    arrays = {f"{i}/{k}": v for i, p in enumerate(plans) for k, v in plan_arrays(p).items()}
    if save:
        np.savez_compressed(path, **arrays)
        return 0
    with np.load(path) as ref:
        if set(ref.files) != set(arrays):
            return len(set(ref.files) ^ set(arrays))
        return sum(not np.array_equal(ref[k], v) for k, v in arrays.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--strategies", nargs="+", default=["auto", "sequence"])
    ap.add_argument("--every-step", action="store_true", help="plan every step, not the e2e schedule")
    ap.add_argument("--repeats", type=int, default=1, help="replays per case (the fastest is kept)")
    ap.add_argument("--profile", action="store_true", help="cProfile of planning (top functions)")
    ap.add_argument("--json", metavar="OUT", default=None)
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--save-plans", metavar="DIR", default=None)
    group.add_argument("--check-plans", metavar="DIR", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = NullModel()
    rows, bad = [], 0
    print(f"{'workload':<16} {'strategy':<9} {'steps':>5} {'tokens':>7} {'plan ms':>8} {'median':>8} "
          f"{'max':>8} {'kv ms':>6}  strategies used")
    for size in args.sizes:
        for strategy in args.strategies:
            prof = cProfile.Profile() if args.profile else None
            best = None
            for _ in range(max(1, args.repeats)):
                row, plans = replay(model, size, strategy, every_step=args.every_step, profile=prof)
                if best is None or row["plan_ms_mean"] < best["plan_ms_mean"]:
                    best = row
            row = best
            if args.save_plans or args.check_plans:
                os.makedirs(args.save_plans or args.check_plans, exist_ok=True)
                path = os.path.join(args.save_plans or args.check_plans, f"spec{size}_{strategy}.npz")
                row["plan_mismatches"] = check_or_save(plans, path, save=bool(args.save_plans))
                bad += row["plan_mismatches"]
            rows.append(row)
            print(f"speculative-{size:<4} {strategy:<9} {row['steps']:>5} {row['tree_tokens_mean']:>7.0f} "
                  f"{row['plan_ms_mean']:>8.3f} {row['plan_ms_median']:>8.3f} {row['plan_ms_max']:>8.3f} "
                  f"{row['kv_ms_mean']:>6.3f}  {row['strategies_used']}"
                  + (f"  plan mismatches: {row['plan_mismatches']}" if "plan_mismatches" in row else ""))
            if prof is not None:
                pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "every_step": args.every_step}, f, indent=1)
    if args.check_plans:
        print("plans identical" if not bad else f"PLANS DIFFER: {bad} mismatching arrays")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
