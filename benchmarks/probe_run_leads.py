"""Affine addresses for the context chunks of Medusa trees' plans, as the engine plans them.

With the token tree's shared first drafts cut off the tiles' leads (``plan.leads.run_leads``), every
unit of the unmasked launch over the context chunks reads one run of slots. At t=256 that launch
(128-row tiles) then takes affine addresses (``contig_launches``: TILE_TALL_CONTIG); at t=64 / 128
its 64-row tiles keep gathered slots beyond one wave of programs (a rule measured on the kernel
suite). This times ``auto``'s plan (the engine's cost model) as planned and with such unmasked
all-run launches forced to affine addresses at their own config (``contig``) and at
TILE_TALL_CONTIG (``contig_tall``), and the 128-row ones through TMA descriptors at TILE_TALL_TMA
(``tma``), under CUDA-graph replay with PDL (``probe_spec._time_plan``).

    python benchmarks/probe_run_leads.py [--sizes 64,128,256] [--contexts 800,1500,2500] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from probe_spec import HQ, _check, _medusa_setup, _time_plan, spec_tree
from treeattn.bench.timing import provenance
from treeattn.plan import make_plan
from treeattn.plan.addressing import TILE_TALL_CONTIG, TILE_TALL_TMA, unit_runs


def variants(plan) -> dict:
    h = plan.host
    runs = unit_runs(h.kv_slots, h.work_kv_start, h.work_kv_end)
    out = {"planned": plan}
    for name, cfg in (("contig", None), ("contig_tall", TILE_TALL_CONTIG), ("tma", TILE_TALL_TMA)):
        launches = []
        for ln in plan.launches:
            if not ln.masked and not ln.tma and ln.work_end > ln.work_start and runs[ln.work_start: ln.work_end].all() \
                    and (name == "tma" and ln.block_m >= 128 or name != "tma" and not ln.contig):
                extra = {} if cfg is None else dict(zip(("block_n", "num_warps", "num_stages"), cfg))
                if name == "tma":
                    extra.update(tma=True, split_tail=True)
                ln = dataclasses.replace(ln, contig=True, **extra)
            launches.append(ln)
        if tuple(launches) != plan.launches:
            out[name] = dataclasses.replace(plan, launches=tuple(launches))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,128,256")
    ap.add_argument("--contexts", default="800,1500,2500")
    ap.add_argument("--out")
    args = ap.parse_args()
    cost, heads, contexts, scratch, mover, k, v = _medusa_setup(args)
    res = {**provenance(), "rows": []}
    for size in (int(s) for s in args.sizes.split(",")):
        for ctx in contexts:
            tree = spec_tree(size, ctx, scratch)
            q = torch.randn(tree.num_queries, HQ, heads.head_dim, device="cuda", dtype=torch.float16)
            plan = make_plan(tree, heads, cost=cost)
            row, ref = {"size": size, "context": ctx, "strategy": plan.strategy, "us": {}, "launches": {}}, None
            for name, p in variants(plan).items():
                us, out = _time_plan(p, mover, q, k, v)
                ref = _check(out, ref, f"medusa{size}@{ctx} {name}")
                row["us"][name] = us
                row["launches"][name] = [dataclasses.asdict(ln) for ln in p.launches]
            print(f"medusa{size}@{ctx} {plan.strategy}: " + " ".join(f"{n} {u:.1f}" for n, u in row["us"].items()),
                  flush=True)
            res["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
