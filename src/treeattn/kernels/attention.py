"""Triton kernels: partial attention over work items, and the merge of partial states.

Layouts (validated by the launchers in :mod:`treeattn.ops`):
  q        [Q, Hq, D]                          (last dim contiguous)
  k, v     [num_pages, page_size, Hkv, D]      (last dim contiguous; any other strides)
  o_part   [R, Hq, D] fp32, lse_part [R, Hq] fp32 (natural log)
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tree_partial_attention_kernel(
    Q, K, V, O_part, LSE_part, Out, LSE_out, counters,
    kv_indices, work_kv_start, work_kv_end, work_row_indptr, row_q_indices,
    merge_indptr, merge_indices,
    mask_lo, mask_hi, mask_pos, query_pos, query_prefix,
    work_offset, qk_scale, num_qo_heads,
    stride_qn, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_on, stride_oh, stride_ln,
    stride_outn, stride_outh, stride_lse_outn,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    FUSE_MERGE: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """One program = one query tile of one work item, for one KV head.

    The tile's rows are (query, head-in-group) pairs, so the GQA heads sharing a KV head share
    every K/V tile this program loads: each KV byte is read once per work item.

    With ``FUSE_MERGE`` the merge happens in this launch: a query with a single partial row is
    written straight to ``Out``; otherwise each row's partial state is stored and counted in
    ``counters[query, head]`` (int32, zero before the run), and the program that stores the last
    partial row of a (query, head) merges all of them (in merge-map order, so the result does not
    depend on which program merges) and sets the counter back to zero for the next run.
    """
    work = tl.program_id(0) + work_offset
    kv_head = tl.program_id(1)
    kv_start = tl.load(work_kv_start + work)
    kv_end = tl.load(work_kv_end + work)
    row_start = tl.load(work_row_indptr + work)
    num_rows = tl.load(work_row_indptr + work + 1) - row_start

    offs_m = tl.arange(0, BLOCK_M)
    q_local = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = q_local < num_rows
    q_idx = tl.load(row_q_indices + row_start + q_local, mask=row_valid, other=0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q = tl.load(Q + q_idx[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        # Triton's CPU interpreter computes bf16 dots wrongly; it runs them in fp32 instead
        q = q.to(tl.float32)
    if HAS_MASK:
        qpos = tl.load(query_pos + q_idx, mask=row_valid, other=-1)
        qprefix = tl.load(query_prefix + q_idx, mask=row_valid, other=0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        # int64: page * stride overflows int32 on pools over 2 GiB
        slot = tl.load(kv_indices + offs_n, mask=n_valid, other=0).to(tl.int64)
        # paged gather: PAGE_SIZE is a power-of-two constexpr, so these are shifts and masks
        page = slot // PAGE_SIZE
        in_page = slot % PAGE_SIZE
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(K + page[:, None] * stride_kp + in_page[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + page[:, None] * stride_vp + in_page[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # log2 domain
        visible = n_valid[None, :]
        if HAS_MASK:
            lo = tl.load(mask_lo + offs_n, mask=n_valid, other=0)
            hi = tl.load(mask_hi + offs_n, mask=n_valid, other=0)
            pos = tl.load(mask_pos + offs_n, mask=n_valid, other=0)
            # ancestor test on pre-order numbers: token's node is an ancestor-or-self of the
            # query's node, and within the query's own node only its first `prefix` tokens
            anc = (lo[None, :] <= qpos[:, None]) & (qpos[:, None] < hi[None, :])
            own_ok = (lo[None, :] < qpos[:, None]) | (pos[None, :] < qprefix[:, None])
            visible = visible & anc & own_ok
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows that have seen nothing yet keep m = -inf; subtract 0 instead to avoid inf - inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    rows = (row_start + q_local).to(tl.int64)
    if FUSE_MERGE:
        n_parts = (tl.load(merge_indptr + q_idx + 1, mask=row_valid, other=1)
                   - tl.load(merge_indptr + q_idx, mask=row_valid, other=0))
        single = row_valid & (n_parts == 1)
        tl.store(Out + q_idx[:, None] * stride_outn + head[:, None] * stride_outh + offs_d[None, :],
                 o.to(Out.dtype.element_ty), mask=single[:, None] & d_valid[None, :])
        if WRITE_LSE:
            tl.store(LSE_out + q_idx * stride_lse_outn + head, lse, mask=single)
        shared = row_valid & (n_parts > 1)
        tl.store(O_part + rows[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :], o,
                 mask=shared[:, None] & d_valid[None, :])
        tl.store(LSE_part + rows * stride_ln + head, lse, mask=shared)
        # every thread's partial stores happen before any thread's release (the atomic), and the
        # acquiring threads' view is shared with the threads that load below (CUTLASS's
        # semaphore pattern: barrier, atomic acq_rel, barrier)
        tl.debug_barrier()
        count = counters + q_idx * num_qo_heads + head
        arrived = tl.atomic_add(count, 1, mask=shared, sem="acq_rel")
        last = shared & (arrived == n_parts - 1)
        tl.debug_barrier()
        if tl.max(last.to(tl.int32), 0) > 0:
            _merge_rows(O_part, LSE_part, Out, LSE_out, merge_indptr, merge_indices, q_idx, head,
                        last, n_parts, offs_d, d_valid, stride_on, stride_oh, stride_ln,
                        stride_outn, stride_outh, stride_lse_outn, BLOCK_M, BLOCK_D, WRITE_LSE)
            tl.store(count, 0, mask=last)
    else:
        tl.store(O_part + rows[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :], o,
                 mask=row_valid[:, None] & d_valid[None, :])
        tl.store(LSE_part + rows * stride_ln + head, lse, mask=row_valid)


@triton.jit
def _merge_rows(O_part, LSE_part, Out, LSE_out, merge_indptr, merge_indices, q_idx, head, active,
                n_parts, offs_d, d_valid, stride_on, stride_oh, stride_ln,
                stride_outn, stride_outh, stride_lse_outn,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Log-sum-exp merge of the partial rows of the ``active`` (query, head) rows of a tile,
    walking each query's partial rows in merge-map order."""
    first = tl.load(merge_indptr + q_idx, mask=active, other=0)
    steps = tl.max(tl.where(active, n_parts, 0), 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(0, steps):
        ok = active & (j < n_parts)
        r = tl.load(merge_indices + first + j, mask=ok, other=0).to(tl.int64)
        lse = tl.load(LSE_part + r * stride_ln + head, mask=ok, other=float("-inf"))
        o = tl.load(O_part + r[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
                    mask=ok[:, None] & d_valid[None, :], other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale_old = tl.exp2((m - m_safe) * LOG2E)
        w = tl.exp2((lse - m_safe) * LOG2E)
        den = den * scale_old + w
        acc = acc * scale_old[:, None] + w[:, None] * o
        m = m_new
    has = den > 0.0
    out = acc / tl.where(has, den, 1.0)[:, None]
    tl.store(Out + q_idx[:, None] * stride_outn + head[:, None] * stride_outh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=active[:, None] & d_valid[None, :])
    if WRITE_LSE:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        lse_out = tl.where(has, m_safe + tl.log2(tl.where(has, den, 1.0)) * LN2, float("-inf"))
        tl.store(LSE_out + q_idx * stride_lse_outn + head, lse_out, mask=active)


@triton.jit
def _merge_states_kernel(
    O_part, LSE_part, Out, LSE_out, merge_indptr, merge_indices,
    num_heads,
    stride_pn, stride_ph, stride_pln,
    stride_on, stride_oh, stride_ln,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """One program = one output row (query) x BLOCK_H heads: log-sum-exp merge of its partial
    states, in the order of the merge map (deterministic); a query without partial rows gets
    ``o = 0``, ``lse = -inf``."""
    q_idx = tl.zeros([BLOCK_H], tl.int64) + tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    n_parts = tl.load(merge_indptr + q_idx + 1) - tl.load(merge_indptr + q_idx)
    _merge_rows(O_part, LSE_part, Out, LSE_out, merge_indptr, merge_indices, q_idx, offs_h,
                offs_h < num_heads, n_parts, offs_d, offs_d < HEAD_DIM, stride_pn, stride_ph,
                stride_pln, stride_on, stride_oh, stride_ln, BLOCK_H, BLOCK_D, WRITE_LSE)
