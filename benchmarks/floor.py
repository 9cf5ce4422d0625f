"""Where the latency floor of small plans goes (one GPU call): CUDA-graph replay time of an empty
Triton kernel, of the attention and merge launches of small plans separately and together, and of
a few-shot-like tree, under ``triton.testing.do_bench`` (median, L2 flushed) as the kernel
benchmark times them; then the attention launch of one unsplit work item per KV head against its
length (the latency of one KV-tile iteration), for a 4-row and a 128-row query tile. Prints
tables; --out writes JSON."""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import triton
import triton.language as tl

from treeattn import DecodingTree, TreeAttention
from treeattn.bench.timing import copy_bandwidth, graph_us, provenance, roofline_us
from treeattn.ops import merge_partials, partial_attention
from treeattn.plan import CostModel
from treeattn.workloads import tree_from_spec

CASES = ["1_16", "1_1024", "1,2,64_8,256,32", "1,20_4000,200", "1,50_4000,200", "1,10_4000,400",
         "1,256_256,32", "256_1024"]


@triton.jit
def _empty_kernel(X):
    tl.store(X + tl.program_id(0), 1.0)



def floor_us(fn) -> float:
    return graph_us(fn, warmup=20, rep=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--cases", nargs="+", default=CASES, help="kernel-suite tree specs")
    ap.add_argument("--heads", default="32/8,32/32", help="query/KV head configs")
    ap.add_argument("--no-single", action="store_true", help="skip the single-item table")
    args = ap.parse_args()
    bw = copy_bandwidth()
    res = {**provenance(), "copy_bandwidth_TBps": bw / 1e12, "rows": []}
    x = torch.zeros(4096, device="cuda")
    res["empty_1"] = floor_us(lambda: _empty_kernel[(1,)](x))
    res["empty_1024"] = floor_us(lambda: _empty_kernel[(1024,)](x))
    res["empty_x2"] = floor_us(lambda: (_empty_kernel[(1,)](x), _empty_kernel[(1,)](x)))
    print(f"empty kernel: 1 program {res['empty_1']:.1f} us, 1024 programs {res['empty_1024']:.1f} us, "
          f"two launches {res['empty_x2']:.1f} us", flush=True)
    d = 128
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    for spec in args.cases:
        tree = tree_from_spec(spec)
        for hq, hkv in heads:
            q = torch.randn(tree.num_queries, hq, d, device="cuda", dtype=torch.float16)
            k = torch.randn(tree.num_tokens, 1, hkv, d, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            out = torch.empty_like(q)
            w = TreeAttention(device="cuda")
            row = {"tree": spec, "hq": hq, "hkv": hkv,
                   "roofline_us": roofline_us(tree.num_tokens, tree.num_queries, hq, hkv, d, bw)}
            for s in ("auto", "sequence"):
                plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, strategy=s)
                o_part, l_part = w.partial_buffers(plan)
                att = lambda: partial_attention(q, k, v, plan, o_part, l_part, sm_scale=d ** -0.5, out=out)
                mrg = lambda: merge_partials(o_part, l_part, plan.merge_q_indices, plan.merge_indptr,
                                             plan.merge_indices, out, None)
                row[s] = {"strategy": plan.strategy, "launches": len(plan.launches),
                          "programs": plan.num_work * hkv, "merged": int(plan.merge_q_indices.numel()),
                          "total": floor_us(lambda: w.run(q, k, v, plan, out=out)),
                          "attention": floor_us(att),
                          "merge": floor_us(mrg) if plan.merge_q_indices.numel() else 0.0}
                if len(plan.launches) > 1:  # each launch alone: which tile shape takes the time
                    row[s]["per_launch"] = []
                    for ln in plan.launches:
                        one_launch = dataclasses.replace(plan, launches=(ln,))
                        row[s]["per_launch"].append({
                            "block_m": ln.block_m, "block_n": ln.block_n, "items": ln.work_end - ln.work_start,
                            "us": floor_us(lambda: partial_attention(q, k, v, one_launch, o_part, l_part,
                                                                     sm_scale=d ** -0.5, out=out))})
            res["rows"].append(row)
            a, sq = row["auto"], row["sequence"]
            print(f"{spec:18s} {hq}/{hkv} roof {row['roofline_us']:6.1f} | auto={a['strategy']:8s} "
                  f"{a['launches']}L {a['programs']:5d}p total {a['total']:6.1f} attn {a['attention']:6.1f} "
                  f"merge {a['merge']:5.1f} | seq total {sq['total']:6.1f} attn {sq['attention']:6.1f} "
                  f"merge {sq['merge']:5.1f}" + "".join(
                      f" | m{x['block_m']}/n{x['block_n']} x{x['items']} {x['us']:.1f}" for x in a.get("per_launch", [])),
                  flush=True)
    res["single_item"] = []
    if args.no_single:
        cases = []
    else:
        cases = [(length, queries, strategy) for length in (16, 64, 256, 1024, 4096)
                 for queries, strategy in ((1, "sequence"), (32, "node"))]
    one = TreeAttention(device="cuda", cost=CostModel(target_programs=1, min_split_tokens=1 << 30))
    for length, queries, strategy in cases:
        tree = DecodingTree.from_parents([-1], [length], query_nodes=[0] * queries,
                                         query_prefix=[length] * queries)
        q = torch.randn(tree.num_queries, 32, d, device="cuda", dtype=torch.float16)
        k = torch.randn(tree.num_tokens, 1, 8, d, device="cuda", dtype=torch.float16)
        out = torch.empty_like(q)
        plan = one.plan(tree, num_qo_heads=32, num_kv_heads=8, head_dim=d, strategy=strategy)
        o_part, l_part = one.partial_buffers(plan)
        t = floor_us(lambda: partial_attention(q, k, k, plan, o_part, l_part, sm_scale=d ** -0.5, out=out))
        res["single_item"].append({"length": length, "rows": queries * 4, "attention_us": t,
                                   "launches": [list(map(int, (x.block_m, x.block_n, x.work_end - x.work_start)))
                                                for x in plan.launches]})
        print(f"one item of {length:5d} tokens x {queries * 4:3d} rows (32/8 heads): attention {t:6.1f} us "
              f"launches {res['single_item'][-1]['launches']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
