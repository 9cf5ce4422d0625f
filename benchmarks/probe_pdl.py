"""Programmatic dependent launch (PDL) against side streams and plain serial launches, under
CUDA-graph replay (``do_bench``, median, L2 flushed), on the kernel suite and engine-shaped trees.

For each case and each plan (``auto``'s, built with the side-stream cost model, and ``sequence``'s)
it times the same plan three ways: side streams (``streams=3``, the kernel benchmark's default),
serial (``streams=0``, the engine's) and serial with PDL; outputs must match the side-stream run.

Usage::

    python benchmarks/probe_pdl.py [--heads 32/8,64/8] [--suite all] [--extra SPEC ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import triton

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import capture, copy_bandwidth, provenance, roofline_us
from treeattn.workloads import suite_trees, tree_from_spec

#: engine-shaped trees: ToT sorting's (a 1104-token prompt, 10 branches), few-shot's, a Medusa-like
EXTRA = ("1,10_1104,640", "1,20_4000,200", "1,50_4000,200", "1_1024", "1,2,64_8,256,32")
MODES = {"streams": dict(streams=3), "serial": dict(streams=0), "pdl": dict(streams=0, pdl=True)}


def time_graph(w, plan, q, k, v, out) -> float:
    graph = capture(w, plan, q, k, v, out)
    return triton.testing.do_bench(graph.replay, return_mode="median", warmup=10, rep=50) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32/8,64/8")
    ap.add_argument("--suite", default="all", help="fasttree, pat, all, or '' (only --extra)")
    ap.add_argument("--extra", nargs="*", default=list(EXTRA))
    ap.add_argument("--strategies", default="auto,sequence")
    ap.add_argument("--plan-streams", type=int, default=3,
                    help="streams of the wrapper that plans (0: the engine's cost model, launches one after another)")
    ap.add_argument("--modes", default=",".join(MODES), help="of " + ", ".join(MODES) + " (streams always runs first)")
    ap.add_argument("--out")
    args = ap.parse_args()
    bw = copy_bandwidth()
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    specs = list(args.extra) + (list(suite_trees(args.suite)) if args.suite else [])
    modes = {m: MODES[m] for m in dict.fromkeys(["streams", *args.modes.split(",")])}
    res = {**provenance(), "copy_bandwidth_TBps": bw / 1e12, "rows": []}
    worst = 0.0
    for spec in specs:
        tree = tree_from_spec(spec)
        for hq, hkv in heads:
            q, k, v, _ = case_inputs(tree, hq, hkv)
            row = {"tree": spec, "hq": hq, "hkv": hkv, "roofline_us": roofline_us(
                tree.num_tokens, tree.num_queries, hq, hkv, HEAD_DIM, bw), "plans": {}}
            for s in args.strategies.split(","):
                ref = TreeAttention(device="cuda", streams=args.plan_streams)
                plan = ref.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, strategy=s)
                want = ref.run(q, k, v, plan)
                entry = {"strategy": plan.strategy, "launches": len(plan.launches),
                         "merged": int(plan.merge_q_indices.numel())}
                for mode, kw in modes.items():
                    ws = torch.empty(max(plan.workspace_bytes() // 4, 1), dtype=torch.float32, device="cuda")
                    w = TreeAttention(ws, **kw)
                    out = torch.empty_like(q)
                    entry[mode] = time_graph(w, plan, q, k, v, out)
                    torch.cuda.synchronize()
                    diff = (out.float() - want.float()).abs().max().item()
                    if not math.isfinite(diff) or diff > 2e-3:
                        raise SystemExit(f"{spec} {hq}/{hkv} {s} {mode}: max diff {diff}")
                    worst = max(worst, diff)
                row["plans"][s] = entry
                print(f"{spec[:40]:40s} {hq}/{hkv} {s:8s} {plan.strategy:10s} L{entry['launches']} "
                      + " ".join(f"{m} {entry[m]:7.1f}" for m in modes),
                      flush=True)
            res["rows"].append(row)
            torch.cuda.empty_cache()
    res["max_abs_diff"] = worst
    for s in args.strategies.split(","):
        for hq, hkv in heads:
            sel = [r["plans"][s] for r in res["rows"] if (r["hq"], r["hkv"]) == (hq, hkv)]
            gm = {m: math.exp(sum(math.log(e[m] / e["streams"]) for e in sel) / len(sel)) for m in modes}
            res.setdefault("summary", {})[f"{s} {hq}/{hkv}"] = gm
            print(f"{s} {hq}/{hkv}: geomean time over streams " + " ".join(f"{m} {g:.3f}" for m, g in gm.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
