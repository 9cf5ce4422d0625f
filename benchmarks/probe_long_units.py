"""Memory-bound launches over long units: KV tile, pipeline depth and TMA loads (one GPU call).

Premise: the kernel suite's only case behind a peer is ``256_4096`` at 64/8 (256 unrelated
4096-token sequences: one ``sequence`` launch of 2048 programs of 16-row x 64-token tiles, 2
stages, affine addresses), 996.6 us against FlashInfer decode's 987.3, at 4.31 TB/s where a pure
read stream reaches ~4.46. The same narrow launches read the leaves of the >= 100K-token GQA trees.
This times each case's plan with its narrow unmasked contig launches (``block_m`` <= 32) at other
configs, under CUDA-graph replay (``do_bench`` median, L2 flushed), in the launch mode ``bench
kernels`` uses, alternating base and variant twice, outputs checked against the plan as built.

    python benchmarks/probe_long_units.py [--cases SPEC:HQ/HKV:STRATEGY ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import copy_bandwidth, graph_us, provenance, roofline_us
from treeattn.workloads import tree_from_spec

CASES = ("256_4096:64/8:sequence", "256_4096:32/8:sequence", "256_1024:64/8:sequence", "256_1024:32/8:sequence",
         "256_1024:32/32:sequence", "1,8,512_32,512,256:64/8:auto", "1,8,512_32,512,256:32/8:auto",
         "1,8,512_32,2048,256:64/8:auto")
#: name -> Launch fields replaced on the narrow launches
VARIANTS = {
    "stages3": dict(num_stages=3),
    "n128": dict(block_n=128, num_stages=2),
    "tail": dict(split_tail=True),
    "tma64s3": dict(num_stages=3, split_tail=True, tma=True),
    "tma128": dict(block_n=128, num_stages=2, split_tail=True, tma=True),
}


def narrow(ln, has_mask: bool) -> bool:
    """A narrow launch over runs of slots that runs no tree mask."""
    return ln.block_m <= 32 and ln.contig and not (has_mask and ln.masked) and ln.work_end > ln.work_start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out")
    args = ap.parse_args()
    bw = copy_bandwidth()
    res = {**provenance(), "copy_bandwidth_TBps": bw / 1e12, "variants": VARIANTS, "rows": []}
    t0 = time.time()
    for case in args.cases:
        spec, heads, strategy = case.split(":")
        hq, hkv = (int(x) for x in heads.split("/"))
        tree = tree_from_spec(spec)
        q, k, v, out = case_inputs(tree, hq, hkv)
        w = TreeAttention(device="cuda")
        plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, strategy=strategy)
        plans = {"base": plan}
        for name in args.variants.split(","):
            if any(narrow(ln, plan.has_mask) for ln in plan.launches):
                plans[name] = dataclasses.replace(plan, launches=tuple(
                    dataclasses.replace(ln, **VARIANTS[name]) if narrow(ln, plan.has_mask) else ln for ln in plan.launches))
        row = {"case": case, "strategy": plan.strategy,
               "roofline_us": roofline_us(tree.num_tokens, tree.num_queries, hq, hkv, HEAD_DIM, bw),
               "launches": [dataclasses.asdict(ln) for ln in plan.launches], "us": {}, "err": {}}
        w.run(q, k, v, plan, out=out)
        ref = out.float().clone()
        for rnd in range(2):  # base and each variant twice, alternating
            for name, p in plans.items():
                try:
                    us = graph_us(lambda: w.run(q, k, v, p, out=out))
                except Exception as e:  # noqa: BLE001 (a config that does not compile or fit)
                    row["err"][name] = f"{type(e).__name__}: {e}"[:200]
                    continue
                row["us"].setdefault(name, []).append(us)
                if rnd == 0 and name != "base":
                    diff = float((out.float() - ref).abs().max())
                    row["err"][name] = diff
                    if not diff <= 5e-3:
                        raise SystemExit(f"{case} {name}: max diff {diff}")
        res["rows"].append(row)
        base = min(row["us"]["base"])
        print(f"{case} roof {row['roofline_us']:.1f} base {base:.1f} ({base / row['roofline_us']:.3f}) "
              + " ".join(f"{n} {min(u):.1f} ({base / min(u):.3f}x)" for n, u in row["us"].items() if n != "base")
              + f" [{time.time() - t0:.0f}s]", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        del q, k, v, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
