"""Probe: split granularity on the engine's small latency-bound trees.

Tree-of-Thoughts sorting runs ``1,10_1104,L`` trees (a 1104-token prompt, 10 growing branches) at
Llama-3-8B heads (32/8), with a plan's launches one after another (the engine has no side
streams). Planners split long items until the grid has ``CostModel.target_programs`` programs, but
no item below ``min_split_tokens`` (256): on these trees that leaves < 1 wave of programs that each
walk 4-8 KV tiles, at ~1.5 us a tile for a lone program (benchmarks/NOTES.md, session 5 floor).
This times, under CUDA-graph replay (``do_bench``, L2 flushed), every strategy with the default
split and with finer ones, serial (streams=0) and on side streams (3), next to the cost model's
estimate.

Usage (H200)::

    python benchmarks/probe_split.py --out benchmarks/results/h200_probe_split.json
"""
from __future__ import annotations

import argparse
import json


from treeattn import TreeAttention
from treeattn.bench.kernels import case_inputs
from treeattn.bench.timing import graph_us, provenance
from treeattn.plan import PLANNERS, CostModel, HeadConfig
from treeattn.plan.auto import estimate_items
from treeattn.workloads import tree_from_spec

TREES = ("1,10_1104,64", "1,10_1104,256", "1,10_1104,640", "1,10_1104,1024", "1,20_4000,200",
         "1,4,256_8,256,32", "1,256_256,32", "1,2,64_8,256,32")
STRATEGIES = ("sequence", "node_chunk", "node", "greedy", "pack", "flatten")
SPLITS = ((256, 1056), (128, 1056), (64, 1056), (128, 2112), (64, 4224), (32, 4224))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--heads", default="32/8")
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("/"))
    heads = HeadConfig(hq, hkv, 128)
    rows = []
    for spec in TREES:
        tree = tree_from_spec(spec)
        q, k, v, out = case_inputs(tree, hq, hkv)
        row = {"tree": spec, "hq": hq, "hkv": hkv, "us": {}, "est_us": {}, "programs": {}, "launches": {}}
        for streams in (0, 3):
            w = TreeAttention(device="cuda", streams=streams)
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128)
            row["auto_choice"] = plan.strategy
            row["us"][f"auto/s{streams}"] = graph_us(lambda p=plan, w=w: w.run(q, k, v, p, out=out))
        for min_split, target in SPLITS:
            cm = CostModel(min_split_tokens=min_split, target_programs=target)
            for s in STRATEGIES:
                items, _ = PLANNERS[s](tree, heads, cm)
                name = f"{s}/{min_split}/{target}"
                row["est_us"][name] = estimate_items(tree, items, heads, CostModel())["total"] * 1e6
                for streams in (0, 3):
                    w = TreeAttention(device="cuda", cost=cm, streams=streams)
                    p = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, strategy=s)
                    row["programs"][name] = p.num_work * hkv
                    row["launches"][name] = len(p.launches)
                    row["us"][f"{name}/s{streams}"] = graph_us(lambda p=p, w=w: w.run(q, k, v, p, out=out))
        rows.append(row)
        u = row["us"]
        for streams in (0, 3):
            keys = [x for x in u if x.endswith(f"/s{streams}") and not x.startswith("auto")]
            best = min(keys, key=u.get)
            dflt = min((x for x in keys if "/256/1056/" in x), key=u.get)
            print(f"{spec:22s} s{streams} auto({row['auto_choice']}) {u[f'auto/s{streams}']:6.1f} "
                  f"best default {dflt} {u[dflt]:6.1f} best {best} {u[best]:6.1f} "
                  f"(est {row['est_us'][best.rsplit('/', 1)[0]]:.1f}, {row['programs'][best.rsplit('/', 1)[0]]} "
                  f"programs)", flush=True)
        for s in STRATEGIES:
            print("    " + s.ljust(10) + " ".join(
                f"{m}/{t}: {u[f'{s}/{m}/{t}/s0']:5.1f}|{u[f'{s}/{m}/{t}/s3']:5.1f}" for m, t in SPLITS), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
