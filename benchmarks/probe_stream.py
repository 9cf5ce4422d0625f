"""Probe: short work units streamed through one software pipeline, several units a program.

The >= 100K-token GQA trees spend most of their bytes in a launch over the unshared leaves: one
program per (leaf unit, KV head), 256 tokens = four 64-token tiles each, affine (contig) slots,
a 16-row query tile. Alone, that launch reads 537 MB in 144 us at 64/8 (3.7 TB/s,
`h200_probe_overlap.json`), while units of 4096 tokens stream at 4.5 TB/s (`256_4096`). A
four-tile program spends much of its life outside its pipelined loop: the metadata round trips
before its first K/V load, the pipeline's fill and drain, the stores.

``_stream`` gives a program ``U`` consecutive units of the launch and walks all their tiles in
one loop: the unit of each tile comes from a cumulative tile count kept in registers, the
online-softmax state and the query tile are reset at a unit's first tile, and a unit's rows are
stored (masked stores) at its last. So the pipeline prefetches the next unit's first tiles
while this unit finishes. Unmasked contig launches only (what the leaf launches are).

Per case (CUDA-graph replay, L2 flushed, as ``bench kernels``): the leaf launch alone as planned
and as ``_stream`` at ``U`` 1/2/4/8 and 2/3 stages; the whole plan serial on one stream as
planned and with the leaf launch streamed; the plan as the suite runs it (side streams). Outputs
are checked against the planned plan's.

Usage (H200)::

    python benchmarks/probe_stream.py --out benchmarks/results/h200_probe_stream.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import torch
import triton
import triton.language as tl

from treeattn import TreeAttention
from treeattn.bench.kernels import case_inputs
from treeattn.bench.timing import copy_bandwidth, graph_us, provenance, roofline_us
from treeattn.ops import merge_partials, partial_attention
from treeattn.workloads import tree_from_spec

LN2 = tl.constexpr(0.6931471805599453)
TREES = (
    "1,8,512_32,512,256", "1,8,512_512,512,256", "1,8,512_32,2048,256",
    "1,4,16,64,256,1024_256,8,256,64,32,256", "1024_256",
)
HEADS = ((32, 8), (64, 8))
SCALE = 0.088
VARIANTS = tuple((u, s) for u in (1, 2, 4, 8) for s in (2, 3))


@triton.jit
def _stream(Q, K, V, O_part, LSE_part, Out, kv_indices, work_kv_start, work_kv_end, work_row_indptr,
            row_q_indices, row_direct, work_start, work_end, qk_scale,
            stride_qn, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            stride_pn, stride_ph, stride_pln, stride_on, stride_oh,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            PAGE_SIZE: tl.constexpr, U: tl.constexpr, DIRECT: tl.constexpr):
    kv_head = tl.program_id(1)
    u_idx = tl.arange(0, U)
    units = work_start + tl.program_id(0) * U + u_idx
    u_valid = units < work_end
    starts = tl.load(work_kv_start + units, mask=u_valid, other=0)
    ends = tl.load(work_kv_end + units, mask=u_valid, other=0)
    # contig units: entry n of a unit is slot base + n
    bases = tl.load(kv_indices + starts, mask=u_valid, other=0).to(tl.int64) - starts
    rstart = tl.load(work_row_indptr + units, mask=u_valid, other=0)
    nrows_u = tl.load(work_row_indptr + units + 1, mask=u_valid, other=0) - rstart
    ntiles = tl.where(u_valid, (ends - starts + BLOCK_N - 1) // BLOCK_N, 0)
    cum = tl.cumsum(ntiles, 0)  # inclusive: unit u's tiles are [cum[u] - ntiles[u], cum[u])
    total = tl.sum(ntiles, 0)

    offs_m = tl.arange(0, BLOCK_M)
    q_local = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.zeros([BLOCK_M, HEAD_DIM], Q.dtype.element_ty)
    q_idx = tl.zeros([BLOCK_M], tl.int64)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for t in range(0, total):
        # this tile's unit, from the registers: no memory round trip between units
        u = tl.sum((cum <= t).to(tl.int32), 0)
        sel = u_idx == u
        end_t = tl.sum(tl.where(sel, cum, 0), 0)
        first_t = end_t - tl.sum(tl.where(sel, ntiles, 0), 0)
        n0 = tl.sum(tl.where(sel, starts, 0), 0) + (t - first_t) * BLOCK_N
        n_end = tl.sum(tl.where(sel, ends, 0), 0)
        base = tl.sum(tl.where(sel, bases, 0), 0)
        r0 = tl.sum(tl.where(sel, rstart, 0), 0)
        row_valid = q_local < tl.sum(tl.where(sel, nrows_u, 0), 0)
        # (row vectors: the interpreter takes no scalar masks)
        tv = tl.zeros([BLOCK_M], tl.int32) + t
        is_first = tv == first_t
        is_last = tv == end_t - 1
        # a unit's query tile, loaded at its first tile (masked off at the others)
        q_new = tl.load(row_q_indices + r0 + q_local, mask=row_valid & is_first, other=0).to(tl.int64)
        q_idx = tl.where(is_first, q_new, q_idx)
        q = tl.where(is_first[:, None], tl.load(Q + q_idx[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                                       mask=(row_valid & is_first)[:, None], other=0.0), q)
        m_i = tl.where(is_first, float("-inf"), m_i)
        l_i = tl.where(is_first, 0.0, l_i)
        acc = tl.where(is_first[:, None], 0.0, acc)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < n_end
        slot = base + offs_n
        page = slot // PAGE_SIZE
        in_page = slot % PAGE_SIZE
        k = tl.load(K + page[:, None] * stride_kp + in_page[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=n_valid[:, None], other=0.0)
        v = tl.load(V + page[:, None] * stride_vp + in_page[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=n_valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: a tile has a valid entry
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        # the unit's rows, at its last tile
        o = acc / l_i[:, None]
        lse = (m_i + tl.log2(l_i)) * LN2
        rows = (r0 + q_local).to(tl.int64)
        done = row_valid & is_last
        to_part = done
        if DIRECT:
            final = tl.load(row_direct + rows, mask=done, other=0) != 0
            to_part = done & ~final
            tl.store(Out + q_idx[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
                     o.to(Out.dtype.element_ty), mask=(done & final)[:, None])
        tl.store(O_part + rows[:, None] * stride_pn + head[:, None] * stride_ph + offs_d[None, :],
                 o.to(O_part.dtype.element_ty), mask=to_part[:, None])
        tl.store(LSE_part + rows * stride_pln + head, lse, mask=to_part)


def stream_launch(q, k, v, plan, launch, o_part, lse_part, out, units: int, stages: int) -> None:
    h = plan.heads
    n = launch.work_end - launch.work_start
    _stream[(triton.cdiv(n, units), h.num_kv_heads)](
        q, k, v, o_part, lse_part, out, plan.kv_indices, plan.work_kv_start, plan.work_kv_end, plan.work_row_indptr,
        plan.row_q_indices, plan.row_direct, launch.work_start, launch.work_end, SCALE * 1.4426950408889634,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o_part.stride(0), o_part.stride(1), lse_part.stride(0), out.stride(0), out.stride(1),
        GROUP=h.group, HEAD_DIM=h.head_dim, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        PAGE_SIZE=plan.page_size, U=units, DIRECT=plan.num_direct > 0, num_warps=launch.num_warps, num_stages=stages)


def probe_case(spec: str, hq: int, hkv: int, side_stream, bandwidth: float) -> dict | None:
    tree = tree_from_spec(spec)
    q, k, v, out = case_inputs(tree, hq, hkv)
    w = TreeAttention(device="cuda", streams=3)
    plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128)
    wh = plan.host
    leaf = [x for x in plan.launches if x.contig and not (plan.has_mask and x.masked) and x.block_m <= 32]
    if not leaf:
        return None
    leaf = max(leaf, key=lambda x: x.work_end - x.work_start)
    others = [x for x in plan.launches if x is not leaf]
    lengths = wh.work_kv_end[leaf.work_start:leaf.work_end] - wh.work_kv_start[leaf.work_start:leaf.work_end]
    o_part, lse_part = w.partial_buffers(plan)
    row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy, "roofline_us": roofline_us(tree.num_tokens, tree.num_queries, hq, hkv, 128, bandwidth),
           "leaf": dataclasses.asdict(leaf), "leaf_units": int(lengths.size), "leaf_tokens": int(lengths.sum()),
           "leaf_mean_tiles": float(np.mean(-(-lengths // leaf.block_n))), "us": {}, "err": {}}
    kv_bytes = int(lengths.sum()) * hkv * 128 * 2 * 2

    def part(x):
        partial_attention(q, k, v, dataclasses.replace(plan, launches=(x,)), o_part, lse_part, sm_scale=SCALE, out=out)

    def merge():
        if plan.merge_q_indices.numel():
            merge_partials(o_part, lse_part, plan.merge_q_indices, plan.merge_indptr, plan.merge_indices, out, None)

    def whole(leaf_fn, side: bool):
        main = torch.cuda.current_stream()
        if side:
            side_stream.wait_stream(main)
        for x in others:
            part(x)
        with torch.cuda.stream(side_stream if side else main):
            leaf_fn()
        if side:
            main.wait_stream(side_stream)
        merge()

    def check(name, fn):
        fn()
        torch.cuda.synchronize()
        row["err"][name] = float((out.float() - ref).abs().max())

    w.run(q, k, v, plan, out=out)
    torch.cuda.synchronize()
    ref = out.float().clone()
    row["us"]["planned"] = graph_us(lambda: w.run(q, k, v, plan, out=out))
    row["us"]["serial_planned"] = graph_us(lambda: whole(lambda: part(leaf), False))
    check("serial_planned", lambda: whole(lambda: part(leaf), False))
    row["us"]["leaf_planned"] = t = graph_us(lambda: part(leaf))
    row["leaf_planned_TBps"] = kv_bytes / t * 1e-6
    for units, stages in VARIANTS:
        name = f"u{units}s{stages}"
        fn = (lambda u=units, s=stages: stream_launch(q, k, v, plan, leaf, o_part, lse_part, out, u, s))
        check(name, lambda: whole(fn, False))
        row["us"]["leaf_" + name] = t = graph_us(fn)
        row[f"leaf_{name}_TBps"] = kv_bytes / t * 1e-6
        row["us"]["serial_" + name] = graph_us(lambda: whole(fn, False))
        row["us"]["side_" + name] = graph_us(lambda: whole(fn, True))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--trees", nargs="*", default=TREES)
    args = ap.parse_args()
    side = torch.cuda.Stream()
    bandwidth = copy_bandwidth()
    rows = []
    for spec in args.trees:
        for hq, hkv in HEADS:
            r = probe_case(spec, hq, hkv, side, bandwidth)
            if r is None:
                print(f"{spec} {hq}/{hkv}: no short contig launch", flush=True)
                continue
            rows.append(r)
            u = r["us"]
            best = min(VARIANTS, key=lambda x: u[f"leaf_u{x[0]}s{x[1]}"])
            b = f"u{best[0]}s{best[1]}"
            print(f"{spec[:40]:40s} {hq}/{hkv} {r['strategy']:8s} roof {r['roofline_us']:6.1f} planned {u['planned']:6.1f} "
                  f"| leaf {r['leaf_units']} units x {r['leaf_mean_tiles']:.1f} tiles: planned {u['leaf_planned']:6.1f} "
                  f"({r['leaf_planned_TBps']:.2f} TB/s) " + " ".join(
                      f"{n}={u['leaf_u%ds%d' % n_]:.1f}" for n, n_ in ((f'u{a}s{s}', (a, s)) for a, s in VARIANTS))
                  + f" | best {b}: serial {u['serial_planned']:.1f}->{u['serial_' + b]:.1f} side {u['side_' + b]:.1f}"
                  f" | err {max(r['err'].values()):.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "copy_bandwidth_TBps": bandwidth * 1e-12, "rows": rows}, f, indent=1, default=int)


if __name__ == "__main__":
    main()
