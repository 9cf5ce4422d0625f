"""Probe: persistent tall launches, so that leaf programs run beside them.

Premise: the >= 100K-token GQA trees cost about the sum of a compute-bound tall launch and a
memory-bound leaf launch (sessions 16, 30, 31). Earlier probes gave the tall launch configs
that leave room on an SM (session 30: one tall program an SM), but the block scheduler hands
out the next launch's programs only once every program of the launch before it has been
dispatched: a tall launch of 256 programs at one an SM keeps its second wave queued ahead of
every leaf program. A persistent tall launch (``Launch.programs``: one or two programs an SM,
each looping over the units) is dispatched whole at once, so the leaf launch after it (PDL) gets
the rest of every SM from the start. With PDL every launch after the first waits for the one
before it only before exiting, so the leaf launch is made persistent too (its programs would
otherwise sit on their slots waiting) or its fold is dropped for the merge launch.

For each case: ``auto``'s plan as the suite runs it (default launch mode, one ``run()`` a CUDA
graph, L2 flushed) against variants: ``T<c>`` the tall launches (>= 64 rows) persistent over
``c`` programs an SM, ``L<k>`` the 16-row launches persistent over ``k`` an SM, ``n64`` / ``s2``
the TMA tall launches at 64-token tiles / two stages (less shared memory), ``m`` the merge launch
instead of the last launch's fold. Outputs are checked against the planned plan's; the compiled
kernels' shared memory and registers are recorded.

Usage::

    python benchmarks/probe_persist.py [--trees ...] [--heads 32/8,64/8] [--variants ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import graph_us, provenance
from treeattn.kernels.attention import _tree_partial_attention_kernel
from treeattn.workloads import tree_from_spec

TREES = ("1,8,512_32,2048,256", "1,8,512_512,512,256", "1,8,512_32,512,256",
         "1,4,16,64,256,1024_256,8,256,64,32,256", "1,4,16,64,256,1024_256,32,256,64,32,256",
         "1,1024_2048,32", "1,4,16,512_1024,256,128,32", "4,16,256,512_512,32,128,32",
         "8,16,32,256_512,512,256,32")
VARIANTS = ("W", "m", "Wm", "L2", "T1L2", "L2m", "T1L2m", "L3m", "L4m")


def variant(plan, name: str, num_sms: int):
    """``plan`` changed as ``name`` says (see the module docstring); None where it changes nothing."""
    if name == "W":
        return plan
    name = name.lstrip("W")
    c = k = 0
    if "T" in name:
        c = int(name[name.index("T") + 1])
    if "L" in name:
        k = int(name[name.index("L") + 1])
    launches = []
    for ln in plan.launches:
        if ln.block_m >= 64:
            if ln.tma and "n64" in name:
                ln = dataclasses.replace(ln, block_n=64)
            if ln.tma and "s2" in name:
                ln = dataclasses.replace(ln, num_stages=2)
            if c:
                ln = dataclasses.replace(ln, programs=c * num_sms)
        elif k:
            ln = dataclasses.replace(ln, programs=k * num_sms)
        launches.append(ln)
    out = dataclasses.replace(plan, launches=tuple(launches))
    if name.endswith("m"):
        if not plan.merge_last:
            return None
        out = dataclasses.replace(out, merge_launch=-1)
    return None if out.launches == plan.launches and out.merge_launch == plan.merge_launch else out


def compiled_kernels() -> list:
    """Shared memory, registers and spills of every compiled attention kernel (this process)."""
    out = []
    for caches in _tree_partial_attention_kernel.device_caches.values():
        for key, k in caches[0].items():
            md = k.metadata
            out.append({"warps": md.num_warps, "stages": md.num_stages, "shared": md.shared,
                        "regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
                        "key": str(key)[-400:]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="*", default=list(TREES))
    ap.add_argument("--heads", default="32/8,64/8")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--out")
    args = ap.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {**provenance(), "variants": args.variants, "num_sms": num_sms, "rows": []}
    for spec in args.trees:
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            q, k, v, out = case_inputs(tree, hq, hkv)
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM)
            ref = torch.empty_like(out)
            w.run(q, k, v, plan, out=ref)
            torch.cuda.synchronize()
            row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy, "tall_first": plan.tall_first,
                   "merge_last": plan.merge_last,
                   "launches": [[ln.block_m, ln.block_n, ln.num_warps, ln.num_stages, ln.contig, ln.tma,
                                 ln.work_end - ln.work_start] for ln in plan.launches],
                   "us": {"planned": graph_us(lambda: w.run(q, k, v, plan, out=ref))}, "err": {}}
            for name in args.variants:
                p = variant(plan, name, num_sms)
                if p is None:
                    continue
                # W: every program of a launch after the first waits for the one before at its
                # exit (the kernel before this probe), not only the grid's last
                os.environ.pop("TREEATTN_PDL_WAIT_ALL", None)
                if name.startswith("W"):
                    os.environ["TREEATTN_PDL_WAIT_ALL"] = "1"
                o = torch.empty_like(out)
                w.run(q, k, v, p, out=o)
                torch.cuda.synchronize()
                err = float((o.float() - ref.float()).norm() / ref.float().norm())
                if not math.isfinite(err) or err > 1e-2:
                    raise SystemExit(f"{spec} {hq}/{hkv} {name}: relative L2 {err}")
                row["err"][name] = err
                row["us"][name] = graph_us(lambda: w.run(q, k, v, p, out=o))
                os.environ.pop("TREEATTN_PDL_WAIT_ALL", None)
            # the planned plan again, for the spread between the first and last timing
            row["us"]["planned2"] = graph_us(lambda: w.run(q, k, v, plan, out=ref))
            res["rows"].append(row)
            base = min(row["us"]["planned"], row["us"]["planned2"])
            best = min(row["us"], key=row["us"].get)
            print(f"{spec[:40]:40s} {hq}/{hkv} {plan.strategy:7s} planned {row['us']['planned']:7.1f} "
                  f"{row['us']['planned2']:7.1f} | "
                  + " ".join(f"{k_} {t:6.1f}" for k_, t in row["us"].items() if not k_.startswith("planned"))
                  + f" | best {best} x{base / row['us'][best]:.3f}", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
    try:
        res["kernels"] = compiled_kernels()
    except Exception as e:  # noqa: BLE001 (Triton's caches are internals: keep the timings)
        res["kernels"] = [f"{type(e).__name__}: {e}"]
    for name in args.variants:
        g = [min(r["us"]["planned"], r["us"]["planned2"]) / r["us"][name] for r in res["rows"] if name in r["us"]]
        if g:
            print(f"{name:10s} {len(g):3d} cases  geomean speedup {math.exp(sum(map(math.log, g)) / len(g)):.3f} "
                  f"[{min(g):.3f}, {max(g):.3f}]")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
