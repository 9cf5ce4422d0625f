"""Probe: 256-row query tiles for the tall launches over long shared prefixes.

Premise: a tall item's rows (its queries x the GQA group) split into 128-row tiles, each a
program that reads the item's whole KV (`plan.io.kv_tile_rereads`: 68 MB of 708 on
`1,8,512_32,2048,256` at 32/8, 204 MB at 64/8), and those launches run at 330-370 TFLOP/s
(NOTES, sessions 13 and 19). Compiled for sm_90 here (Triton 3.9, ptxas), the planned 128 x 64
tile with 4 warps uses 255 registers and spills 224 bytes; a 256 x 32 tile with 8 warps uses 243
and spills nothing. A 256-row tile reads each KV tile once for twice the rows, so it halves the
tall launch's KV loads and its per-tile overhead per FLOP.

For each case whose ``auto`` plan has a launch of >= 128 rows: the same strategy planned with
256-row tiles allowed (``BLOCK_M_CHOICES`` patched for the probe), its 256-row launches at each
``(block_n, num_warps, num_stages)`` in ``CONFIGS`` (pointer loads), timed as ``treeattn bench
kernels`` times a plan (one ``run()`` a CUDA graph, side streams, L2 flushed), and its tall
launches alone (no merge) against the planned plan's. Every variant's output is checked against
the planned plan's (fp16 relative L2).

Usage::

    python benchmarks/probe_rows256.py [--heads 32/32,32/8,64/8] [--trees ...] [--out FILE]
    python benchmarks/probe_rows256.py --max-rows 64   # tiles capped at 64 rows instead
    TRITON_INTERPRET=1 python benchmarks/probe_rows256.py --check   # CPU: 256-row plans vs reference
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math

import numpy as np
import torch

import treeattn.plan.plan as plan_mod
from treeattn import TreeAttention
from treeattn.ops import partial_attention
from treeattn.plan import launches as launches_mod

CONFIGS = ((32, 8, 3), (64, 8, 3), (64, 8, 2), (32, 8, 2))
#: ``--max-rows 64``: the 64-row launches that replace 128-row ones, as built and at these configs
CONFIGS_64 = (None, (32, 4, 3), (64, 4, 2))


@contextlib.contextmanager
def rows256(max_rows: int = 256):
    """Plans made inside use query tiles of at most ``max_rows`` rows (256: one more choice)."""
    old = plan_mod.BLOCK_M_CHOICES
    plan_mod.BLOCK_M_CHOICES = (*old, 256) if max_rows == 256 else tuple(m for m in old if m <= max_rows)
    launches_mod._tile_tables.cache_clear()
    try:
        yield
    finally:
        plan_mod.BLOCK_M_CHOICES = old
        launches_mod._tile_tables.cache_clear()


def with_config(plan, cfg, block_m: int = 256):
    """``plan`` with its ``block_m``-row launches at ``cfg`` = (block_n, warps, stages), pointer
    loads (None: as built)."""
    if cfg is None:
        return plan
    bn, nw, ns = cfg
    return dataclasses.replace(plan, launches=tuple(
        dataclasses.replace(ln, block_n=bn, num_warps=nw, num_stages=ns, tma=False) if ln.block_m == block_m else ln
        for ln in plan.launches))


def tall_only(plan, min_rows: int = 128):
    return dataclasses.replace(plan, launches=tuple(ln for ln in plan.launches if ln.block_m >= min_rows))


def check() -> None:
    """CPU under the interpreter: 256-row plans match the float64 reference."""
    from treeattn.reference import reference_attention
    from treeattn.workloads import tree_from_spec
    torch.manual_seed(0)
    for spec, hq, hkv in (("1,16_40,9", 32, 2), ("1,2,40_70,9,3", 16, 2), ("1,300_50,2", 8, 8)):
        tree = tree_from_spec(spec)
        q = torch.randn(tree.num_queries, hq, 32)
        k = torch.randn(tree.num_tokens, 1, hkv, 32)
        v = torch.randn_like(k)
        ref = reference_attention(q, k, v, tree)[0]
        tall = 0
        for s in ("node", "paths", "greedy"):
            w = TreeAttention(device="cpu", backend="triton")
            with rows256():
                plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=32, strategy=s,
                              dtype=torch.float32)
            if not any(ln.block_m == 256 for ln in plan.launches):
                continue
            tall += 1
            for cfg in CONFIGS:
                out = w.run(q, k, v, with_config(plan, cfg))
                err = float((out.double() - ref).norm() / ref.norm())
                assert err < 1e-4, (spec, s, cfg, err)
                print(spec, hq, hkv, s, cfg, "rel L2", f"{err:.2e}")
        assert tall, spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--trees", nargs="*", default=None, help="suite specs (default: the whole suite)")
    ap.add_argument("--max-rows", type=int, default=256, choices=(64, 256),
                    help="256: allow 256-row tiles; 64: cap tiles at 64 rows")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.check:
        return check()
    from treeattn.bench.kernels import HEAD_DIM, case_inputs
    from treeattn.bench.timing import graph_us, provenance
    from treeattn.workloads import suite_trees, tree_from_spec

    big = args.max_rows == 256
    configs = CONFIGS if big else CONFIGS_64
    tall_rows = 128 if big else 64  # the launches timed alone: those the change touches
    res = {**provenance(), "max_rows": args.max_rows, "configs": [c and list(c) for c in configs], "rows": []}
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    for spec in args.trees or suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in heads:
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            if not any(ln.block_m >= 128 for ln in plan.launches):
                continue
            with rows256(args.max_rows):
                p256 = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, strategy=plan.strategy)
            if not any(ln.block_m == args.max_rows for ln in p256.launches):
                continue
            q, k, v, out = case_inputs(tree, hq, hkv)
            ref = torch.empty_like(out)
            w.run(q, k, v, plan, out=ref)
            row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy,
                   "tall_launches": [[ln.block_m, ln.block_n, ln.num_warps, ln.num_stages, ln.contig, ln.tma,
                                      ln.work_end - ln.work_start] for ln in plan.launches if ln.block_m >= tall_rows],
                   "rereads_MB": [plan.io.kv_tile_rereads / 1e6, p256.io.kv_tile_rereads / 1e6],
                   "us": {"planned": graph_us(lambda: w.run(q, k, v, plan, out=out))}, "tall_us": {}, "err": {}}
            o_part, lse_part = w.partial_buffers(plan)
            scale = 1.0 / math.sqrt(HEAD_DIM)
            row["tall_us"]["planned"] = graph_us(lambda: partial_attention(
                q, k, v, tall_only(plan, tall_rows), o_part, lse_part, sm_scale=scale, out=out))
            for cfg in configs:
                key = "/".join(map(str, cfg)) if cfg else "built"
                p = with_config(p256, cfg, args.max_rows)
                o = torch.empty_like(out)
                try:
                    w.run(q, k, v, p, out=o)
                except Exception as e:  # noqa: BLE001 (out of resources: record it)
                    row["err"][key] = f"{type(e).__name__}: {str(e)[:120]}"
                    continue
                torch.cuda.synchronize()
                err = float((o.float() - ref.float()).norm() / ref.float().norm())
                row["err"][key] = err
                if not math.isfinite(err) or err > 1e-2:
                    raise SystemExit(f"{spec} {hq}/{hkv} {key}: relative L2 {err}")
                row["us"][key] = graph_us(lambda: w.run(q, k, v, p, out=o))
                o_p, l_p = w.partial_buffers(p)
                row["tall_us"][key] = graph_us(lambda: partial_attention(
                    q, k, v, tall_only(p, tall_rows), o_p, l_p, sm_scale=scale, out=o))
            res["rows"].append(row)
            best = min(row["us"], key=row["us"].get)
            print(f"{spec[:40]:40s} {hq}/{hkv} {plan.strategy:9s} planned {row['us']['planned']:7.1f} "
                  f"(tall {row['tall_us']['planned']:6.1f}) | "
                  + " ".join(f"{k_} {row['us'][k_]:7.1f} ({row['tall_us'][k_]:6.1f})" for k_ in row["us"] if k_ != "planned")
                  + f" | best {best}", flush=True)
    for key in ["/".join(map(str, c)) if c else "built" for c in configs]:
        g = [r["us"]["planned"] / r["us"][key] for r in res["rows"] if key in r["us"]]
        t = [r["tall_us"]["planned"] / r["tall_us"][key] for r in res["rows"] if key in r["tall_us"]]
        if g:
            print(f"{key}: n={len(g)} plan speedup geomean {math.exp(np.mean(np.log(g))):.3f} "
                  f"[{min(g):.3f}, {max(g):.3f}]; tall launches {math.exp(np.mean(np.log(t))):.3f} "
                  f"[{min(t):.3f}, {max(t):.3f}]", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
