"""``auto`` with the cost model's tile-merge rate (``CostModel.merge_tile_step_s``, which the model
applies with ``pdl``) against the same model rating every merge at the row loop's
``merge_step_s``, on the cases whose choice differs.

Each case is timed as its cost model plans for: side streams, one ``run()`` a CUDA graph (the
kernel benchmark's timing) for ``streams=3``; no side streams, 32 ``run()`` calls a graph with
programmatic dependent launches (the engine's) for ``streams=0``. The two plans' outputs must agree.

Usage::

    python benchmarks/probe_merge_cost.py [--out FILE]            # the cases found by --scan
    python benchmarks/probe_merge_cost.py --scan                  # CPU: list the cases that differ
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch

from treeattn import CostModel, TreeAttention
from treeattn.workloads import suite_trees, tree_from_spec

#: engine-shaped trees besides the suite (ToT levels over 800-4000-token prompts, few-shot)
EXTRA = ("1,10_1104,300", "1,10_1611,30", "1,1,10_1611,54,30", "1,5_1611,30", "1,1,1,10_1611,54,36,20",
         "1,1,10_1104,711,150", "1,1,1,10_1104,711,195,300", "1,5_2500,300", "1,10_1104,640",
         "1,20_4000,200", "1,50_4000,200", "1_1024", "1,2,64_8,256,32", "1,30_4000,100", "1,3_800,50",
         "1,8_1500,40")
HEADS = ((32, 32), (32, 8), (64, 8))


def plans(tree, hq: int, hkv: int, streams: int, device: str):
    """``(old, new)``: ``auto``'s plans with every merge rated as the row loop, and as it is, by
    the cost model of the device's wrapper (``streams=0``: with PDL, as the engine plans; on the
    CPU, that model as the device's would be)."""
    pdl = streams == 0
    new = TreeAttention(device=device, streams=streams, pdl=pdl and device == "cuda",
                        cost=CostModel(side_streams=True, tma=True, pdl=pdl))
    old = TreeAttention(device=device, streams=streams, pdl=new.pdl,
                        cost=dataclasses.replace(new.cost, merge_tile_step_s=new.cost.merge_step_s))
    kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, dtype=torch.float16)
    return (old, old.plan(tree, **kw)), (new, new.plan(tree, **kw))


def scan() -> list:
    cases = []
    for streams in (3, 0):
        for spec in EXTRA + tuple(suite_trees("all")):
            tree = tree_from_spec(spec)
            for hq, hkv in HEADS:
                if streams == 0 and hq == hkv:
                    continue  # (the engine's models are GQA)
                (_, a), (_, b) = plans(tree, hq, hkv, streams, "cpu")
                if (a.strategy, a.num_rows, a.num_work, len(a.launches)) != (b.strategy, b.num_rows, b.num_work,
                                                                            len(b.launches)):
                    cases.append((streams, spec, hq, hkv))
                    print(streams, spec, f"{hq}/{hkv}", a.strategy, a.num_rows, "->", b.strategy, b.num_rows,
                          flush=True)
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scan", action="store_true")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args()
    cases = scan()
    if args.scan:
        return
    import triton

    from treeattn.bench.kernels import case_inputs
    from treeattn.bench.timing import capture_graph, provenance

    res = {**provenance(), "rows": []}
    for streams, spec, hq, hkv in cases:
        tree = tree_from_spec(spec)
        q, k, v, _ = case_inputs(tree, hq, hkv)
        row = {"tree": spec, "hq": hq, "hkv": hkv, "streams": streams}
        outs = []
        for name, (w, plan) in zip(("old", "new"), plans(tree, hq, hkv, streams, "cuda")):
            out = torch.empty_like(q)
            calls = args.layers if streams == 0 else 1
            graph = capture_graph(lambda: [w.run(q, k, v, plan, out=out) for _ in range(calls)])
            row[name] = triton.testing.do_bench(graph.replay, return_mode="median", warmup=10, rep=60) * 1e3 / calls
            row[name + "_strategy"], row[name + "_rows"] = plan.strategy, plan.num_rows
            torch.cuda.synchronize()
            outs.append(out.float())
        diff = (outs[0] - outs[1]).abs().max().item()
        if not math.isfinite(diff) or diff > 2e-3:
            raise SystemExit(f"{spec} {hq}/{hkv}: max diff {diff}")
        res["rows"].append(row)
        print(f"{streams} {spec[:36]:36s} {hq}/{hkv} {row['old_strategy']:10s} {row['old']:7.2f} -> "
              f"{row['new_strategy']:10s} {row['new']:7.2f}  {row['new'] / row['old']:.3f}", flush=True)
    ratios = [r["new"] / r["old"] for r in res["rows"]]
    if ratios:
        res["geomean_new_over_old"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"geomean new/old {res['geomean_new_over_old']:.3f} over {len(ratios)} cases")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
