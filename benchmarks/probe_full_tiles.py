"""Probe: the select-free softmax step over whole KV tiles (``Launch.split_tail``) by query-tile
height, on every kernel-suite case and strategy.

Tall query tiles over long items issue ~14% fewer instructions a KV tile with the step (no
per-entry selects, the scale folded into one FMA; PTX of the 128-row tile for sm_90), but an
unmasked unit's last, partial tile then runs after the software-pipelined loop: one more
memory round trip a program. This times every strategy's plan under CUDA-graph replay (streams
as ``treeattn bench kernels``) with ``split_tail`` set on launches of at least ``m`` rows for
each ``m`` of :data:`VARIANTS`, and, with ``--old-kernel``, the kernel file of the previous commit
(no step at all, also not before a mask split), checking every output against the first.

    python benchmarks/probe_full_tiles.py [--heads 32/32,32/8,64/8] [--old-kernel PATH] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import time

import torch

from treeattn import TreeAttention, ops
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import graph_us, provenance, roofline_us, copy_bandwidth
from treeattn.plan import PLANNERS
from treeattn.workloads import suite_trees, tree_from_spec

#: variant name -> smallest query-tile height given split_tail
VARIANTS = {"never": 1 << 30, "m128": 128, "m64": 64, "all": 1}


def with_split_tail(plan, min_rows: int):
    return dataclasses.replace(plan, launches=tuple(
        dataclasses.replace(ln, split_tail=ln.block_m >= min_rows) for ln in plan.launches))


class _DropSplitTail:
    """The previous commit's kernel under the current launcher (which passes SPLIT_TAIL)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def call(*args, SPLIT_TAIL=False, **kw):  # noqa: N803 (the kernel's constexpr name)
            return launch(*args, **kw)
        return call


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--old-kernel", help="path of the previous kernels/attention.py")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    new_kernel = ops._tree_partial_attention_kernel
    old_kernel = None
    if args.old_kernel:
        spec = importlib.util.spec_from_file_location("old_attention", args.old_kernel)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        old_kernel = _DropSplitTail(mod._tree_partial_attention_kernel)
    res = {**provenance(), "variants": VARIANTS, "rows": []}
    bw = copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    t0 = time.time()
    for spec in suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in heads:
            q, k, v, out = case_inputs(tree, hq, hkv)
            row = {"tree": spec, "hq": hq, "hkv": hkv,
                   "roofline_us": roofline_us(tree.num_tokens, tree.num_queries, hq, hkv, HEAD_DIM, bw),
                   "us": {}, "err": {}}
            w = TreeAttention(device="cuda", streams=3)
            row["auto"] = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM).strategy
            for s in PLANNERS:
                plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, strategy=s)
                us, err, ref = {}, {}, None
                runs = [("old", plan)] if old_kernel is not None else []
                runs += [(name, with_split_tail(plan, m)) for name, m in VARIANTS.items()]
                for name, p in runs:
                    ops._tree_partial_attention_kernel = old_kernel if name == "old" else new_kernel
                    try:
                        us[name] = graph_us(lambda: w.run(q, k, v, p, out=out))
                    finally:
                        ops._tree_partial_attention_kernel = new_kernel
                    got = out.float()
                    if ref is None:
                        ref, scale = got.clone(), float(got.abs().max())
                    err[name] = float((got - ref).abs().max()) / scale
                row["us"][s], row["err"][s] = us, err
            res["rows"].append(row)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
            a = row["us"][row["auto"]]
            base = a.get("old", a["never"])
            print(f"{spec[:40]:40s} {hq}/{hkv} auto={row['auto']:10s} " +
                  " ".join(f"{n}={x:.1f}({base / x:.2f})" for n, x in a.items()) +
                  (" BAD" if any(not e < 1e-2 for er in row["err"].values() for e in er.values()) else "")
                  + f" [{time.time() - t0:.0f}s]", flush=True)
            torch.cuda.empty_cache()
    summary = {}
    names = (["old"] if old_kernel is not None else []) + list(VARIANTS)
    for hq, hkv in heads:
        rows = [r for r in res["rows"] if (r["hq"], r["hkv"]) == (hq, hkv)]
        for s in list(PLANNERS) + ["auto"]:
            for n in names:
                ratios = [r["us"][r["auto"] if s == "auto" else s]["never"] /
                          r["us"][r["auto"] if s == "auto" else s][n] for r in rows]
                summary[f"{hq}/{hkv} {s} {n}"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    res["geomean_speedup_over_never"] = summary
    for kk, x in summary.items():
        print(f"{kk:32s} {x:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
