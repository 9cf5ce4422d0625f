"""Probe: TMA (tensor-descriptor) loads of K/V against pointer loads, on standalone tall and
short attention tiles over affine (contig) KV, before touching the real kernel.

Tall launches over long shared prefixes run at 330-370 TFLOP/s (NOTES.md, session 13) and bound
the >= 100K-token GQA trees; the 128 x 32 / 4-warp / 3-stage config won with pointer loads
(probe_tall.py). TMA loads free the threads from address arithmetic and land K/V in shared
memory where wgmma reads them, so wider KV tiles and 8 warps may pay. Each variant is a
simplified copy of the kernel's unmasked FULL step (no tree mask, no merge), checked against
torch and timed with ``triton.testing.do_bench`` (median).

Usage (H200)::

    python benchmarks/probe_tma.py --out benchmarks/results/h200_probe_tma.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _tall(Q, K, V, O, kd, vd, n_tok, qk_scale,
          HKV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, TMA: tl.constexpr):
    tiles: tl.constexpr = ROWS // BM
    item = tl.program_id(0) // tiles
    tile = tl.program_id(0) % tiles
    h = tl.program_id(1)
    offs_m = tile * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    qrow = ((item * HKV + h) * ROWS + offs_m).to(tl.int64)
    q = tl.load(Q + qrow[:, None] * D + offs_d[None, :])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    base = item * n_tok
    for n0 in range(0, n_tok, BN):
        if TMA:
            k = kd.load([base + n0, h * D])
            v = vd.load([base + n0, h * D])
        else:
            offs_n = (base + n0 + tl.arange(0, BN)).to(tl.int64)
            k = tl.load(K + offs_n[:, None] * (HKV * D) + h * D + offs_d[None, :])
            v = tl.load(V + offs_n[:, None] * (HKV * D) + h * D + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(O + qrow[:, None] * D + offs_d[None, :], o.to(O.dtype.element_ty))


def inputs(case) -> tuple:
    """``(q, k, v, o)`` of a case: queries [items, hkv, rows, d], K and V [items * n_tok, hkv, d]."""
    items, n_tok, rows, hkv, d = case
    torch.manual_seed(0)
    q = torch.randn(items, hkv, rows, d, device="cuda", dtype=torch.float16)
    k = torch.randn(items * n_tok, hkv, d, device="cuda", dtype=torch.float16)
    return q, k, torch.randn_like(k), torch.empty_like(q)


def rel_err(case, q, k, v, o) -> float:
    """Relative L2 error of ``o`` against attention in float32 (each item's queries over its KV)."""
    items, n_tok, rows, hkv, d = case
    kk = k.view(items, n_tok, hkv, d).permute(0, 2, 1, 3).float()
    vv = v.view(items, n_tok, hkv, d).permute(0, 2, 1, 3).float()
    ref = torch.softmax(q.float() @ kk.transpose(-1, -2) * d ** -0.5, -1) @ vv
    return float((o.float() - ref).norm() / ref.norm())


def run(case, bm, bn, warps, stages, tma, check):
    items, n_tok, rows, hkv, d = case
    q, k, v, o = inputs(case)
    kd = TensorDescriptor(k.view(items * n_tok, hkv * d), [items * n_tok, hkv * d], [hkv * d, 1], [bn, d])
    vd = TensorDescriptor(v.view(items * n_tok, hkv * d), [items * n_tok, hkv * d], [hkv * d, 1], [bn, d])
    scale = d ** -0.5 * 1.4426950408889634
    grid = (items * (rows // bm), hkv)

    def fn():
        _tall[grid](q, k, v, o, kd if tma else None, vd if tma else None, n_tok, scale, HKV=hkv, D=d,
                    ROWS=rows, BM=bm, BN=bn, TMA=tma, num_warps=warps, num_stages=stages)
    fn()
    err = None
    if check:
        err = rel_err(case, q, k, v, o)
    us = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median") * 1e3
    flops = 4 * items * hkv * rows * n_tok * d
    bytes_ = 2 * items * n_tok * hkv * d * 2
    return {"us": us, "tflops": flops / us / 1e6, "tbps": bytes_ / us / 1e6, "err": err}


CASES = {
    # 8 shared 2048-token nodes x 64 queries x GQA 8 (the 64/8 tall launch of 1,8,512_32,2048,256)
    "tall_64_8": (8, 2048, 512, 8, 128),
    # GQA 4 of the same
    "tall_32_8": (8, 2048, 256, 8, 128),
    # 1,1024_2048 root at 32/8: one 2048-token item, 1024 queries x 4 heads
    "root_32_8": (1, 2048, 4096, 8, 128),
    # 512 private 256-token leaves, GQA 8 (memory-bound)
    "leaves_64_8": (512, 256, 16, 8, 128),
}
CONFIGS = [(128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
           (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (256, 64, 8, 2), (256, 64, 8, 3)]
SHORT = [(16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 2), (16, 128, 4, 3), (16, 64, 2, 3), (16, 32, 4, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "rows": []}
    for name, case in CASES.items():
        for cfg in (SHORT if case[2] <= 16 else CONFIGS):
            for tma in (False, True):
                try:
                    r = run(case, *cfg, tma, check=True)
                except Exception as e:  # a config the compiler rejects (shared memory)
                    r = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                r.update(case=name, config=list(cfg), tma=tma)
                res["rows"].append(r)
                print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
