"""Probe: do a plan's compute-bound tall launch and its memory-bound launches overlap?

The trees of >= 100K tokens at GQA (e.g. `1,8,512_32,2048,256` at 64/8: 246 us against a 145 us
roofline) run a tall launch over the shared prefixes (compute-bound, ~110 us) and a launch over
the unshared leaves (memory-bound). ``TreeAttention`` puts them on side streams inside the CUDA
graph, but if the tall programs fill every SM's registers the leaf programs only start when they
finish, and the plan costs the sum. This times, per case (CUDA-graph replay, L2 flushed):

* ``planned``: ``auto``'s plan as the suite runs it (3 side streams); ``serial``: no side streams;
  ``flipped``: the other launch order;
* each launch alone and the merge alone (``alone``, ``merge``);
* ``chunked``: the slowest launch cut into consecutive launches of at most one program per SM,
  one after another on the main stream, the other launches beside them on side streams (so each
  SM has room for memory-bound programs beside one tall one); ``chunked_alone``: those chunks alone.

Every variant's output is checked against the planned one.

Usage (H200)::

    python benchmarks/probe_overlap.py --out benchmarks/results/h200_probe_overlap.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from treeattn import TreeAttention
from treeattn.bench.kernels import case_inputs
from treeattn.bench.timing import graph_us, provenance
from treeattn.ops import merge_partials, partial_attention
from treeattn.workloads import tree_from_spec

TREES = (
    "1,8,512_32,512,256", "1,8,512_512,512,256", "1,8,512_32,2048,256",
    "1,4,16,64,256,1024_256,8,256,64,32,256", "1,4,16,64,256,1024_256,32,256,64,32,256",
    "1,1024_2048,32", "1,4,16,512_1024,256,128,32", "4,16,256,512_512,32,128,32",
    "8,16,32,256_512,512,256,32",
)
HEADS = ((32, 8), (64, 8))
SCALE = 0.088


def probe_case(spec: str, hq: int, hkv: int, streams: list) -> dict:
    tree = tree_from_spec(spec)
    q, k, v, out = case_inputs(tree, hq, hkv)
    w = TreeAttention(device="cuda", streams=3)
    plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128)
    o_part, lse_part = w.partial_buffers(plan)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy, "tall_first": plan.tall_first,
           "launches": [dataclasses.asdict(x) for x in plan.launches], "us": {}, "err": {}}

    def timed(name, fn):
        row["us"][name] = graph_us(fn)
        fn()
        torch.cuda.synchronize()
        return out.float().clone()

    ref = timed("planned", lambda: w.run(q, k, v, plan, out=out))
    serial = TreeAttention(device="cuda", streams=0)
    serial_plan = serial.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128)
    for name, fn in (("serial", lambda: serial.run(q, k, v, serial_plan, out=out)),
                     ("flipped", lambda: w.run(q, k, v, dataclasses.replace(plan, tall_first=not plan.tall_first),
                                               out=out))):
        row["err"][name] = float((timed(name, fn) - ref).abs().max())

    def launch(x):
        partial_attention(q, k, v, dataclasses.replace(plan, launches=(x,)), o_part, lse_part,
                          sm_scale=SCALE, out=out)

    def merge():
        merge_partials(o_part, lse_part, plan.merge_q_indices, plan.merge_indptr, plan.merge_indices, out, None)

    alone = []
    for x in plan.launches:
        alone.append(graph_us(lambda x=x: launch(x)))
    row["us"]["alone"] = alone
    row["us"]["merge"] = graph_us(merge)
    slow = max(range(len(alone)), key=alone.__getitem__)
    tall = plan.launches[slow]
    per = max(1, sms // hkv)
    chunks = [dataclasses.replace(tall, work_start=s, work_end=min(s + per, tall.work_end))
              for s in range(tall.work_start, tall.work_end, per)]
    others = [x for i, x in enumerate(plan.launches) if i != slow]
    row["chunks"] = len(chunks)

    def chunked():
        main = torch.cuda.current_stream()
        side = streams[:len(others)]
        for s in side:
            s.wait_stream(main)
        for c in chunks:
            launch(c)
        for s, x in zip(side, others):
            with torch.cuda.stream(s):
                launch(x)
        for s in side:
            main.wait_stream(s)
        merge()

    def chunked_alone():
        for c in chunks:
            launch(c)

    row["err"]["chunked"] = float((timed("chunked", chunked) - ref).abs().max())
    row["us"]["chunked_alone"] = graph_us(chunked_alone)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--trees", nargs="*", default=TREES)
    args = ap.parse_args()
    streams = [torch.cuda.Stream() for _ in range(3)]
    rows = []
    for spec in args.trees:
        for hq, hkv in HEADS:
            r = probe_case(spec, hq, hkv, streams)
            rows.append(r)
            u = r["us"]
            print(f"{spec[:40]:40s} {hq}/{hkv} {r['strategy']:7s} tall_first={r['tall_first']!s:5s} "
                  f"planned {u['planned']:7.1f} serial {u['serial']:7.1f} flipped {u['flipped']:7.1f} "
                  f"alone {' + '.join(f'{a:.1f}' for a in u['alone'])} merge {u['merge']:.1f} "
                  f"chunked {u['chunked']:7.1f} ({r['chunks']} chunks alone {u['chunked_alone']:.1f}) "
                  f"err {max(r['err'].values()):.2e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "rows": rows}, f, indent=1, default=int)


if __name__ == "__main__":
    main()
