"""The merge of partial rows as one tile load instead of a row loop, timed where the engine runs it:
32 back-to-back ``run()`` calls (one a layer) in one CUDA graph, programmatic dependent launches,
no side streams.

Premise: the merge kernel walks a query's partial rows one after another, each a dependent pair
of loads (the row's index, then its LSE and output) after it waits for the attention launches.
Small trees' queries have 6-18 rows (ToT shapes, the 10-query suite trees), so the merge's
critical path is 12-36 memory round trips. Loading the row indices before the wait (they are
plan data, not the attention launches' output) and every row's state as one ``[R, H, D]`` tile
after it leaves one round trip.

For each tree and head config: ``auto``'s plan (the engine's cost model), timed per call with
the row-loop merge at its config before this probe (``loop``: the baseline), with
the library's merge at its own config (``tile_h0_w0``: the row tile for few queries, the row loop
for many; ``--variants`` for others), and without a merge
(``none``: a lower bound, its output wrong); ``sequence`` with the library's merge for
reference. The same plans are also timed one ``run()`` a graph with side streams and no PDL,
as ``treeattn bench kernels`` does (``single_us``). Outputs must match the baseline's.

Usage::

    python benchmarks/probe_merge_rows.py [--heads 32/8,64/8] [--trees ...] [--out FILE]
    TRITON_INTERPRET=1 python benchmarks/probe_merge_rows.py --check   # CPU: library vs baseline merge
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import triton

from treeattn import TreeAttention
from treeattn.ops import merge_partials, partial_attention

TREES = ("1,10_1104,300", "1,10_1611,30", "1,1,10_1611,54,30", "1,5_1611,30", "1,1,1,10_1611,54,36,20",
         "1,1,10_1104,711,150", "1,1,1,10_1104,711,195,300", "1,5_2500,300", "1,10_4000,400",
         "1,10_4096,416", "1,16,64_1024,256,32", "1,2,64_1024,256,256", "1,2,64_8,256,32",
         "1,20_4000,200", "1,50_4000,200", "1_1024", "1,1024_2048,32", "1,8,512_32,512,256")


def merge_loop(o_part, lse_part, plan, out, *, pdl: bool):
    """The merge before this probe (73a951d), the baseline: every query's rows one after another
    (the library's row loop), at its config then (heads a program for ~1024 programs and 4
    warps; 4 heads and 2 warps for many queries)."""
    n, heads = plan.merge_q_indices.numel(), out.shape[1]
    block_h = max(1, min(min(triton.next_power_of_2(heads), 32), 1 << max(0, (n * heads // 1024).bit_length() - 1)))
    block_h, warps = (4, 2) if block_h >= 16 else (block_h, 4)
    merge_partials(o_part, lse_part, plan.merge_q_indices, plan.merge_indptr, plan.merge_indices, out, None,
                   block_h=block_h, num_warps=warps, row_tile=0, pdl=pdl)


def caller(w, plan, q, k, v, out, mode: str, cfg=(None, None)):
    """One ``run()`` of ``plan`` with the merge ``mode``: ``loop`` (the baseline), ``tile`` (the
    library's, at ``cfg`` = (heads a program, warps[, row tile]; None: the config's)) or ``none``."""
    o_part, lse_part = w.partial_buffers(plan)
    scale = 1.0 / math.sqrt(q.shape[-1])
    streams = w._streams if w._streams and torch.cuda.is_current_stream_capturing() else ()

    def call():
        partial_attention(q, k, v, plan, o_part, lse_part, sm_scale=scale, out=out, pdl=w.pdl,
                          streams=streams)
        if mode == "loop":
            merge_loop(o_part, lse_part, plan, out, pdl=w.pdl)
        elif mode == "tile":
            merge_partials(o_part, lse_part, plan.merge_q_indices, plan.merge_indptr, plan.merge_indices,
                           out, None, max_rows=plan.merge_rows_max, pdl=w.pdl, block_h=cfg[0], num_warps=cfg[1],
                           row_tile=cfg[2] if len(cfg) > 2 else None)
    return call


def check() -> None:
    """CPU under the interpreter: the library's merge equals the baseline on some trees' plans."""
    from treeattn.workloads import tree_from_spec
    torch.manual_seed(0)
    for spec in ("1,10_300,30", "1,3,9_40,20,7", "1,1024_64,5"):
        tree = tree_from_spec(spec)
        for hq, hkv in ((8, 2), (4, 4)):
            for s in ("paths", "node", "flatten"):
                w = TreeAttention(device="cpu")
                plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=64, strategy=s)
                q = torch.randn(tree.num_queries, hq, 64)
                k = torch.randn(tree.num_tokens, 1, hkv, 64)
                v = torch.randn_like(k)
                outs = []
                for mode in ("loop", "tile"):
                    out = torch.empty_like(q)
                    caller(w, plan, q, k, v, out, mode)()
                    outs.append(out)
                diff = (outs[0] - outs[1]).abs().max().item()
                assert diff < 1e-5, (spec, hq, hkv, s, diff)
                print(spec, hq, hkv, s, "rows", plan.merge_rows_max, "diff", diff)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32/8,64/8")
    ap.add_argument("--trees", nargs="*", default=list(TREES))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--variants", default="tile:0:0",
                    help="mode:heads:warps[:row tile], 0 = merge_config's")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.check:
        return check()
    from treeattn.bench.kernels import case_inputs
    from treeattn.bench.timing import capture_graph, provenance
    from treeattn.workloads import tree_from_spec

    res = {**provenance(), "layers": args.layers, "rows": []}
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    variants = {"loop": ("loop", (None, None)), "none": ("none", (None, None))}
    for v_ in args.variants.split(","):
        mode, h, wp, *r = v_.split(":")
        variants[f"{mode}_h{h}_w{wp}" + "".join(f"_r{x}" for x in r)] = (
            mode, (int(h) or None, int(wp) or None, *(int(x) for x in r)))
    for spec in args.trees:
        tree = tree_from_spec(spec)
        for hq, hkv in heads:
            q, k, v, _ = case_inputs(tree, hq, hkv)
            row = {"tree": spec, "hq": hq, "hkv": hkv, "us": {}, "single_us": {}}
            w = TreeAttention(device="cuda", streams=0, pdl=True)
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=q.shape[-1], strategy="auto")
            row["auto_strategy"], row["max_rows"] = plan.strategy, plan.merge_rows_max
            row["merged"] = int(plan.merge_q_indices.numel())
            ref = None
            for name, (mode, cfg) in variants.items():
                out = torch.empty_like(q)
                call = caller(w, plan, q, k, v, out, mode, cfg)
                graph = capture_graph(lambda: [call() for _ in range(args.layers)])
                t = triton.testing.do_bench(graph.replay, return_mode="median", warmup=10, rep=60)
                torch.cuda.synchronize()
                if name == "loop":
                    ref = out.clone()
                elif mode != "none":
                    diff = (out.float() - ref.float()).abs().max().item()
                    if not math.isfinite(diff) or diff > 2e-3:
                        raise SystemExit(f"{spec} {hq}/{hkv} {name}: max diff {diff}")
                row["us"][name] = t * 1e3 / args.layers
            # the kernel benchmark's timing: one run() a graph, side streams, no PDL
            ws = TreeAttention(device="cuda", streams=3)
            plan3 = ws.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=q.shape[-1], strategy="auto")
            for name, (mode, cfg) in variants.items():
                if mode == "none":
                    continue
                out = torch.empty_like(q)
                call = caller(ws, plan3, q, k, v, out, mode, cfg)
                graph = capture_graph(call)
                row["single_us"][name] = triton.testing.do_bench(graph.replay, return_mode="median",
                                                                 warmup=10, rep=60) * 1e3
            seq = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=q.shape[-1], strategy="sequence")
            out = torch.empty_like(q)
            call = caller(w, seq, q, k, v, out, "tile")
            graph = capture_graph(lambda: [call() for _ in range(args.layers)])
            row["us"]["sequence"] = triton.testing.do_bench(graph.replay, return_mode="median", warmup=10,
                                                            rep=60) * 1e3 / args.layers
            res["rows"].append(row)
            print(f"{spec[:34]:34s} {hq}/{hkv} {row['auto_strategy']:10s} rows {row['max_rows']:3d} q {row['merged']:4d} | "
                  + " ".join(f"{k} {x:6.2f}" for k, x in row["us"].items()) + " | single "
                  + " ".join(f"{k} {x:6.2f}" for k, x in row["single_us"].items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
