"""Probe: launch configs of tall query tiles now that KV addresses can be affine.

Tall tiles (64-128 query rows over long KV) are where the suite's wide GQA trees spend their time
(e.g. `1,4,16,512_1024,256,128,32` 32/8: 69 of 104 us in one 128x64 launch), and they run at a
fifth of the tensor cores' rate. Session 5 found no rule for 8-warp configs with gathered slots
(benchmarks/sweep_tiles.py); affine addresses (``Launch.contig``) change the pipeline, so this
times every unmasked launch of ``auto``'s and ``node``'s plans with ``block_m >= 64`` alone
(CUDA-graph replay, L2 flushed) at several ``(block_n, num_warps, num_stages)``, gathered and,
where every unit is a run of slots, affine, and checks each variant's partial outputs against
the planned launch's.

Usage (H200)::

    python benchmarks/probe_tall.py --out benchmarks/results/h200_probe_tall.json
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

CONFIGS = ((64, 4, 3), (64, 4, 2), (64, 8, 3), (64, 8, 2), (128, 8, 2), (128, 8, 3), (128, 4, 2), (32, 4, 3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--min-len", type=float, default=128.0, help="mean KV tokens per unit")
    ap.add_argument("--strategies", default="auto,node")
    args = ap.parse_args()
    rows, seen = [], set()
    for spec in suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in HEADS:
            q, k, v, out = case_inputs(tree, hq, hkv)
            for s in args.strategies.split(","):
                w = TreeAttention(device="cuda")
                plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, strategy=s)
                if (spec, hq, hkv, plan.strategy) in seen:
                    continue
                seen.add((spec, hq, hkv, plan.strategy))
                runs = unit_runs(plan.host.kv_slots, plan.host.work_kv_start, plan.host.work_kv_end)
                o_part, lse_part = w.partial_buffers(plan)
                kv_start, kv_end = plan.host.work_kv_start, plan.host.work_kv_end
                for i, x in enumerate(plan.launches):
                    lens = kv_end[x.work_start:x.work_end] - kv_start[x.work_start:x.work_end]
                    if x.block_m < 64 or (plan.has_mask and x.masked) or lens.mean() < args.min_len:
                        continue
                    is_run = bool(runs[x.work_start:x.work_end].all())
                    row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy, "launch": i,
                           "block_m": x.block_m, "planned": [x.block_n, x.num_warps, x.num_stages, x.contig],
                           "units": int(x.work_end - x.work_start), "programs": int((x.work_end - x.work_start) * hkv),
                           "mean_len": float(lens.mean()), "max_len": int(lens.max()), "runs": is_run,
                           "us": {}, "err": {}}

                    def run(launch):
                        one = dataclasses.replace(plan, launches=(launch,))
                        fn = lambda: partial_attention(q, k, v, one, o_part, lse_part, sm_scale=0.088, out=out)  # noqa: E731
                        t = graph_us(fn)
                        fn()
                        return t, o_part.float().clone(), out.float().clone()

                    t0, ref_p, ref_o = run(x)
                    row["us"]["planned"] = t0
                    for bn, nw, ns in CONFIGS:
                        for contig in ((False, True) if is_run else (False,)):
                            key = f"{bn}/{nw}/{ns}/{'c' if contig else 'g'}"
                            try:
                                t, p, o = run(dataclasses.replace(x, block_n=bn, num_warps=nw, num_stages=ns,
                                                                  contig=contig))
                            except Exception as e:  # noqa: BLE001 (out of shared memory: record it)
                                row["err"][key] = type(e).__name__
                                continue
                            row["us"][key] = t
                            row["err"][key] = float(max((p - ref_p).abs().max(), (o - ref_o).abs().max()))
                    rows.append(row)
                    best = min(row["us"], key=row["us"].get)
                    print(f"{spec[:40]:40s} {hq}/{hkv} {plan.strategy:9s} L{i} m{x.block_m} u{row['units']} "
                          f"len{lens.mean():.0f} planned {x.block_n}/{x.num_warps}/{x.num_stages}/"
                          f"{'c' if x.contig else 'g'} {t0:7.1f} best {best} {row['us'][best]:7.1f} "
                          f"x{t0 / row['us'][best]:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    gains = [r["us"]["planned"] / min(r["us"].values()) for r in rows]
    print("launches", len(rows), "geomean best/planned", float(np.exp(np.mean(np.log(gains)))))
    for key in sorted({k for r in rows for k in r["us"]} - {"planned"}):
        g = [r["us"]["planned"] / r["us"][key] for r in rows if key in r["us"]]
        print(f"{key:14s} n={len(g):3d} geomean planned/variant {float(np.exp(np.mean(np.log(g)))):.3f} "
              f"min {min(g):.3f} max {max(g):.3f}")


if __name__ == "__main__":
    main()
