"""Triton kernels for token sampling (launcher and checks: :func:`treeattn.launchers.gumbel_argmax`).

One pass over a row's logits computes the Gumbel-max token ``argmax(x + G)`` of the scaled logits
``x = logits * scale`` with the counter-based noise of :func:`treeattn.engine.sampling.gumbel_noise`
(the same integer hash on uint32, the same float32 formula), and the online max / sum-exp of ``x``
from which any token's log-probability follows. Each row's vocabulary is split over several
programs (a few rows of 128K entries would otherwise occupy a few multiprocessors); each writes a
partial (best value, its index, max, sum-exp) and a second kernel combines a row's partials.

Ties go to the first index and a NaN counts as larger than any number, as in ``torch.argmax``.
"""
import triton
import triton.language as tl

_INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _mix32(x):
    """:func:`treeattn.engine.sampling._mix32` on uint32: products wrap modulo 2**32 and the right
    shifts are logical, as the int64 reference's masking makes them."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _first_max(y, idx):
    """``(value, index)`` of the first maximum of ``y`` (a NaN is above every number) among
    candidates ``idx`` (distinct; the smallest wins a tie)."""
    nan = y != y
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(nan, float("-inf"), y), axis=0)
    cand = tl.where(has_nan, nan, y == top)
    best = tl.min(tl.where(cand, idx, _INT32_MAX), axis=0)
    return tl.where(has_nan, float("nan"), top), best


# (the counter, the parts and their tiles vary with the step and the batch: not specialised on
# their values, every step and batch size runs the kernels compiled up front)
@triton.jit(do_not_specialize=["part_tiles", "num_parts", "counter"])
def _sample_partial_kernel(X, STREAMS, COUNTERS, SCALES, PART_Y, PART_I, PART_M, PART_S,
                           stride_row, stride_col, vocab, part_tiles, num_parts, counter, scale,
                           NOISE: tl.constexpr, ROW_COUNTER: tl.constexpr, ROW_SCALE: tl.constexpr,
                           STATS: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(row, part)`` reads entries ``[part * chunk, (part + 1) * chunk)`` of the row,
    ``chunk = part_tiles * BLOCK``.

    Each lane keeps its own first maximum of ``x + G`` and its own running max / sum-exp over the
    tiles (no cross-lane reduction inside the loop); the lanes are reduced once at the end.
    """
    row = tl.program_id(0)
    part = tl.program_id(1)
    chunk = part_tiles * BLOCK
    lo = part * chunk
    hi = tl.minimum(lo + chunk, vocab)
    if ROW_SCALE:
        s = tl.load(SCALES + row)
    else:
        s = scale
    if NOISE:
        if ROW_COUNTER:
            c = tl.load(COUNTERS + row).to(tl.uint32)
        else:
            # (passed as int32 so that every counter value runs the same compiled kernel)
            c = counter.to(tl.uint32, bitcast=True)
        base = _mix32(tl.load(STREAMS + row).to(tl.uint32) ^ c)
    offs = tl.arange(0, BLOCK)
    x_row = X + row.to(tl.int64) * stride_row
    best_y = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = lo + offs
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(lo, hi, BLOCK):
        idx = start + offs
        x = tl.load(x_row + idx.to(tl.int64) * stride_col, mask=idx < hi, other=float("-inf"))
        x = x.to(tl.float32) * s
        y = x
        if NOISE:
            h = _mix32(_mix32(base ^ (idx.to(tl.uint32) * 0x9E3779B1)))
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            y = x + -tl.log(-tl.log(u))
        # strictly greater: a lane keeps its first maximum; a NaN replaces any number once
        take = (y > best_y) | ((y != y) & (best_y == best_y))
        best_y = tl.where(take, y, best_y)
        best_i = tl.where(take, idx, best_i)
        if STATS:
            m_new = tl.maximum(m, x)
            # (an all -inf lane so far: shift by 0 rather than -inf - -inf = NaN)
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            acc = acc * tl.exp(m - ref) + tl.exp(x - ref)
            m = m_new
    y_max, i_max = _first_max(best_y, best_i)
    out = row * num_parts + part
    tl.store(PART_Y + out, y_max)
    tl.store(PART_I + out, i_max)
    if STATS:
        mm = tl.max(m, axis=0)
        ref = tl.where(mm == float("-inf"), 0.0, mm)
        tl.store(PART_M + out, mm)
        tl.store(PART_S + out, tl.sum(acc * tl.exp(m - ref), axis=0))


@triton.jit(do_not_specialize=["num_parts"])
def _sample_combine_kernel(PART_Y, PART_I, PART_M, PART_S, TOKENS, NORM, num_parts,
                           STATS: tl.constexpr, BLOCK_P: tl.constexpr):
    """Program ``row``: the row's token from its partials (the first maximum, parts in vocabulary
    order) and, with ``STATS``, ``NORM[row] = (max, log sum exp(x - max))``."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    mask = offs < num_parts
    src = row * num_parts + offs
    y = tl.load(PART_Y + src, mask=mask, other=float("-inf"))
    i = tl.load(PART_I + src, mask=mask, other=_INT32_MAX)
    _, token = _first_max(y, i)
    tl.store(TOKENS + row, token.to(tl.int64))
    if STATS:
        m = tl.load(PART_M + src, mask=mask, other=float("-inf"))
        s = tl.load(PART_S + src, mask=mask, other=0.0)
        mm = tl.max(m, axis=0)
        ref = tl.where(mm == float("-inf"), 0.0, mm)
        tl.store(NORM + 2 * row, mm)
        tl.store(NORM + 2 * row + 1, tl.log(tl.sum(s * tl.exp(m - ref), axis=0)))


@triton.jit
def _topk_partial_kernel(X, OUT_V, OUT_I, stride_row, vocab, num_chunks, K: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(row, chunk)``: the ``K`` largest of entries ``[chunk * BLOCK, (chunk + 1) * BLOCK)``
    of the row (in decreasing order, the first index winning a tie; -inf and index -1 past the
    row's end), written to ``OUT_V`` / ``OUT_I`` ``[rows, num_chunks * K]``. A row's ``K`` largest
    are among its chunks' (what :func:`treeattn.launchers.row_topk_candidates` relies on)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    live = idx < vocab
    x = tl.load(X + row * stride_row + idx, mask=live, other=float("-inf")).to(tl.float32)
    out = (row * num_chunks + chunk) * K
    # K passes of a block max: K <= 32 selections from a tile in registers
    for j in tl.static_range(K):
        top = tl.max(tl.where(live, x, float("-inf")), axis=0)
        at = tl.min(tl.where(live & (x == top), idx, _INT32_MAX), axis=0)
        tl.store(OUT_V + out + j, tl.where(at == _INT32_MAX, float("-inf"), top))
        tl.store(OUT_I + out + j, tl.where(at == _INT32_MAX, -1, at))
        live = live & (idx != at)
