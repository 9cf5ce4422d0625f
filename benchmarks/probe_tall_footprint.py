"""Probe: tall launches of a smaller SM footprint, so that leaf programs run beside them.

Premise (session 36): the >= 100K-token GQA plans cost about the sum of a compute-bound tall
launch and a memory-bound leaf launch. A tall program's shared memory decides how many leaf
programs an SM can hold beside it: the TMA tall tile (128 x 128, 3 stages) takes ~229 KB, a whole
SM, so while its programs run (``1,8,512_32,2048,256`` at 32/8: 128 of them, under one wave) the
leaf launch has 4 SMs; the gathered tile (32 tokens, 7 stages) ~147 KB leaves room for one 68 KB
leaf program; the contig tile (32 tokens, 3 stages) ~80 KB for two. Session 35 made gathered tall
launches persistent (one program a SM) and measured TMA ones persistent (a loss: the SM stays
full), not tall launches of a smaller footprint. Prediction: where the leaf launch reads 2x the
tall launch's KV or more, a contig or shallow gathered tall launch (persistent where it has more
than a wave of programs) brings the plan from the sum of the two launches towards the longer.

Variants name the plan's tall launch (the >= 64-row launch of most KV entries) as
``<A><block_n>.<warps>.<stages>[P<k>|N<n>][m]``: ``A`` its addressing, ``T`` TMA, ``C`` contig
(only where the launch already reads runs), ``G`` gathered; ``P<k>`` persistent over ``k``
programs a SM, ``N<n>`` over ``n`` programs in all (fewer than SMs: the tall launch keeps to
those SMs, and the leaf launch has the others from the start; session 37); ``m`` the merge
launch instead of the last launch's fold (set with ``P`` or ``N``, as the fold makes every leaf
program wait for the tall launch). ``/L[T]<block_n>.<warps>.<stages>`` also sets the launches of
<= 32-row tiles (``T``: through TMA, where they are contig; ``L...`` alone: only those, the tall
launch as planned). ``--cost FIELD=VALUE`` plans with those CostModel fields. Each variant's
output is checked against an fp32 reference; times are CUDA-graph replays (L2 flushed), every
plan once a round over ``--rounds`` rounds; the best of each plan's rounds is compared.

Usage::

    python benchmarks/probe_tall_footprint.py [--trees ...] [--heads 32/8,64/8] [--variants ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re

import torch
from check_gpu import alternating_graph_us, checked_error, reference_fp32, speedups

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import provenance
from treeattn.workloads import tree_from_spec

TREES = ("1,8,512_32,2048,256", "1,8,512_512,512,256", "1,8,512_32,512,256",
         "1,4,16,64,256,1024_256,8,256,64,32,256", "1,4,16,512_1024,256,128,32", "1,1024_2048,32")
VARIANTS = ("T128.8.3P1m", "C32.4.3", "C32.4.3P1m", "C32.4.2P1m", "C32.8.3P1m", "C64.8.2P1m",
            "G32.4.7", "G32.4.7P1m", "G32.4.4", "G32.4.4P1m", "G32.4.3P1m", "G32.4.7P1m/L32.4.3",
            "C32.4.3P1m/L32.4.3")
SPEC = re.compile(r"(?:([TCG])(\d+)\.(\d+)\.(\d+)(?:([PN])(\d+))?(m?))?/?(?:L(T?)(\d+)\.(\d+)\.(\d+))?$")


def variant(plan, name: str, num_sms: int, entries):
    """``plan`` with its tall launch (and leaf launches) as ``name`` says; None where the variant
    does not apply (contig over gathered units, no tall launch) or changes nothing."""
    m = SPEC.match(name)
    if not m:
        raise SystemExit(f"bad variant {name!r}")
    addr, bn, warps, stages, persist, count, fold_off, ltma, lbn, lwarps, lstages = m.groups()
    tall = [i for i, ln in enumerate(plan.launches) if ln.block_m >= 64]
    if not tall:
        return None
    i = max(tall, key=lambda j: entries(plan.launches[j]))
    ln = plan.launches[i]
    if addr and addr in "TC" and not ln.contig:
        return None
    launches = list(plan.launches)
    if addr:
        launches[i] = dataclasses.replace(ln, block_n=int(bn), num_warps=int(warps), num_stages=int(stages),
                                          contig=addr in "TC", tma=addr == "T",
                                          programs=0 if not persist else
                                          int(count) * num_sms if persist == "P" else int(count))
    if lbn:
        launches = [dataclasses.replace(x, block_n=int(lbn), num_warps=int(lwarps), num_stages=int(lstages),
                                        tma=x.contig and bool(ltma))
                    if x.block_m <= 32 else x for x in launches]
    out = dataclasses.replace(plan, launches=tuple(launches))
    if fold_off and plan.merge_last:
        out = dataclasses.replace(out, merge_launch=-1)
    same = out.launches == plan.launches and out.merge_launch == plan.merge_launch
    return None if same else out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="*", default=list(TREES))
    ap.add_argument("--heads", default="32/8,64/8")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cost", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="CostModel fields to plan with (e.g. balance_programs_per_sm=12)")
    ap.add_argument("--out")
    args = ap.parse_args()
    cost_fields = {k: float(v) for k, v in (s.split("=") for s in args.cost)}
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {**provenance(), "variants": args.variants, "cost": cost_fields, "num_sms": num_sms, "rows": []}
    for spec in args.trees:
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            q, k, v, out = case_inputs(tree, hq, hkv)
            ref = reference_fp32(q, k[:, 0], v[:, 0], tree, HEAD_DIM ** -0.5)
            w = TreeAttention(device="cuda")
            w.cost = dataclasses.replace(w.cost, **cost_fields)
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            ks, ke = plan.host.work_kv_start, plan.host.work_kv_end

            def entries(x):
                return int((ke[x.work_start: x.work_end] - ks[x.work_start: x.work_end]).sum())

            row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy, "merge_last": plan.merge_last,
                   "launches": [[ln.block_m, ln.block_n, ln.num_warps, ln.num_stages, ln.contig, ln.tma,
                                 ln.programs, ln.work_end - ln.work_start, entries(ln)] for ln in plan.launches],
                   "err": {}}
            plans = {"planned": plan}
            for name in args.variants:
                p = variant(plan, name, num_sms, entries)
                if p is None or any(p.launches == x.launches and p.merge_launch == x.merge_launch
                                    for x in plans.values()):
                    continue
                o = torch.empty_like(out)
                w.run(q, k, v, p, out=o)
                torch.cuda.synchronize()
                row["err"][name] = checked_error(o, ref, f"{spec} {hq}/{hkv} {name}")
                plans[name] = p
            row["us"] = alternating_graph_us(lambda p: w.run(q, k, v, p, out=out), plans, args.rounds)
            res["rows"].append(row)
            base = min(row["us"]["planned"])
            best = min(row["us"], key=lambda n: min(row["us"][n]))
            print(f"{spec[:40]:40s} {hq}/{hkv} {plan.strategy:7s} planned "
                  + "/".join(f"{t:.1f}" for t in row["us"]["planned"]) + " | "
                  + " ".join(f"{n} " + "/".join(f"{t:.1f}" for t in ts) for n, ts in row["us"].items()
                             if n != "planned")
                  + f" | best {best} x{base / min(row['us'][best]):.3f}", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
    for name in args.variants:
        g = [min(r["us"]["planned"]) / min(r["us"][name]) for r in res["rows"] if name in r["us"]]
        if g:
            print(f"{name:22s} {len(g):3d} cases  {speedups(g)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
