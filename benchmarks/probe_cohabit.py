"""Probe: room on the SMs for leaf programs beside the tall ones.

Premise: at 64/8 the >= 100K-token GQA trees' plans cost about the sum of their launches
(`h200_probe_overlap.json`: `1,8,512_32,2048,256` planned 242.9 us, serial 253.9, its launches
alone 144.1 + 107.6 and the merge 14.5), while at 32/8 they overlap (183.6 against 209.7 serial).
At 64/8 the tall launch has 256 programs (16 units x 8 KV heads x 2 row tiles), and a 128-row
program (4 warps, 255 registers a thread, ~98 KB of shared memory) lets two fit an SM, which then
has no registers left: the leaf launch's programs wait until the tall ones end. At 32/8 the 128
tall programs take one SM each and leave room for 2-3 leaf programs. So a tall config that needs
more than half an SM's shared memory (deeper pipelines: one tall program an SM) leaves room for
leaf programs, which need only a few in flight an SM to stream at full bandwidth; the tall
launch then takes two waves but runs beside the leaves.

For each case: ``auto``'s plan as the suite runs it (side streams, one ``run()`` a CUDA graph, L2
flushed) with its tall launches (>= 64 rows) and its leaf launches (16 rows) at other
``(block_n, num_warps, num_stages)`` (``TALL`` x ``LEAF``), the other launch order for the tall
configs, and each launch alone. Outputs are checked against the planned plan's. The compiled
kernels' shared memory and registers are recorded (``kernels``), so the residency each config
allows on this GPU can be read off.

Usage::

    python benchmarks/probe_cohabit.py [--trees ...] [--heads 32/8,64/8] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import graph_us, provenance
from treeattn.kernels.attention import _tree_partial_attention_kernel
from treeattn.ops import partial_attention
from treeattn.workloads import tree_from_spec

TREES = ("1,8,512_32,512,256", "1,8,512_512,512,256", "1,8,512_32,2048,256",
         "1,4,16,64,256,1024_256,8,256,64,32,256", "1,1024_2048,32", "1,4,16,512_1024,256,128,32",
         "4,16,256,512_512,32,128,32")
#: tall-launch configs (None: as planned); deeper pipelines take more shared memory
TALL = (None, (64, 4, 4), (64, 4, 5), (32, 4, 7), (32, 4, 8))
LEAF = (None, (64, 4, 3))


def with_configs(plan, tall, leaf):
    def cfg(ln):
        c = tall if ln.block_m >= 64 else leaf
        if c is None:
            return ln
        return dataclasses.replace(ln, block_n=c[0], num_warps=c[1], num_stages=c[2], tma=False)
    return dataclasses.replace(plan, launches=tuple(cfg(ln) for ln in plan.launches))


def compiled_kernels() -> list:
    """Shared memory, registers and spills of every compiled attention kernel (this process)."""
    out = []
    for caches in _tree_partial_attention_kernel.device_caches.values():
        for k in caches[0].values():
            md = k.metadata
            out.append({"warps": md.num_warps, "stages": md.num_stages, "shared": md.shared,
                        "regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
                        "name": getattr(md, "name", "")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="*", default=list(TREES))
    ap.add_argument("--heads", default="32/8,64/8")
    ap.add_argument("--out")
    args = ap.parse_args()
    res = {**provenance(), "tall": [c and list(c) for c in TALL], "leaf": [c and list(c) for c in LEAF],
           "rows": []}
    name = lambda c: "/".join(map(str, c)) if c else "planned"  # noqa: E731
    for spec in args.trees:
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            q, k, v, out = case_inputs(tree, hq, hkv)
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            if not any(ln.block_m >= 64 for ln in plan.launches):
                continue
            ref = torch.empty_like(out)
            w.run(q, k, v, plan, out=ref)
            torch.cuda.synchronize()
            o_part, lse_part = w.partial_buffers(plan)
            row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy, "tall_first": plan.tall_first,
                   "launches": [[ln.block_m, ln.block_n, ln.num_warps, ln.num_stages, ln.contig, ln.tma,
                                 ln.work_end - ln.work_start] for ln in plan.launches],
                   "us": {}, "alone": {}, "err": {}}
            for tall in TALL:
                for leaf in LEAF:
                    p = with_configs(plan, tall, leaf)
                    orders = (False, True) if leaf is None else (False,)
                    for flip in orders:
                        key = f"{name(tall)}|{name(leaf)}" + ("|flipped" if flip else "")
                        pf = dataclasses.replace(p, tall_first=not p.tall_first) if flip else p
                        o = torch.empty_like(out)
                        w.run(q, k, v, pf, out=o)
                        torch.cuda.synchronize()
                        err = float((o.float() - ref.float()).norm() / ref.float().norm())
                        if not math.isfinite(err) or err > 1e-2:
                            raise SystemExit(f"{spec} {hq}/{hkv} {key}: relative L2 {err}")
                        row["err"][key] = err
                        row["us"][key] = graph_us(lambda: w.run(q, k, v, pf, out=o))
                # each launch alone at these configs (no merge)
                for i, ln in enumerate(with_configs(plan, tall, tall).launches):
                    if ln.block_m < 64:
                        continue
                    one = dataclasses.replace(plan, launches=(ln,))
                    row["alone"][f"L{i}:{name(tall)}"] = graph_us(lambda: partial_attention(
                        q, k, v, one, o_part, lse_part, sm_scale=0.088, out=out))
            for leaf in LEAF:
                for i, ln in enumerate(with_configs(plan, None, leaf).launches):
                    if ln.block_m >= 64:
                        continue
                    one = dataclasses.replace(plan, launches=(ln,))
                    row["alone"][f"L{i}:{name(leaf)}"] = graph_us(lambda: partial_attention(
                        q, k, v, one, o_part, lse_part, sm_scale=0.088, out=out))
            res["rows"].append(row)
            base = row["us"]["planned|planned"]
            best = min(row["us"], key=row["us"].get)
            print(f"{spec[:40]:40s} {hq}/{hkv} {plan.strategy:7s} planned {base:7.1f} | "
                  + " ".join(f"{k_} {t:6.1f}" for k_, t in row["us"].items() if k_ != "planned|planned")
                  + " | alone " + " ".join(f"{k_} {t:6.1f}" for k_, t in row["alone"].items())
                  + f" | best {best} x{base / row['us'][best]:.3f}", flush=True)
    try:
        res["kernels"] = compiled_kernels()
    except Exception as e:  # noqa: BLE001 (Triton's caches are internals: keep the timings)
        res["kernels"] = [f"{type(e).__name__}: {e}"]
    for kk in res["kernels"]:
        print(kk)
    keys = res["rows"][0]["us"].keys() if res["rows"] else ()
    for key in keys:
        g = [r["us"]["planned|planned"] / r["us"][key] for r in res["rows"] if key in r["us"]]
        print(f"{key:24s} geomean speedup {math.exp(sum(map(math.log, g)) / len(g)):.3f} "
              f"[{min(g):.3f}, {max(g):.3f}]")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
