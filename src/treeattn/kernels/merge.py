"""Triton kernels: the log-sum-exp merge of a query's partial states (rows written by
:mod:`treeattn.kernels.attention`), one row after another or a tile of rows at once.

Layouts (validated by :func:`treeattn.launchers.merge_partials`):
  o_part   [R, Hq, D] fp32 or 16-bit, lse_part [R, Hq] fp32 (natural log)
  out      [Q, Hq, D], lse_out [Q, Hq] fp32 (natural log)
"""
import triton
import triton.language as tl

from treeattn.kernels.state import LN2, LOG2E, _fold_state


@triton.jit
def _store_merged(Out, LSE_out, n, offs_h, offs_d, h_valid, hd_mask, m, den, acc, stride_on, stride_oh,
                  stride_ln, WRITE_LSE: tl.constexpr):
    """Store a merged state (running max ``m``, denominator ``den``, numerator ``acc``) as query
    ``n``'s output rows (0 and an LSE of -inf for heads that saw nothing)."""
    has = den > 0.0
    out = acc * (1.0 / tl.where(has, den, 1.0))[:, None]  # (a reciprocal a head, not a division an element)
    tl.store(Out + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=hd_mask)
    if WRITE_LSE:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        lse_out = tl.where(has, m_safe + tl.log2(tl.where(has, den, 1.0)) * LN2, float("-inf"))
        tl.store(LSE_out + n * stride_ln + offs_h, lse_out, mask=h_valid)


@triton.jit
def _merge_states_kernel(
    O_part, LSE_part, Out, LSE_out, merge_q_indices, merge_indptr, merge_indices,
    num_heads,
    stride_pn, stride_ph, stride_pln,
    stride_on, stride_oh, stride_ln,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    WRITE_LSE: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program = one output row (query ``merge_q_indices[program]``) x BLOCK_H heads:
    log-sum-exp merge of its partial states, in the order of the merge map (deterministic).

    With ``PDL`` (a programmatic dependent launch after the attention launches), it reads its
    part of the merge map while they finish and waits for them before reading their rows."""
    n = tl.load(merge_q_indices + tl.program_id(0)).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_valid = offs_h < num_heads
    hd_mask = h_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    start = tl.load(merge_indptr + n)
    end = tl.load(merge_indptr + n + 1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for i in range(start, end):
        r = tl.load(merge_indices + i).to(tl.int64)
        lse = tl.load(LSE_part + r * stride_pln + offs_h, mask=h_valid, other=float("-inf"))
        o = tl.load(O_part + r * stride_pn + offs_h[:, None] * stride_ph + offs_d[None, :],
                    mask=hd_mask, other=0.0).to(tl.float32)
        m, den, acc = _fold_state(m, den, acc, lse, o, TO_LOG2=LOG2E)
    _store_merged(Out, LSE_out, n, offs_h, offs_d, h_valid, hd_mask, m, den, acc, stride_on, stride_oh, stride_ln,
                  WRITE_LSE=WRITE_LSE)


@triton.jit
def _load_row_block(O_part, LSE_part, rows, r_valid, offs_h, offs_d, h_valid, hd_mask, stride_pn, stride_ph,
                    stride_pln):
    """The LSEs ``[R, H]`` (-inf where invalid) and outputs ``[R, H, D]`` (0) of partial rows
    ``rows`` (valid where ``r_valid``)."""
    rh = r_valid[:, None] & h_valid[None, :]
    lse = tl.load(LSE_part + rows[:, None] * stride_pln + offs_h[None, :], mask=rh, other=float("-inf"))
    o = tl.load(O_part + rows[:, None, None] * stride_pn + offs_h[None, :, None] * stride_ph
                + offs_d[None, None, :], mask=rh[:, :, None] & hd_mask[None, :, :], other=0.0)
    return lse, o


@triton.jit
def _merge_tile_kernel(
    O_part, LSE_part, Out, LSE_out, merge_q_indices, merge_indptr, merge_indices,
    num_heads,
    stride_pn, stride_ph, stride_pln,
    stride_on, stride_oh, stride_ln,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    WRITE_LSE: tl.constexpr, PDL: tl.constexpr = False,
):
    """:func:`_merge_states_kernel` for queries of few, many-row merges: BLOCK_R rows at a time,
    each block one ``[BLOCK_R, BLOCK_H, D]`` load (deterministic).

    The merge map is the plan's, not the attention launches' output, so the first block's row
    indices are read before the PDL wait, and after it a query whose rows fit one block is one
    round trip of loads. The row loop puts two dependent round trips a row on that path
    (merges of 5-18 rows a query 1.4x faster or more, median 1.9x, measured on an H100)."""
    n = tl.load(merge_q_indices + tl.program_id(0)).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_R)
    h_valid = offs_h < num_heads
    hd_mask = h_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    start = tl.load(merge_indptr + n)
    end = tl.load(merge_indptr + n + 1)
    rows = tl.load(merge_indices + start + offs_r, mask=offs_r < end - start, other=0).to(tl.int64)
    if PDL:
        tl.extra.cuda.gdc_wait()
    lse, o = _load_row_block(O_part, LSE_part, rows, offs_r < end - start, offs_h, offs_d, h_valid, hd_mask,
                             stride_pn, stride_ph, stride_pln)
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2((lse - m_safe[None, :]) * LOG2E)
    den = tl.sum(w, 0)
    acc = tl.sum(w[:, :, None] * o.to(tl.float32), 0)
    # queries of more rows than a block (the row tile is sized for the plan's longest merge, up
    # to a register budget): the next blocks, merged online
    for r0 in range(start + BLOCK_R, end, BLOCK_R):
        rows = tl.load(merge_indices + r0 + offs_r, mask=offs_r < end - r0, other=0).to(tl.int64)
        lse, o = _load_row_block(O_part, LSE_part, rows, offs_r < end - r0, offs_h, offs_d, h_valid, hd_mask,
                                 stride_pn, stride_ph, stride_pln)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale_old = tl.exp2((m - m_safe) * LOG2E)
        w = tl.exp2((lse - m_safe[None, :]) * LOG2E)
        den = den * scale_old + tl.sum(w, 0)
        acc = acc * scale_old[:, None] + tl.sum(w[:, :, None] * o.to(tl.float32), 0)
        m = m_new
    _store_merged(Out, LSE_out, n, offs_h, offs_d, h_valid, hd_mask, m, den, acc, stride_on, stride_oh, stride_ln,
                  WRITE_LSE=WRITE_LSE)
