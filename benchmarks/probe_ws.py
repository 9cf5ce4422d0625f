"""Probe: Hopper warp specialization (Triton's ``tl.range(..., warp_specialize=True)``, the
automatic producer / consumer split of Meta's Hopper pass) on the tall tile that bounds the
>= 100K-token GQA trees, before touching the real kernel.

Session 31 (ncu) found those plans cost the sum of a compute-bound tall launch (~400 TFLOP/s on
the H100) and an HBM-bound leaf launch. The tall launch's best config since session 19 is TMA
loads, 128-row x 128-token tiles, 8 warps, 3 stages (``probe_tma.py``). Prediction: a
warp-specialized loop (one warpgroup issuing TMA loads, the others the MMAs and softmax) lifts
its MMA rate by 10-20%, as the Triton fused-attention tutorial reports for Hopper. Each variant is
a simplified copy of the kernel's unmasked whole-tile step (no tree mask, no merge), checked
against torch and timed with ``triton.testing.do_bench`` (median).

Usage (H100 / H200)::

    python benchmarks/probe_ws.py --out benchmarks/results/h100_probe_ws.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from probe_tma import inputs, rel_err


@triton.jit
def _tall_ws(Q, K, V, O, kd, vd, n_tok, total_tok, qk_scale,
             HKV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             ON_DEVICE: tl.constexpr, WS: tl.constexpr):
    tiles: tl.constexpr = ROWS // BM
    item = tl.program_id(0) // tiles
    tile = tl.program_id(0) % tiles
    h = tl.program_id(1)
    offs_m = tile * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    qrow = ((item * HKV + h) * ROWS + offs_m).to(tl.int64)
    q = tl.load(Q + qrow[:, None] * D + offs_d[None, :])
    if ON_DEVICE:
        # (Hopper's automatic warp specialization partitions data only with in-kernel descriptors)
        kd = tl.make_tensor_descriptor(K, shape=[total_tok, HKV * D], strides=[HKV * D, 1], block_shape=[BN, D])
        vd = tl.make_tensor_descriptor(V, shape=[total_tok, HKV * D], strides=[HKV * D, 1], block_shape=[BN, D])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    base = item * n_tok
    for n0 in tl.range(0, n_tok, BN, warp_specialize=WS):
        k = kd.load([base + n0, h * D])
        v = vd.load([base + n0, h * D])
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(O + qrow[:, None] * D + offs_d[None, :], o.to(O.dtype.element_ty))


def run(case, bm, bn, warps, stages, on_device, ws):
    items, n_tok, rows, hkv, d = case
    q, k, v, o = inputs(case)
    kd = vd = None
    if not on_device:
        kd = TensorDescriptor(k.view(items * n_tok, hkv * d), [items * n_tok, hkv * d], [hkv * d, 1], [bn, d])
        vd = TensorDescriptor(v.view(items * n_tok, hkv * d), [items * n_tok, hkv * d], [hkv * d, 1], [bn, d])
    scale = d ** -0.5 * 1.4426950408889634
    grid = (items * (rows // bm), hkv)

    def fn():
        _tall_ws[grid](q, k, v, o, kd, vd, n_tok, items * n_tok, scale, HKV=hkv, D=d, ROWS=rows, BM=bm, BN=bn,
                       ON_DEVICE=on_device, WS=ws, num_warps=warps, num_stages=stages)
    fn()
    err = rel_err(case, q, k, v, o)
    us = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median") * 1e3
    flops = 4 * items * hkv * rows * n_tok * d
    return {"us": us, "tflops": flops / us / 1e6, "err": err}


CASES = {
    # 8 shared 2048-token nodes x 64 queries x GQA 8 (the 64/8 tall launch of 1,8,512_32,2048,256)
    "tall_64_8": (8, 2048, 512, 8, 128),
    # 1,1024_2048 root at 32/8: one 2048-token item, 1024 queries x 4 heads
    "root_32_8": (1, 2048, 4096, 8, 128),
}
#: (block_m, block_n, warps, stages, descriptors in the kernel, warp specialized); the first is
#: the kernel's tall TMA config today
CONFIGS = [(128, 128, 8, 3, False, False), (128, 128, 8, 3, True, False), (128, 128, 4, 3, True, True),
           (128, 128, 8, 3, True, True), (128, 128, 4, 2, True, True), (128, 64, 4, 3, True, True),
           (128, 128, 4, 3, False, True), (256, 128, 8, 2, True, True), (128, 64, 8, 3, True, True)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "rows": []}
    for name, case in CASES.items():
        for cfg in CONFIGS:
            try:
                r = run(case, *cfg)
            except Exception as e:  # a config the compiler rejects
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            r.update(case=name, config=list(cfg))
            res["rows"].append(r)
            print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
