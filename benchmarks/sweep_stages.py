"""Pipelining depth of the paged K/V gather (one GPU call).

The attention kernel's KV loop loads a tile's slot indices, then gathers the K and V rows they
point at. Triton's software pipeliner puts the index load and the dependent gather in different
stages, and gives each load ``consumer stage - producer stage`` shared-memory buffers: with the
default ``num_stages=3`` the K/V gather gets a single buffer, so the next tile's gather is issued
only after this tile's compute and is waited on right away -- one memory round trip per tile,
which is the latency floor of small plans (benchmarks/NOTES.md, session 5). This compiles the
kernel for the GPU at several ``(block_n, num_warps, num_stages)`` and reports the number of
K/V buffers and the shared memory of each, then times every kernel-suite case's ``auto`` plan
with its long-item (``block_n`` 64) and short-item (``block_n`` 32) launches given those configs,
under CUDA-graph replay as ``treeattn bench kernels`` does, checking each output against the
unmodified plan's.

    python benchmarks/sweep_stages.py [--heads 32/32,32/8,64/8] [--suite all] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import re
import time

import torch
import triton

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import copy_bandwidth, graph_us, provenance, roofline_us
from treeattn.kernels.attention import _tree_partial_attention_kernel
from treeattn.workloads import suite_trees, tree_from_spec

#: (launch class, replacement (block_n, num_warps, num_stages)); class "long" = launches whose
#: block_n is 64 today (TILE_LONG), "short" = 32 (TILE_SHORT)
VARIANTS = [("long", (64, 4, 4)), ("long", (64, 4, 5)), ("long", (64, 8, 4)), ("long", (32, 4, 4)),
            ("long", (128, 4, 3)), ("long", (128, 8, 3)), ("short", (32, 4, 3)), ("short", (32, 4, 4)),
            ("short", (32, 4, 5))]
COMPILE = [(16, 64, 4, 3), (16, 64, 4, 4), (16, 64, 4, 5), (16, 32, 4, 4), (16, 32, 4, 5),
           (64, 64, 4, 4), (128, 64, 4, 3), (16, 32, 4, 2), (16, 32, 4, 3)]


def pipeline_buffers(block_m: int, block_n: int, num_warps: int, num_stages: int) -> dict:
    """Compile the kernel (fp16, GQA 4, head_dim 128, page size 1) for this GPU and read the K/V
    buffer count and shared memory off the result."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr32 = {"kv_indices", "work_kv_start", "work_kv_end", "work_mask_start", "work_row_indptr", "row_q_indices",
             "row_direct", "tree_mask", "query_pos", "query_prefix", "kv_layer"}
    consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=1,
                  HAS_MASK=False, MASK_SPLIT=False, HEADS_INNER=False, CONTIG=False, DIRECT=False, WRITE_LSE=False, DOT_PRECISION="tf32", UPCAST=False)
    sig, attrs = {}, {}
    for i, p in enumerate(inspect.signature(_tree_partial_attention_kernel.fn).parameters):
        if p in consts:
            sig[p] = "constexpr"
        elif p in ("Q", "K", "V", "O_part", "Out"):
            sig[p] = "*fp16"
        elif p in ("LSE_part", "LSE_out"):
            sig[p] = "*fp32"
        elif p in ptr32:
            sig[p] = "*i32"
        else:
            sig[p] = "fp32" if p == "qk_scale" else "i32"
        if sig[p].startswith("*") or (p.startswith("stride_") and p not in ("stride_ln", "stride_pln")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    cap = torch.cuda.get_device_capability()
    src = ASTSource(fn=_tree_partial_attention_kernel, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", cap[0] * 10 + cap[1], 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    allocs = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x(\d+)x128x", k.asm["ttgir"])
    return {"kv_buffers": [int(a) for a, _ in allocs], "shared_bytes": k.metadata.shared,
            "registers": getattr(k, "n_regs", None)}


def with_config(plan, cls: str, cfg: tuple):
    old = 64 if cls == "long" else 32
    bn, nw, ns = cfg
    return dataclasses.replace(plan, launches=tuple(
        dataclasses.replace(ln, block_n=bn, num_warps=nw, num_stages=ns) if ln.block_n == old else ln
        for ln in plan.launches))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--suite", default="all")
    ap.add_argument("--trees", nargs="+", help="these specs instead of the suite")
    ap.add_argument("--variants", help="comma-separated subset, e.g. long/64/4/5,short/32/4/3 (default: all)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compile table")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    variants = VARIANTS
    if args.variants:
        want = args.variants.split(",")
        variants = [(c, cfg) for c, cfg in variants if "/".join([c, *map(str, cfg)]) in want]
    res = {**provenance(), "compiled": {}, "rows": []}
    for cfg in [] if args.no_compile else COMPILE:
        try:
            res["compiled"]["/".join(map(str, cfg))] = pipeline_buffers(*cfg)
        except Exception as e:  # noqa: BLE001 (record what did not compile)
            res["compiled"]["/".join(map(str, cfg))] = {"error": f"{type(e).__name__}: {e}"[:200]}
        print("compile m/n/w/s", cfg, res["compiled"]["/".join(map(str, cfg))], flush=True)
    bw = copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    t0 = time.time()
    for spec in args.trees or suite_trees(args.suite):
        tree = tree_from_spec(spec)
        for hq, hkv in heads:
            w = TreeAttention(device="cuda", streams=3)
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            q, k, v, out = case_inputs(tree, hq, hkv)
            row = {"tree": spec, "hq": hq, "hkv": hkv, "auto": plan.strategy,
                   "roofline_us": roofline_us(tree.num_tokens, tree.num_queries, hq, hkv, HEAD_DIM, bw),
                   "us": {"base": graph_us(lambda: w.run(q, k, v, plan, out=out))}, "err": {}}
            ref = out.float().clone()
            scale = float(ref.abs().max())
            for cls, cfg in variants:
                if not any(ln.block_n == (64 if cls == "long" else 32) for ln in plan.launches):
                    continue
                key = "/".join([cls, *map(str, cfg)])
                p2 = with_config(plan, cls, cfg)
                try:
                    row["us"][key] = graph_us(lambda: w.run(q, k, v, p2, out=out))
                except Exception as e:  # noqa: BLE001 (out of shared memory etc.)
                    row["us"][key] = None
                    row["err"][key] = type(e).__name__
                    continue
                row["err"][key] = float((out.float() - ref).abs().max()) / scale
            res["rows"].append(row)
            if args.out:  # after every case: a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
            base = row["us"]["base"]
            best = min((x, kk) for kk, x in row["us"].items() if x is not None)
            bad = {kk: e for kk, e in row["err"].items() if not isinstance(e, float) or not e < 1e-2}
            print(f"{spec[:40]:40s} {hq}/{hkv} roof {row['roofline_us']:6.1f} base {base:7.1f} "
                  f"best {best[1]} {best[0]:7.1f} ({base / best[0]:.2f}x)" + (f" BAD {bad}" if bad else "")
                  + f" [{time.time() - t0:.0f}s]", flush=True)
            torch.cuda.empty_cache()
    # geomean speedup of each variant over base, per head config (cases without the class: 1.0)
    summary = {}
    for hq, hkv in heads:
        rows = [r for r in res["rows"] if (r["hq"], r["hkv"]) == (hq, hkv)]
        for cls, cfg in variants:
            key = "/".join([cls, *map(str, cfg)])
            ratios = [r["us"]["base"] / r["us"][key] if r["us"].get(key) else 1.0 for r in rows]
            summary[f"{hq}/{hkv} {key}"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    res["geomean_speedup"] = summary
    for kk, x in summary.items():
        print(f"{kk:28s} {x:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
