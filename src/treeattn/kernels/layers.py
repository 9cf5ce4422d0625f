"""Triton kernels for the non-attention part of a decoder layer (launchers, shapes and checks in
:mod:`treeattn.engine.fused`).

A decode step of a few tokens is latency-bound: every separate elementwise kernel costs a few
microseconds even inside a CUDA graph, so each kernel below replaces a chain of PyTorch ops with
one launch. They reproduce the PyTorch reference's roundings (every intermediate that PyTorch
materialises in the model dtype is rounded to it here as well), so fused and unfused results agree
to the last bit up to reduction order.
"""
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, R, H_OUT, Y, W, stride_x, stride_r, stride_h, stride_y, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program = one row: ``y = w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``, optionally after
    ``x = x + r`` (stored to ``H_OUT``)."""
    # int64 row offsets: n * stride can exceed 2^31 for long prefills
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # the residual sum is rounded to the model dtype before the norm, as `h = h + delta` is
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(H_OUT + row * stride_h + offs, x, mask=mask)
    xf = x.to(tl.float32)
    # fp32 statistics (masked lanes are 0, so they add nothing to the sum)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    # transformers casts the normalised x back to the input dtype *before* the weight product
    xn = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (w * xn).to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["layer"])  # (one compiled variant for every layer)
def _rope_kv_kernel(QKV, COS, SIN, POS, SLOTS, Q_OUT, KC, VC, LAYER_OUT, layer,
                    stride_qkv, stride_cos, stride_sin, stride_qo_n, stride_qo_h,
                    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
                    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, WRITE_LAYER: tl.constexpr):
    """One program = one head of one token of the fused q/k/v projection ``[n, (Hq + 2 Hkv) D]``.

    Heads ``[0, Hq)`` are query heads (rotated into ``Q_OUT``), ``[Hq, Hq + Hkv)`` key heads
    (rotated into the cache at the token's slot, and back into ``QKV`` so that the caller's ``k``
    view is the rotated key), the rest value heads (copied into the cache). ``WRITE_LAYER``:
    program ``(0, 0)`` also stores ``layer`` into ``LAYER_OUT`` (int32 [1]), the layer counter that
    the attention graph's kernels read (a store here saves a launch of its own every layer).
    """
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if WRITE_LAYER:
        if row == 0 and head == 0:
            tl.store(LAYER_OUT, layer)
    dt = QKV.dtype.element_ty
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    # rotate-half layout: the two halves of a head are rotated against each other, so each program
    # loads both halves before it stores anything (the in-place key store is then race-free)
    src = QKV + row * stride_qkv + head * HEAD_DIM
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        pos = tl.load(POS + row).to(tl.int64)
        c1 = tl.load(COS + pos * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(COS + pos * stride_cos + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + pos * stride_sin + offs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + pos * stride_sin + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        # x * cos + rotate_half(x) * sin with each product and the sum rounded to the model dtype,
        # like the three separate PyTorch ops of apply_rope
        o1 = ((x1f * c1).to(dt).to(tl.float32) + (-x2f * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)).to(dt)
        if head < NUM_Q_HEADS:
            dst = Q_OUT + row * stride_qo_n + head * stride_qo_h
            tl.store(dst + offs, o1, mask=mask)
            tl.store(dst + HALF + offs, o2, mask=mask)
        else:
            slot = tl.load(SLOTS + row).to(tl.int64)
            dst = KC + slot * stride_kc_s + (head - NUM_Q_HEADS) * stride_kc_h
            tl.store(dst + offs, o1, mask=mask)
            tl.store(dst + HALF + offs, o2, mask=mask)
            tl.store(src + offs, o1, mask=mask)
            tl.store(src + HALF + offs, o2, mask=mask)
    else:
        slot = tl.load(SLOTS + row).to(tl.int64)
        dst = VC + slot * stride_vc_s + (head - NUM_Q_HEADS - NUM_KV_HEADS) * stride_vc_h
        tl.store(dst + offs, x1, mask=mask)
        tl.store(dst + HALF + offs, x2, mask=mask)


@triton.jit
def _swiglu_kernel(GU, OUT, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr):
    """Program ``(row, block)``: ``out = silu(gate) * up`` for ``gate, up = GU[row].chunk(2)``."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(GU + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    # silu in fp32 (PyTorch's formula), rounded to the model dtype before the product as
    # F.silu(gate) * up rounds it
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(OUT + row * stride_out + offs, (s * u).to(dt), mask=mask)


@triton.jit
def _copy_slots_kernel(KV, SRC, DST, n_planes, row, stride_plane, stride_slot, BLOCK: tl.constexpr,
                       PLANES: tl.constexpr):
    """One program = one ``(src, dst)`` pair x ``PLANES`` planes of the ``[planes, slots, row]``
    cache view (planes: every layer's K and V; a slot's ``row`` elements contiguous): copies slot
    ``src``'s elements to slot ``dst``. A pair whose source is its destination moves nothing: beam
    search keeps most beams in their leaves, and the host cannot drop those pairs without waiting
    for the device's selection."""
    src = tl.load(SRC + tl.program_id(0)).to(tl.int64)
    dst = tl.load(DST + tl.program_id(0)).to(tl.int64)
    if src != dst:
        plane = tl.program_id(1) * PLANES + tl.arange(0, PLANES)
        offs = tl.arange(0, BLOCK)
        mask = (plane < n_planes)[:, None] & (offs < row)[None, :]
        base = plane.to(tl.int64)[:, None] * stride_plane + offs[None, :]
        rows = tl.load(KV + base + src * stride_slot, mask=mask)
        tl.store(KV + base + dst * stride_slot, rows, mask=mask)
