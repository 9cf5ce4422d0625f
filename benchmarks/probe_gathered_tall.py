"""Probe: narrow KV tiles and deep pipelines for tall launches that gather their slots.

Premise (`h100_probe_cohabit.json`): the gathered 128-row launches (units that are not runs of
slots: a 32-token root glued to a node, say) run 64-token KV tiles at 4 warps and 3 stages, where
the kernel takes 255 registers a thread and spills (Triton 3.6: 18-54 bytes). The same launches
with 32-token tiles and 7-8 stages spill nothing and ran 1.20-1.29x faster alone on 6 of 7 cases
(`1,4,16,512_1024,256,128,32` 32/8 60.9 -> 50.6 us; the deep PAT tree at 64/8 125.4 -> 97.3).
Contig tall launches already take 32-token tiles (``TILE_TALL_CONTIG``); gathered ones keep the
planned 64-token config.

For every suite case whose ``auto`` plan has a gathered launch of >= 64 rows and 64-token KV
tiles: the plan as the suite runs it (side streams, one ``run()`` a CUDA graph, L2 flushed), the
same plan with those launches at each config in ``CONFIGS``, and each such launch alone at each
config. Outputs are checked against the planned plan's.

Usage::

    python benchmarks/probe_gathered_tall.py [--heads 32/32,32/8,64/8] [--select gathered|contig] [--out FILE]

``--select contig`` varies the tall contig launches (``TILE_TALL_CONTIG``, no TMA) instead, at
``CONFIGS_CONTIG``.
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
from treeattn.ops import partial_attention
from treeattn.plan.addressing import TILE_TALL_CONTIG, TILE_TALL_GATHERED
from treeattn.workloads import suite_trees, tree_from_spec

CONFIGS = ((32, 4, 3), (32, 4, 5), (32, 4, 7))
#: ``--select contig``: tall contig launches at TILE_TALL_CONTIG, deeper
CONFIGS_CONTIG = ((32, 4, 4), (32, 4, 5), (32, 4, 7))


def gathered_tall(ln) -> bool:
    """A gathered launch of >= 64 rows over long items, as planned before TILE_TALL_GATHERED (the
    launches it now takes are selected too)."""
    return not ln.contig and not ln.tma and ln.block_m >= 64 and (
        ln.block_n == 64 or (ln.block_n, ln.num_warps, ln.num_stages) == TILE_TALL_GATHERED)


def contig_tall(ln) -> bool:
    return ln.contig and not ln.tma and (ln.block_n, ln.num_warps, ln.num_stages) == TILE_TALL_CONTIG


def with_config(plan, cfg, select=gathered_tall):
    bn, nw, ns = cfg
    return dataclasses.replace(plan, launches=tuple(
        dataclasses.replace(ln, block_n=bn, num_warps=nw, num_stages=ns) if select(ln) else ln
        for ln in plan.launches))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--trees", nargs="*", default=None)
    ap.add_argument("--select", default="gathered", choices=("gathered", "contig"),
                    help="the launches to vary: gathered tall ones, or contig ones at TILE_TALL_CONTIG")
    ap.add_argument("--out")
    args = ap.parse_args()
    select = gathered_tall if args.select == "gathered" else contig_tall
    configs = CONFIGS if args.select == "gathered" else CONFIGS_CONTIG
    res = {**provenance(), "select": args.select, "configs": [list(c) for c in configs], "rows": []}
    name = lambda c: "/".join(map(str, c))  # noqa: E731
    for spec in args.trees or suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            hits = [i for i, ln in enumerate(plan.launches) if select(ln)]
            if not hits:
                continue
            q, k, v, out = case_inputs(tree, hq, hkv)
            ref = torch.empty_like(out)
            w.run(q, k, v, plan, out=ref)
            torch.cuda.synchronize()
            o_part, lse_part = w.partial_buffers(plan)
            row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy,
                   "launches": [[ln.block_m, ln.block_n, ln.num_warps, ln.num_stages, ln.contig, ln.tma,
                                 bool(plan.has_mask and ln.masked), (ln.work_end - ln.work_start) * hkv]
                                for ln in plan.launches],
                   "hits": hits, "us": {"planned": graph_us(lambda: w.run(q, k, v, plan, out=ref))},
                   "alone": {}, "err": {}}
            for cfg in (None, *configs):
                p = plan if cfg is None else with_config(plan, cfg, select)
                key = "planned" if cfg is None else name(cfg)
                if cfg is not None:
                    o = torch.empty_like(out)
                    w.run(q, k, v, p, out=o)
                    torch.cuda.synchronize()
                    err = float((o.float() - ref.float()).norm() / ref.float().norm())
                    if not math.isfinite(err) or err > 1e-2:
                        raise SystemExit(f"{spec} {hq}/{hkv} {key}: relative L2 {err}")
                    row["err"][key] = err
                    row["us"][key] = graph_us(lambda: w.run(q, k, v, p, out=o))
                for i in hits:
                    one = dataclasses.replace(p, launches=(p.launches[i],))
                    row["alone"][f"L{i}:{key}"] = graph_us(lambda: partial_attention(
                        q, k, v, one, o_part, lse_part, sm_scale=0.088, out=out))
            res["rows"].append(row)
            base = row["us"]["planned"]
            print(f"{spec[:44]:44s} {hq}/{hkv} {plan.strategy:7s} {[row['launches'][i] for i in hits]} "
                  f"planned {base:7.1f} | "
                  + " ".join(f"{k_} x{base / t:.3f}" for k_, t in row["us"].items() if k_ != "planned")
                  + " | alone " + " ".join(f"{k_} {t:6.1f}" for k_, t in row["alone"].items()), flush=True)
    for cfg in configs:
        key = name(cfg)
        for label, sel in (("all", lambda r: True),
                           ("128-row", lambda r: any(r["launches"][i][0] >= 128 for i in r["hits"])),
                           ("64-row", lambda r: all(r["launches"][i][0] == 64 for i in r["hits"])),
                           ("masked", lambda r: any(r["launches"][i][6] for i in r["hits"])),
                           ("unmasked", lambda r: not any(r["launches"][i][6] for i in r["hits"]))):
            g = [r["us"]["planned"] / r["us"][key] for r in res["rows"] if sel(r)]
            if g:
                print(f"{key} {label:9s} n={len(g):3d} plan speedup geomean "
                      f"{math.exp(sum(map(math.log, g)) / len(g)):.3f} [{min(g):.3f}, {max(g):.3f}]", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
