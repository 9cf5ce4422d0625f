"""Probe: KV addresses (and the tree mask) from a unit's segment table in registers, against
per-entry slot (and mask) loads, for a lone program.

A gathered work unit (the union of several nodes' tokens, as `paths` tiles read) loads each
tile's slot indices before its K/V, and a masked one also loads three mask words an entry: a lone
program then costs 1.59 us a 64-token tile gathered and 1.3 us masked, against 0.97 us over one
run of slots (`h200_probe_pipeline.json`). But such a unit is a few runs (one per node, or per
page): with its segment table (entry start, slot base and node interval of each run, a few
dozen words) loaded once into registers, every entry's slot and mask words are arithmetic on
registers, and the loop's loads are affine as over one run. This measures that on a lone program
per KV head (``GROUP`` query rows, one node path of ``NSEG`` runs of scattered slots, CUDA-graph
replay, L2 flushed; the slope over 1024 -> 4096 entries is the cost of a tile):

* ``contig``: one run (slot = entry), the floor;
* ``gather``: slots loaded per entry (as the kernel's gathered loop);
* ``segment``: slots from the segment table; ``ahead``: the same, each tile's slots computed in
  the iteration before (a loop-carried value);
* ``gather_mask`` / ``segment_mask``: the same with the tree mask, its words loaded per entry or
  taken from the table (half the rows do not see the last run: their query's own node).

Usage (H200)::

    python benchmarks/probe_segments.py --out benchmarks/results/h200_probe_segments.json
"""
from __future__ import annotations

import argparse
import json
import re

import torch
import triton
import triton.language as tl

from treeattn.bench.timing import graph_us, provenance

LENGTHS = (1024, 4096)
NSEG = 8
MODES = ("contig", "gather", "segment", "ahead", "gather_mask", "segment_mask", "ahead_mask")


