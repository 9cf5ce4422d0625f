"""Probe: wide KV tiles for launches of few programs, as whole plans.

A lone program walks a 64-token tile of contig slots in about 1 us whatever its pipeline depth,
while 128-token tiles with 3 stages take 0.59 us per 64 tokens, and with TMA loads 0.52
(`h200_probe_tile.json`). Launches of many programs lose with those tiles (their shared memory
leaves one program a SM: `h200_sweep_stages_0189740.json`), but the engine's plans (Medusa
verification, ToT, few-shot) run launches of about one program a SM over contig units of 3-8
tiles. This times ``auto``'s plan of engine-shaped trees and of the suite as planned (``base``)
and with every contig launch of at most 1 or 3 programs a SM (``@1``, ``@3``) given 128-token
tiles, 4 warps, 3 stages (``wide``), the same through TMA descriptors with the split tail
(``wide_tma``), the planned tile through TMA (``tma``), and every launch of that few programs
(any addressing) with 8 warps (``warps8``); CUDA-graph replay, L2 flushed,
outputs checked against ``base`` (relative L2). The summary's geomeans count every case of its
group, a case without the variant at its best smaller bound (or 1.0).

Usage (H200)::

    python benchmarks/probe_lone.py --out benchmarks/results/h200_probe_lone.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import case_inputs
from treeattn.bench.timing import graph_us, provenance
from treeattn.workloads import suite_trees, tree_from_medusa, tree_from_spec

HEADS = ((32, 8), (64, 8))
WAVES = (1.0, 3.0)  # programs a SM up to which a contig launch takes the variant
#: (name, 128-token tiles, TMA, warps)
VARIANTS = (("wide", True, False, None), ("wide_tma", True, True, None), ("tma", False, True, None),
            ("warps8", False, False, 8))
ENGINE = ("medusa:32:1000", "medusa:32:4000", "medusa:64:1200", "medusa:64:4000", "medusa:128:2000",
          "1,10_1104,640", "1,20_4000,200", "1,50_4000,200", "1_1024", "1_4096")


def make_tree(spec: str):
    if spec.startswith("medusa:"):
        _, t, ctx = spec.split(":")
        return tree_from_medusa(int(t), context_len=int(ctx))
    return tree_from_spec(spec)


def variant(plan, hkv: int, sms: int, waves: float, wide: bool, tma: bool, warps: int | None = None):
    """``plan`` with its few-program contig launches changed (None when none is); with ``warps``,
    its few-program launches (any addressing) take that many warps instead."""
    out, changed = [], False
    for ln in plan.launches:
        programs = (ln.work_end - ln.work_start) * hkv
        if warps is not None:
            if programs <= waves * sms and ln.num_warps != warps:
                ln = dataclasses.replace(ln, num_warps=warps)
                changed = True
        elif ln.contig and not ln.tma and programs <= waves * sms:
            ln = dataclasses.replace(ln, **(dict(block_n=128, num_warps=4, num_stages=3) if wide else {}),
                                     **(dict(tma=True, split_tail=True) if tma else {}))
            changed = True
        out.append(ln)
    return dataclasses.replace(plan, launches=tuple(out)) if changed else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--suite", default="all")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for spec in list(ENGINE) + list(suite_trees(args.suite)):
        tree = make_tree(spec)
        for hq, hkv in HEADS:
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128)
            q, k, v, out = case_inputs(tree, hq, hkv)
            variants = {f"{name}@{waves:g}": variant(plan, hkv, sms, waves, wide, tma, warps) for waves in WAVES
                        for name, wide, tma, warps in VARIANTS}
            for name in list(variants):  # a variant the smaller bound already made
                same = [m for m in variants if m < name and m.split("@")[0] == name.split("@")[0]]
                if variants[name] is not None and any(variants[m] is not None and variants[m].launches == variants[name].launches
                                                      for m in same):
                    variants[name] = None
            if all(p is None for p in variants.values()):
                continue
            row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy,
                   "launches": [(x.block_m, x.block_n, x.num_warps, x.num_stages, (x.work_end - x.work_start) * hkv,
                                 x.contig, x.tma) for x in plan.launches], "us": {}, "err": {}}
            row["us"]["base"] = graph_us(lambda: w.run(q, k, v, plan, out=out))
            ref = w.run(q, k, v, plan).float()
            for name, p in variants.items():
                if p is None:
                    continue
                row["us"][name] = graph_us(lambda p=p: w.run(q, k, v, p, out=out))
                got = w.run(q, k, v, p).float()
                row["err"][name] = float((got - ref).norm() / ref.norm())
            rows.append(row)
            u = row["us"]
            print(f"{spec[:40]:40s} {hq}/{hkv} {plan.strategy:8s} base {u['base']:7.1f} "
                  + " ".join(f"{n} {u[n]:7.1f} ({u['base'] / u[n]:.2f}x)" for n in u if n != "base")
                  + f" err {max(row['err'].values()):.1e} {row['launches']}", flush=True)
    summary = {}
    for group, keep in (("engine", lambda r: r["tree"] in ENGINE), ("suite", lambda r: r["tree"] not in ENGINE)):
        for name in (f"{v[0]}@{w:g}" for w in WAVES for v in VARIANTS):
            # cases without this variant (nothing changed, or as the smaller bound) count as the best of those
            ratios = [r["us"]["base"] / min([r["us"][m] for m in r["us"] if m.split("@")[0] == name.split("@")[0]
                                             and float(m.split("@")[1]) <= float(name.split("@")[1])] or [r["us"]["base"]])
                      for r in rows if keep(r)]
            if ratios:
                summary[f"{group} {name}"] = {"cases": len(ratios), "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                                              "min": min(ratios), "max": max(ratios)}
    for key, s in summary.items():
        print(f"{key:16s} {s['cases']:3d} cases geomean {s['geomean']:.3f} ({s['min']:.2f}-{s['max']:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "waves": WAVES, "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
