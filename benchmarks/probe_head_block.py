"""Probe: several KV heads a program (``Launch.head_block``), the same plans timed alternately in
one process.

Premise (session 38, Nsight Compute): leaf launches of one or two KV tiles a program are bound by
their instructions, most of them the program's fixed work (metadata, Q, merge map, slots and
addresses) rather than its tiles; and a unit of one query fills 4 (32/8) or 8 (64/8) of a 16-row
query tile. A program that runs ``head_block`` KV heads of its unit at once, one block of rows
and one of KV columns a head (the scores across blocks hidden), fills its tile and shares that
fixed work. Each case's ``auto`` plan is timed as planned and with every eligible launch given
the largest head block whose rows hold its units: up to 2 (``p2``), and up to 4 with KV tiles of
at most 128 entries in 2 stages (``p4``); every output is checked against the fp32 reference.

Usage::

    python benchmarks/probe_head_block.py [--trees ...] [--heads 32/8,64/8] [--rounds 3] [--out FILE]
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from check_gpu import ab_parser, alternating_graph_us, case_with_reference, checked_runs, speedups

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM
from treeattn.bench.timing import provenance
from treeattn.workloads import suite_trees, tree_from_spec


def head_blocked(plan, max_block: int, *, max_cols: int = 1 << 30, num_stages: int | None = None):
    """``plan`` with every plain launch (not TMA, persistent or heads-inner) given the largest
    power-of-two head block up to ``max_block`` that divides the KV heads, whose blocks of
    ``block_m / head_block`` rows hold each unit's rows (a whole GQA group a query) and whose KV
    tile (``head_block x block_n`` entries) is at most ``max_cols`` (and ``num_stages`` where
    given); None if no launch takes one."""
    h = plan.heads
    unit_rows = np.diff(plan.work_row_indptr.cpu().numpy()) * h.group
    launches, changed = [], False
    for ln in plan.launches:
        best = 1
        if not (ln.tma or ln.programs or ln.heads_inner):
            rows = int(unit_rows[ln.work_start:ln.work_end].max())
            hb = 2
            while hb <= max_block and h.num_kv_heads % hb == 0 and ln.block_m % hb == 0 and hb * ln.block_n <= max_cols:
                block_rows = ln.block_m // hb
                if block_rows < rows or block_rows % h.group:
                    break
                best, hb = hb, hb * 2
        if best > 1:
            changed = True
            ln = dataclasses.replace(ln, head_block=best, num_stages=num_stages or ln.num_stages)
        launches.append(ln)
    return dataclasses.replace(plan, launches=tuple(launches)) if changed else None


def main() -> None:
    ap = ab_parser(__doc__.split("\n\n")[0])
    args = ap.parse_args()
    variants = {"p2": dict(max_block=2), "p4": dict(max_block=4, max_cols=128, num_stages=2)}
    res = {**provenance(), "variants": variants, "rows": []}
    for spec in args.trees or suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            plans = {"planned": plan}
            for name, opts in variants.items():
                packed = head_blocked(plan, **opts)
                if packed is not None and all(packed.launches != p.launches for p in plans.values()):
                    plans[name] = packed
            if len(plans) == 1:
                continue
            q, k, v, out, ref = case_with_reference(tree, hq, hkv)

            def run(p, o=out):
                w.run(q, k, v, p, out=o)

            row = {"tree": spec, "hq": hq, "hkv": hkv, "tree_tokens": tree.num_tokens, "strategy": plan.strategy,
                   "head_blocks": {n: [ln.head_block for ln in p.launches] for n, p in plans.items()},
                   "err": checked_runs(run, plans, ref, f"{spec} {hq}/{hkv}"),
                   "us": alternating_graph_us(run, plans, args.rounds)}
            best = {n: min(us) for n, us in row["us"].items()}
            row["speedup"] = {n: best["planned"] / b for n, b in best.items() if n != "planned"}
            res["rows"].append(row)
            print(f"{spec[:40]:40s} {hq}/{hkv} {plan.strategy:8s} planned {best['planned']:8.1f} "
                  + " ".join(f"{n} {row['head_blocks'][n]} {best[n]:8.1f} x{x:.3f}" for n, x in row["speedup"].items()),
                  flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
    for name in variants:
        rows = [r for r in res["rows"] if name in r["speedup"]]
        if rows:
            print(f"{name} over planned: {len(rows)} plans, {speedups([r['speedup'][name] for r in rows])}")
            for hq, hkv in sorted({(r["hq"], r["hkv"]) for r in rows}):
                some = [r["speedup"][name] for r in rows if (r["hq"], r["hkv"]) == (hq, hkv)]
                print(f"  {hq}/{hkv}: {len(some)} plans, {speedups(some)}")


if __name__ == "__main__":
    main()
