"""Probe: direct (unsplit, merge-free) ``sequence`` plans as an ``auto`` candidate.

A merge launch takes 7-14 us under graph replay even for one query (benchmarks/floor.py), more
than the cost model's fitted merge term, which ranks merging plans among themselves. This times,
under CUDA-graph replay with side streams (``treeattn bench kernels``) and without (the engine),
every strategy's plan, the unsplit ``sequence`` plan and ``auto`` with ``CostModel.direct_saving_s``
0 and :data:`SAVING` on small suite trees, Medusa token trees over a context (speculative
verification) and ToT- and few-shot-shaped trees, checking outputs against ``sequence``'s.

    python benchmarks/probe_direct.py [--heads 32/8,64/8] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import graph_us, provenance
from treeattn.plan import PLANNERS, CostModel, HeadConfig, build_plan
from treeattn.plan.sequence import sequence_variants
from treeattn.workloads import tree_from_medusa, tree_from_spec

SAVING = 8e-6
SPECS = ["1,2,64_8,256,32", "1,4,256_8,256,32", "1,256_256,32", "1,16,64_1024,256,32", "1,10_4000,400",
         "1,10_1104,64", "1,10_1104,256", "1,10_1104,640", "1,10_1104,1024", "1,20_4000,200", "1,3_2000,10"]
MEDUSA = [(t, c) for t in (32, 64, 128, 256) for c in (1000, 3000)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/8,64/8")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    res = {**provenance(), "saving_s": SAVING, "rows": []}
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    trees = [(s, tree_from_spec(s)) for s in SPECS] + [(f"medusa{t}@{c}", tree_from_medusa(t, context_len=c))
                                                         for t, c in MEDUSA]
    t0 = time.time()
    for name, tree in trees:
        for hq, hkv in heads:
            q, k, v, out = case_inputs(tree, hq, hkv)
            hc = HeadConfig(hq, hkv, HEAD_DIM)
            row = {"tree": name, "hq": hq, "hkv": hkv}
            plans = {s: None for s in PLANNERS}
            variants = sequence_variants(tree, hc, CostModel())
            whole = variants[1][0] if len(variants) > 1 else None
            for streams in (3, 0):
                w = TreeAttention(device="cuda", streams=streams)
                for s in PLANNERS:
                    plans[s] = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, strategy=s)
                if whole is not None:
                    plans["sequence/unsplit"] = build_plan(tree, whole, hc, strategy="sequence", device="cuda")
                for saving in (0.0, SAVING):
                    wa = TreeAttention(device="cuda", streams=streams, cost=CostModel(direct_saving_s=saving))
                    p = wa.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
                    plans[f"auto/{saving * 1e6:g}"] = p
                    row[f"auto/{saving * 1e6:g}"] = p.strategy + ("/unsplit" if "no KV split" in p.reason else "")
                us, ref, err = {}, None, {}
                for key, p in plans.items():
                    us[key] = graph_us(lambda: w.run(q, k, v, p, out=out))
                    if ref is None:
                        ref, scale = out.float().clone(), float(out.float().abs().max())
                    err[key] = float((out.float() - ref).abs().max()) / scale
                row[f"us_streams{streams}"], row[f"err_streams{streams}"] = us, err
            res["rows"].append(row)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
            for streams in (3, 0):
                us = row[f"us_streams{streams}"]
                best = min((x, kk) for kk, x in us.items())
                print(f"{name[:24]:24s} {hq}/{hkv} streams={streams} auto {row['auto/0']} {us['auto/0']:.1f} -> "
                      f"{row[f'auto/{SAVING * 1e6:g}']} {us[f'auto/{SAVING * 1e6:g}']:.1f}; "
                      f"unsplit {us.get('sequence/unsplit', float('nan')):.1f} best {best[1]} {best[0]:.1f}"
                      + (" BAD" if any(not e < 1e-2 for e in row[f"err_streams{streams}"].values()) else "")
                      + f" [{time.time() - t0:.0f}s]", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
