"""Probe: what bounds a lone program's KV tile -- memory round trips or the loop body?

A lone program of the attention kernel walks one 64-token tile of contig slots in about 0.97 us
(`h200_probe_pipeline.json`), one memory round trip a tile although the loop is pipelined, and
deeper pipelines do not help (`h200_sweep_stages_0189740.json`). If the loop body's instructions
(16-row tiles: masks, selects, the online softmax's rescales around two small MMAs) rather than
the memory bound each iteration, a leaner body would run faster. Per KV head one program walks
``n`` tokens of one node (one query; CUDA-graph replay, L2 flushed); the slope over ``n`` is the
cost of a tile:

* ``planned``: the kernel as ``node`` plans it (no split tail: every tile checks its bounds);
* ``split_tail``: the same launch with the split tail (whole tiles take the kernel's FULL step);
* ``planned_wW``: the planned launch with ``W`` warps;
* ``bare/BN/S[/wW]``: a minimal loop (contig K/V, no bounds, no mask, FULL-style softmax) with
  ``BN``-token tiles and ``S`` stages; ``tma/BN/S`` the same loading K/V through tensor
  descriptors (Hopper's TMA: bulk copies, no per-thread loads).

Usage (H200)::

    python benchmarks/probe_tile.py --out benchmarks/results/h200_probe_tile.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from treeattn import DecodingTree, TreeAttention
from treeattn.bench.timing import graph_us, provenance

HEADS = ((32, 8), (64, 8))
LENGTHS = (1024, 4096)
BARE = ((64, 2), (64, 3), (64, 4), (128, 2), (128, 3))
TMA = ((64, 3), (64, 4), (128, 2), (128, 3))
WARPS = (2, 8)  # besides 4: bare/64/3 and the planned launch with these warps


@triton.jit
def _bare(Q, K, V, O, kd, vd, n_tok, qk_scale, HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, USE_TMA: tl.constexpr):
    h = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rows = offs_m < GROUP
    q = tl.load(Q + (h * GROUP + offs_m)[:, None] * D + offs_d[None, :], mask=rows[:, None], other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for n0 in range(0, n_tok, BN):
        if USE_TMA:
            k = kd.load([n0, h * D])
            v = vd.load([n0, h * D])
        else:
            offs_n = (n0 + tl.arange(0, BN)).to(tl.int64)
            k = tl.load(K + offs_n[:, None] * (HKV * D) + h * D + offs_d[None, :])
            v = tl.load(V + offs_n[:, None] * (HKV * D) + h * D + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    tl.store(O + (h * GROUP + offs_m)[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=rows[:, None])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for hq, hkv in HEADS:
        group = hq // hkv
        t = {}
        for n in LENGTHS:
            tree = DecodingTree.from_parents([-1], [n], query_nodes=[0])
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, strategy="node")
            q = torch.randn(1, hq, 128, device="cuda", dtype=torch.float16)
            k = torch.randn(n, 1, hkv, 128, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            out = torch.empty_like(q)
            ref = w.run(q, k, v, plan).float()
            t[("planned", n)] = graph_us(lambda: w.run(q, k, v, plan, out=out))
            tail = dataclasses.replace(plan, launches=tuple(dataclasses.replace(x, split_tail=True)
                                                             for x in plan.launches))
            t[("split_tail", n)] = graph_us(lambda: w.run(q, k, v, tail, out=out))
            err = {"split_tail": float((w.run(q, k, v, tail).float() - ref).abs().max())}
            for nw in WARPS:
                p_w = dataclasses.replace(plan, launches=tuple(dataclasses.replace(x, num_warps=nw) for x in plan.launches))
                t[(f"planned_w{nw}", n)] = graph_us(lambda p_w=p_w: w.run(q, k, v, p_w, out=out))
                err[f"planned_w{nw}"] = float((w.run(q, k, v, p_w).float() - ref).abs().max())
            o = torch.empty(hq, 128, device="cuda", dtype=torch.float16)
            for bn, st, tma, nw in ([(*c, False, 4) for c in BARE] + [(*c, True, 4) for c in TMA]
                                    + [(64, 3, False, x) for x in WARPS] + [(128, 3, True, x) for x in WARPS]):
                name = f"{'tma' if tma else 'bare'}/{bn}/{st}" + (f"/w{nw}" if nw != 4 else "")
                kd = TensorDescriptor(k.view(n, hkv * 128), [n, hkv * 128], [hkv * 128, 1], [bn, 128])
                vd = TensorDescriptor(v.view(n, hkv * 128), [n, hkv * 128], [hkv * 128, 1], [bn, 128])

                def bare(bn=bn, st=st, tma=tma, kd=kd, vd=vd, nw=nw):
                    _bare[(hkv,)](q, k, v, o, kd if tma else None, vd if tma else None, n,
                                  128 ** -0.5 * 1.4426950408889634, HKV=hkv, GROUP=group, D=128,
                                  BM=max(16, group), BN=bn, USE_TMA=tma, num_warps=nw, num_stages=st)
                t[(name, n)] = graph_us(bare)
                bare()
                err[name] = float((o.float() - ref[0]).abs().max())
            cfg = [(x.block_m, x.block_n, x.num_warps, x.num_stages, x.contig, x.split_tail) for x in plan.launches]
        names = (["planned", "split_tail"] + [f"planned_w{x}" for x in WARPS] + [f"bare/{bn}/{st}" for bn, st in BARE]
                 + [f"tma/{bn}/{st}" for bn, st in TMA] + [f"bare/64/3/w{x}" for x in WARPS] + [f"tma/128/3/w{x}" for x in WARPS])
        row = {"hq": hq, "hkv": hkv, "planned_launches": cfg, "err": err, "us": {}, "us_per_tile": {}}
        for name in names:
            bn = int(name.split("/")[1]) if "/" in name else 64
            row["us"][name] = {n: t[(name, n)] for n in LENGTHS}
            row["us_per_tile_64"] = row.get("us_per_tile_64", {})
            row["us_per_tile_64"][name] = (t[(name, LENGTHS[1])] - t[(name, LENGTHS[0])]) / ((LENGTHS[1] - LENGTHS[0]) / 64)
            print(f"{hq}/{hkv} {name:12s} " + " ".join(f"{n}:{t[(name, n)]:.1f}" for n in LENGTHS)
                  + f" us; {row['us_per_tile_64'][name]:.2f} us per 64 tokens (tile {bn}); err {err.get(name, 0):.1e}",
                  flush=True)
        row.pop("us_per_tile")
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
