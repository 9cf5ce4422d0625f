"""Triton kernels for Tree Attention's cross-rank combine (see treeattn.distributed.combine):
pack each row's numerator o * exp(lse - m) and denominator exp(lse - m) into one fp32 buffer for a
single all-reduce, and unpack num / den afterwards."""
import triton
import triton.language as tl


@triton.jit
def _pack_kernel(o_ptr, lse_ptr, m_ptr, buf_ptr, D, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    lse = tl.load(lse_ptr + row)
    m = tl.maximum(tl.load(m_ptr + row), -3.0e38)  # m = -inf only if no rank has KV
    w = tl.exp(lse - m)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    o = tl.load(o_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(buf_ptr + row * (D + 1) + offs, o * w, mask=mask)
    tl.store(buf_ptr + row * (D + 1) + D, w)


@triton.jit
def _unpack_kernel(buf_ptr, out_ptr, D, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    den = tl.maximum(tl.load(buf_ptr + row * (D + 1) + D), 1.0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    num = tl.load(buf_ptr + row * (D + 1) + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * D + offs, (num / den).to(out_ptr.dtype.element_ty), mask=mask)