@triton.jit
def _seg_loop(Q, K, V, O, kv_indices, mask_lo, mask_hi, mask_pos, seg_start, seg_shift, seg_lo, seg_hi, seg_pos,
              n_tok, qk_scale, qpos, HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, MAXS: tl.constexpr, ADDR: tl.constexpr, MASKED: tl.constexpr):
    # ADDR: 0 contig, 1 per-entry slot loads, 2 segment table, 3 segment table one tile ahead
    h = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rows = offs_m < GROUP
    q = tl.load(Q + (h * GROUP + offs_m)[:, None] * D + offs_d[None, :], mask=rows[:, None], other=0.0)
    # the rows' queries sit in the last run's node: the first half sees all of it, the other half none
    row_prefix = tl.where(offs_m < GROUP // 2, 1 << 30, 0)
    s_idx = tl.arange(0, MAXS)
    starts = tl.load(seg_start + s_idx)          # padded with n_tok: never <= an entry
    shift = tl.load(seg_shift + s_idx)           # slot - entry within the run
    lo_s = tl.load(seg_lo + s_idx)
    hi_s = tl.load(seg_hi + s_idx)
    pos_s = tl.load(seg_pos + s_idx)             # position in its node of the run's first entry - its start
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    nxt = tl.arange(0, BN)
    nxt_slot = (nxt + tl.sum(tl.where((tl.sum((starts[None, :] <= nxt[:, None]).to(tl.int32), 1) - 1)[:, None]
                                      == s_idx[None, :], shift[None, :], 0), 1)).to(tl.int64)
    for n0 in range(0, n_tok, BN):
        n = n0 + tl.arange(0, BN)
        if ADDR == 3:
            # this tile's slots came from the last iteration (a loop-carried value, no arithmetic
            # between the loop's start and the loads); the next tile's are computed below
            slot = nxt_slot
            nn = n + BN
            nseg = tl.sum((starts[None, :] <= nn[:, None]).to(tl.int32), 1) - 1
            nxt_slot = (nn + tl.sum(tl.where(nseg[:, None] == s_idx[None, :], shift[None, :], 0), 1)).to(tl.int64)
        if ADDR >= 2:
            # the run of entry n is the last one starting at or before it (padding starts at n_tok)
            seg = tl.sum((starts[None, :] <= n[:, None]).to(tl.int32), 1) - 1
            pick = seg[:, None] == s_idx[None, :]
        if ADDR == 0:
            slot = n.to(tl.int64)
        elif ADDR == 1:
            slot = tl.load(kv_indices + n).to(tl.int64)
        elif ADDR == 2:
            slot = (n + tl.sum(tl.where(pick, shift[None, :], 0), 1)).to(tl.int64)
        k = tl.load(K + slot[:, None] * (HKV * D) + h * D + offs_d[None, :])
        v = tl.load(V + slot[:, None] * (HKV * D) + h * D + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            if ADDR >= 2:
                lo = tl.sum(tl.where(pick, lo_s[None, :], 0), 1)
                hi = tl.sum(tl.where(pick, hi_s[None, :], 0), 1)
                pos = n + tl.sum(tl.where(pick, pos_s[None, :], 0), 1)
            else:
                lo = tl.load(mask_lo + n)
                hi = tl.load(mask_hi + n)
                pos = tl.load(mask_pos + n)
            anc = (lo[None, :] <= qpos) & (qpos < hi[None, :])
            own = (lo[None, :] < qpos) | (pos[None, :] < row_prefix[:, None])
            s = tl.where(anc & own, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    tl.store(O + (h * GROUP + offs_m)[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=rows[:, None])


def unit(n_tok: int, hkv: int, device: str):
    """A unit of ``NSEG`` runs of ``n_tok / NSEG`` entries at scattered slots: the run ``i`` is node
    ``i`` of a path (pre-order interval ``[i, 2 * NSEG - i)``, the query's node the last)."""
    run = n_tok // NSEG
    g = torch.Generator().manual_seed(0)
    bases = torch.randperm(4 * NSEG, generator=g)[:NSEG] * run  # disjoint, out of order
    starts = torch.arange(NSEG) * run
    kv = (bases[:, None] + torch.arange(run)[None, :]).reshape(-1)
    seg_lo = torch.arange(NSEG)
    seg_hi = 2 * NSEG - torch.arange(NSEG)
    entry_seg = torch.arange(n_tok) // run
    entry_pos = torch.arange(n_tok) % run
    pad = lambda x, v: torch.cat((x, torch.full((16 - NSEG,), v, dtype=x.dtype)))  # noqa: E731
    i32 = dict(dtype=torch.int32, device=device)
    return {
        "kv_indices": kv.to(**i32), "mask_lo": seg_lo[entry_seg].to(**i32), "mask_hi": seg_hi[entry_seg].to(**i32),
        "mask_pos": entry_pos.to(**i32), "seg_start": pad(starts, n_tok).to(**i32),
        "seg_shift": pad(bases - starts, 0).to(**i32), "seg_lo": pad(seg_lo, 0).to(**i32),
        "seg_hi": pad(seg_hi, 0).to(**i32), "seg_pos": pad(-starts, 0).to(**i32),
        "slots": int(bases.max()) + run, "qpos": NSEG - 1,
    }


def reference(q, k, v, u, n_tok, masked: bool, group: int, hkv: int):
    kv = u["kv_indices"].long()
    kk = k[kv].float().view(n_tok, hkv, 128)
    vv = v[kv].float().view(n_tok, hkv, 128)
    out = torch.empty(hkv * group, 128, device=q.device)
    run = n_tok // NSEG
    for h in range(hkv):
        s = q[0, h * group:(h + 1) * group].float() @ kk[:, h].T * 128 ** -0.5
        if masked:  # rows in the second half see the last run's first half only (prefix 0 < pos)
            s[group // 2:, (NSEG - 1) * run:] = float("-inf")
        out[h * group:(h + 1) * group] = torch.softmax(s, -1) @ vv[:, h]
    return out


def pipeline(addr: int, masked: bool) -> dict:
    """The K/V buffers and async-wait depths of the loop as this GPU's Triton compiles it (GQA 4)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(_seg_loop.arg_names)
    const = dict(HKV=8, GROUP=4, D=128, BM=16, BN=64, MAXS=16, ADDR=addr, MASKED=masked)
    sig = {n: "constexpr" if n in const else "*fp16" if n in "QKVO" else "i32" if n in ("n_tok", "qpos")
           else "fp32" if n == "qk_scale" else "*i32" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    cap = torch.cuda.get_device_capability()
    c = triton.compile(ASTSource(_seg_loop, sig, {(names.index(k),): v for k, v in const.items()}, attrs),
                       target=GPUTarget("cuda", cap[0] * 10 + cap[1], 32), options=dict(num_warps=4, num_stages=3))
    ir = c.asm["ttgir"]
    return {"async_copies": ir.count("async_copy_global_to_local"),
            "kv_buffers": [int(a) for a, _ in re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x(\d+)x128x", ir)],
            "waits": [int(x) for x in re.findall(r"async_wait .*num = (\d+)", ir)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    compiled = {}
    for mode in MODES:
        addr = {"contig": 0, "gather": 1, "segment": 2, "ahead": 3}[mode.split("_")[0]]
        compiled[mode] = pipeline(addr, mode.endswith("_mask"))
        print("compiled", mode, compiled[mode], flush=True)
    rows = []
    for hq, hkv in ((32, 8), (64, 8)):
        group = hq // hkv
        t, err = {}, {}
        for n_tok in LENGTHS:
            u = unit(n_tok, hkv, "cuda")
            q = torch.randn(1, hq, 128, device="cuda", dtype=torch.float16)
            k = torch.randn(max(u["slots"], n_tok), hkv, 128, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            o = torch.empty(hq, 128, device="cuda", dtype=torch.float16)
            for mode in MODES:
                masked = mode.endswith("_mask")
                addr = {"contig": 0, "gather": 1, "segment": 2, "ahead": 3}[mode.split("_")[0]]

                def fn(addr=addr, masked=masked):
                    _seg_loop[(hkv,)](q, k, v, o, u["kv_indices"], u["mask_lo"], u["mask_hi"], u["mask_pos"],
                                      u["seg_start"], u["seg_shift"], u["seg_lo"], u["seg_hi"], u["seg_pos"], n_tok,
                                      128 ** -0.5 * 1.4426950408889634, u["qpos"], HKV=hkv, GROUP=group, D=128,
                                      BM=max(16, group), BN=64, MAXS=16, ADDR=addr, MASKED=masked,
                                      num_warps=4, num_stages=3)
                t[(mode, n_tok)] = graph_us(fn)
                fn()
                if addr:  # contig reads other slots than the unit's: nothing to compare
                    ref = reference(q, k, v, u, n_tok, masked, group, hkv)
                    err[mode] = max(err.get(mode, 0.0), float((o.float() - ref).norm() / ref.norm()))
        row = {"hq": hq, "hkv": hkv, "us": {m: {n: t[(m, n)] for n in LENGTHS} for m in MODES}, "err": err,
               "us_per_tile": {m: (t[(m, LENGTHS[1])] - t[(m, LENGTHS[0])]) / ((LENGTHS[1] - LENGTHS[0]) / 64)
                               for m in MODES}}
        rows.append(row)
        for m in MODES:
            print(f"{hq}/{hkv} {m:13s} " + " ".join(f"{n}:{t[(m, n)]:.1f}" for n in LENGTHS)
                  + f" us; {row['us_per_tile'][m]:.2f} us a tile; err {err.get(m, 0):.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "nseg": NSEG, "compiled": compiled, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
