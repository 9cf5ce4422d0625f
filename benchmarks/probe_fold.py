"""Probe: the last launch's fold (``Plan.merge_last``) against the merge launch it replaces, plan
by plan in one process, beside the last launch's features, to find a rule for when to fold (whatever
``CostModel.merge_last_min_group``, which session 33 set from this probe on an H200).

Sessions 31-32 (H100): over the 33 ``auto`` suite plans that fold, the fold saved -11.0 to +15.9
us against the merge launch, measured between processes (old and new code). ``1,1024_2048,32``
loses 6-8% at 32/8 and the same tree gains 5% at 64/8, whose last launch has as many programs and
waves; the cost model's merge term does not separate them (NOTES.md, session 32). Here each plan
that folds runs as planned and as the same plan with ``merge_launch=-1`` (its launches, then the
merge launch), alternately, each as a CUDA graph of one ``run()`` in the default launch mode (one
stream with PDL on Hopper); both outputs must agree.

Usage::

    python benchmarks/probe_fold.py --list               # the host's plans that fold, features only
    python benchmarks/probe_fold.py --out FILE.json      # GPU: time them
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from treeattn import CostModel, TreeAttention
from treeattn.bench.kernels import HEAD_DIM
from treeattn.workloads import suite_trees, tree_from_spec

HEADS = ((32, 32), (32, 8), (64, 8))


def features(plan, num_sms: int = 132) -> dict:
    """The folding launch and the merge it replaces: programs, KV tiles a program (mean, most),
    waves of programs over the SMs, the folded rows (rows of merged queries outside the launch) and
    the merge's bytes (partial rows read, outputs written)."""
    ln = plan.launches[plan.merge_launch]
    h = plan.heads
    start = plan.work_kv_start.cpu()[ln.work_start:ln.work_end].long()
    end = plan.work_kv_end.cpu()[ln.work_start:ln.work_end].long()
    tiles = (end - start + ln.block_n - 1) // ln.block_n
    programs = (ln.work_end - ln.work_start) * h.num_kv_heads
    merged = plan.merge_q_indices.numel()
    return {"block_m": ln.block_m, "block_n": ln.block_n, "num_warps": ln.num_warps, "programs": programs,
            "tiles_mean": float(tiles.float().mean()), "tiles_max": int(tiles.max()),
            "waves": programs / num_sms, "merged_queries": merged, "merge_rows_max": plan.merge_rows_max,
            "folded_rows": plan.num_rows - plan.num_direct - merged,
            "merge_bytes": plan.num_rows * h.partial_row_bytes() + merged * h.num_qo_heads * h.head_dim * h.elem_bytes,
            "launches": len(plan.launches), "strategy": plan.strategy}


def folding_plans(device: str, trees=None, heads=HEADS):
    """Yield ``(spec, hq, hkv, wrapper, plan)`` of every ``auto`` plan that folds at any GQA group
    (``merge_last_min_group=1``; on the CPU: as the default mode's model on Hopper plans them)."""
    for spec in trees or suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in heads:
            mode = TreeAttention(device=device).cost if device == "cuda" else CostModel(
                side_streams=True, tma=True, pdl=True)
            w = TreeAttention(device=device, cost=dataclasses.replace(mode, merge_last_min_group=1))
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            if plan.merge_last:
                yield spec, hq, hkv, w, plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--list", action="store_true", help="plan on this host and print the features")
    ap.add_argument("--trees", default=None, help="comma-free list separated by ';' (default: the suite)")
    ap.add_argument("--heads", default=",".join(f"{a}/{b}" for a, b in HEADS), help="query/KV heads, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of fold / merge launch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    trees = args.trees.split(";") if args.trees else None
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    if args.list:
        for spec, hq, hkv, _, plan in folding_plans("cpu", trees, heads):
            print(spec, f"{hq}/{hkv}", json.dumps(features(plan)))
        return
    import triton

    from treeattn.bench.kernels import case_inputs
    from treeattn.bench.timing import capture_graph, provenance

    res = {**provenance(), "rows": []}
    for spec, hq, hkv, w, plan in folding_plans("cuda", trees, heads):
        q, k, v, _ = case_inputs(tree_from_spec(spec), hq, hkv)
        plans = {"fold": plan, "merge": dataclasses.replace(plan, merge_launch=-1)}
        outs = {name: torch.empty_like(q) for name in plans}
        graphs = {name: capture_graph(lambda p=p, o=outs[name]: w.run(q, k, v, p, out=o)) for name, p in plans.items()}
        us = {name: [] for name in plans}
        for _ in range(args.rounds):
            for name, g in graphs.items():
                us[name].append(triton.testing.do_bench(g.replay, return_mode="median", warmup=10, rep=60) * 1e3)
        diff = (outs["fold"].float() - outs["merge"].float()).abs().max().item()
        if not diff <= 2e-3:
            raise SystemExit(f"{spec} {hq}/{hkv}: fold and merge launch differ by {diff}")
        row = {"tree": spec, "hq": hq, "hkv": hkv, "fold_us": min(us["fold"]), "merge_us": min(us["merge"]),
               "all_us": us, **features(plan, torch.cuda.get_device_properties(0).multi_processor_count)}
        res["rows"].append(row)
        print(f"{spec[:36]:36s} {hq}/{hkv} fold {row['fold_us']:7.1f} merge {row['merge_us']:7.1f} us "
              f"saved {row['merge_us'] - row['fold_us']:5.1f}  programs {row['programs']} waves {row['waves']:.1f} "
              f"tiles {row['tiles_mean']:.1f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
