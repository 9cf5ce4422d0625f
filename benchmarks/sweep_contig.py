"""Sweep: affine KV addressing (``Launch.contig``) and pipeline depth, launch by launch.

For every kernel-suite case, the plans of ``auto``'s choice and of ``node``: each launch whose
work units all read one run of consecutive slots is timed alone (CUDA-graph replay of that one
partial-attention launch, L2 flushed) with gathered slots (as planned) and with affine addresses,
each at ``num_stages`` 1, 2 and 3. The rows carry the launch's features (tile shape, units,
programs, tokens per unit, grid order) so a rule for setting ``contig`` (and the stages) can be
fitted from them.

Usage (H200)::

    python benchmarks/sweep_contig.py --out benchmarks/results/h200_sweep_contig.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import torch

from probe_contig import HEADS
from treeattn import TreeAttention
from treeattn.bench.kernels import case_inputs
from treeattn.bench.timing import graph_us
from treeattn.ops import partial_attention
from treeattn.plan.addressing import unit_runs
from treeattn.workloads import suite_trees, tree_from_spec

EXTRA = ("1_256", "1_1024", "1_4096", "4_1024", "16_4096", "64_2048", "32_8192")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--stages", default="1,2,3")
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    rows, seen = [], set()
    for spec in list(suite_trees("all")) + list(EXTRA):
        tree = tree_from_spec(spec)
        for hq, hkv in HEADS:
            q, k, v, out = case_inputs(tree, hq, hkv)
            for s in ("auto", "node"):
                w = TreeAttention(device="cuda")
                plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, strategy=s)
                if (spec, hq, hkv, plan.strategy) in seen:
                    continue
                seen.add((spec, hq, hkv, plan.strategy))
                ok = unit_runs(plan.host.kv_slots, plan.host.work_kv_start, plan.host.work_kv_end)
                o_part, lse_part = w.partial_buffers(plan)
                kv_start = plan.work_kv_start.cpu().numpy()
                kv_end = plan.work_kv_end.cpu().numpy()
                for i, x in enumerate(plan.launches):
                    if not ok[x.work_start:x.work_end].all():
                        continue
                    units = x.work_end - x.work_start
                    lens = kv_end[x.work_start:x.work_end] - kv_start[x.work_start:x.work_end]
                    row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy, "launch": i,
                           "block_m": x.block_m, "block_n": x.block_n, "num_warps": x.num_warps,
                           "planned_stages": x.num_stages, "units": int(units),
                           "programs": int(units * hkv), "mean_len": float(lens.mean()),
                           "max_len": int(lens.max()), "heads_inner": x.heads_inner,
                           "masked": bool(plan.has_mask and x.masked), "us": {}}
                    for contig in (False, True):
                        for st in stages:
                            one = dataclasses.replace(plan, launches=(
                                dataclasses.replace(x, contig=contig, num_stages=st),))

                            def fn(one=one):
                                partial_attention(q, k, v, one, o_part, lse_part, sm_scale=0.088, out=out)
                            row["us"][f"{'contig' if contig else 'gather'}{st}"] = graph_us(fn)
                    best = min(row["us"], key=row["us"].get)
                    base = row["us"][f"gather{x.num_stages}"]
                    rows.append(row)
                    print(f"{spec[:40]:40s} {hq}/{hkv} {plan.strategy:9s} L{i} m{x.block_m} n{x.block_n} "
                          f"u{units} len{lens.mean():.0f} planned {base:7.1f} best {best} "
                          f"{row['us'][best]:7.1f} x{base / row['us'][best]:.3f} "
                          f"contig{x.num_stages} x{base / row['us'][f'contig{x.num_stages}']:.3f}", flush=True)
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        with open(args.out, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    gains = [r["us"][f"gather{r['planned_stages']}"] / min(r["us"].values()) for r in rows]
    print("launches", len(rows), "geomean best/planned", float(np.exp(np.mean(np.log(gains)))))


if __name__ == "__main__":
    main()
