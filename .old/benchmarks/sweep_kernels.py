"""Kernel tuning sweep on a GPU (one call): for representative suite trees, time
(1) each strategy's attention kernel and merge kernel separately (CUDA-graph replay),
(2) kernel launch configs (BLOCK_N, warps, stages) for the best strategies,
(3) KV-split targets for the splitting planners. Prints a table; --out writes JSON."""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from treeattn import TreeAttention
from treeattn.bench.timing import copy_bandwidth, graph_us, provenance, roofline_us
from treeattn.ops import merge_partials, partial_attention
from treeattn.plan import CostModel
from treeattn.workloads import tree_from_spec

CASES = ["1,10_4000,400", "1,1024_2048,32", "1,16,32,64,128,1024_256,128,64,16,16,16",
         "1,4,16,64,256,1024_256,8,256,64,32,256", "1,8,512_32,512,256", "2,8,16,256_256,256,32,32",
         "1,256_256,32", "1,2,4,8,16,32,64,128,1024_16,16,16,16,16,16,16,16,16"]
CONFIGS = [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 8, 2), (64, 4, 3), (128, 8, 3), (32, 2, 2), (128, 8, 2)]



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--parts", default="split,configs,targets")
    args = ap.parse_args()
    parts = args.parts.split(",")
    bw = copy_bandwidth()
    res = {**provenance(), "copy_bandwidth_TBps": bw / 1e12, "rows": []}
    d = 128
    t0 = time.time()
    for spec in CASES:
        tree = tree_from_spec(spec)
        for hq, hkv in ((32, 32), (32, 8), (64, 8)):
            q = torch.randn(tree.num_queries, hq, d, device="cuda", dtype=torch.float16)
            k = torch.randn(tree.num_tokens, 1, hkv, d, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            out = torch.empty_like(q)
            roof = roofline_us(tree.num_tokens, tree.num_queries, hq, hkv, d, bw)
            row = {"tree": spec, "hq": hq, "hkv": hkv, "roofline_us": roof, "split": {}, "configs": {},
                   "targets": {}}
            w = TreeAttention(device="cuda")

            def parts_of(plan):
                o_part, l_part = w.partial_buffers(plan)
                att = lambda: partial_attention(q, k, v, plan, o_part, l_part, sm_scale=d ** -0.5, out=out)
                mrg = lambda: merge_partials(o_part, l_part, plan.merge_q_indices, plan.merge_indptr,
                                             plan.merge_indices, out, None)
                return att, mrg

            if "split" in parts:
                for s in ("sequence", "node", "flatten", "pack", "greedy"):
                    plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, strategy=s)
                    att, mrg = parts_of(plan)
                    row["split"][s] = {"total": graph_us(lambda: w.run(q, k, v, plan, out=out)),
                                       "attn": graph_us(att), "merge": graph_us(mrg),
                                       "work": plan.num_work, "rows": plan.num_rows}
            if "configs" in parts:
                for s in ("greedy", "flatten"):
                    base = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, strategy=s)
                    for bn, nw, ns in CONFIGS:
                        plan = dataclasses.replace(base, launches=tuple(
                            dataclasses.replace(l, block_n=bn, num_warps=nw, num_stages=ns) for l in base.launches))
                        att, _ = parts_of(plan)
                        row["configs"][f"{s}/{bn}/{nw}/{ns}"] = graph_us(att)
            if "targets" in parts:
                for tp in (264, 1056, 4224):
                    for ms in (128, 256, 512):
                        w2 = TreeAttention(device="cuda", cost=CostModel(target_programs=tp, min_split_tokens=ms))
                        for s in ("sequence", "greedy"):
                            plan = w2.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, strategy=s)
                            row["targets"][f"{s}/{tp}/{ms}"] = graph_us(lambda: w2.run(q, k, v, plan, out=out))
            res["rows"].append(row)
            sp = " ".join(f"{s}:{x['total']:.0f}({x['attn']:.0f}+{x['merge']:.0f})" for s, x in row["split"].items())
            bc = min(row["configs"].items(), key=lambda kv: kv[1]) if row["configs"] else ("", 0)
            bt = min(row["targets"].items(), key=lambda kv: kv[1]) if row["targets"] else ("", 0)
            print(f"{spec[:40]:40s} {hq}/{hkv} roof={roof:.1f} {sp} | cfg {bc[0]}={bc[1]:.0f} "
                  f"base={row['configs'].get('greedy/64/4/2', 0):.0f} | tgt {bt[0]}={bt[1]:.0f} [{time.time()-t0:.0f}s]",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
