"""Triton kernels: partial attention over work items (the merge of partial states is in
:mod:`treeattn.kernels.merge`).

Layouts (validated by the launchers in :mod:`treeattn.launchers`):
  q        [Q, Hq, D]                          (last dim contiguous)
  k, v     [num_pages, page_size, Hkv, D]      (last dim contiguous; any other strides)
  o_part   [R, Hq, D] fp32 or q's 16-bit dtype, lse_part [R, Hq] fp32 (natural log)
  out      [Q, Hq, D] in q's dtype, lse_out [Q, Hq] fp32 (natural log)
"""
import triton
import triton.language as tl

from treeattn.kernels.state import LN2, LOG2E, _fold_state


@triton.jit
def _index(x, WIDE: tl.constexpr):
    """``x`` as the kernel's element offsets: int64 with ``WIDE`` (some tensor spans 2^31
    elements or more), else int32, which takes about half the address instructions (int64 adds
    and multiplies were most of a small tile's integer work, measured on an H200)."""
    if WIDE:
        return x.to(tl.int64)
    else:
        return x.to(tl.int32)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, n0, kv_end, kv_indices, K, V, K_desc, V_desc, kv_head, offs_d, d_valid, qk_scale,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    tree_mask, qpos, qprefix, slot_base, desc_row, desc_col,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, FULL: tl.constexpr,
    CONTIG: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    WIDE: tl.constexpr, PERSIST: tl.constexpr,
):
    """Online-softmax step over KV entries ``[n0, n0 + BLOCK_N)`` (those before ``kv_end``):
    returns the updated ``(m_i, l_i, acc)``. With ``MASKED``, the tree mask hides entries from
    the rows (query ``qpos``/``qprefix``) that do not see them. ``FULL`` (not ``MASKED``): every
    entry of the tile lies before ``kv_end`` and every row sees all of them. ``TMA`` (with
    ``CONTIG``): the K/V of ``FULL`` tiles come through the tensor descriptors ``K_desc`` and
    ``V_desc`` (a row per slot, every layer's; ``desc_row`` is entry 0's row, ``desc_col`` the
    KV head's first column). ``PERSIST``: the tile is a persistent program's."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    # ``at``: the entries the tile loads; ``kv_mask`` and ``rec_valid``: which of their K/V
    # elements and tree-mask records it loads
    if FULL:
        # a constant-true mask: no per-entry compares and selects in the tile's softmax
        n_valid = tl.full([BLOCK_N], 1, tl.int1)
        at = offs_n
        kv_mask = d_valid[None, :]
        rec_valid = n_valid
    else:
        n_valid = offs_n < kv_end
        if PERSIST or (CONTIG and not MASKED):
            at = offs_n
            kv_mask = n_valid[:, None] & d_valid[None, :]
            rec_valid = n_valid
        else:
            # past its unit's end the tile loads the unit's last entry again, so its loads need
            # no predicate (a compare and a select a load: the deep trees' masked path tile
            # takes 8% fewer instructions, a masked 16-row contig tile 11%) and the scores there
            # are hidden below. Unmasked contig tiles keep addresses affine in n0, which pays
            # more (clamped, a few-shot plan's one launch of long units ran 0.98x), and
            # persistent tiles their registers (clamped, +21: fewer leaf programs fit beside)
            at = tl.minimum(offs_n, kv_end - 1)
            kv_mask = d_valid[None, :]
            rec_valid = tl.full([BLOCK_N], 1, tl.int1)
    if TMA and FULL:
        # one bulk copy a tile into shared memory (Hopper's TMA), where the MMAs read it: no
        # address arithmetic or registers in the threads. Whole tiles
        # only: past a unit's end lie other slots, which a partial tile would have to zero
        row = (desc_row + n0).to(tl.int32)
        k = K_desc.load([row, desc_col])
        v = V_desc.load([row, desc_col])
    else:
        if CONTIG:
            # the unit's slots are one run: addresses affine in n0 stream a lone program's tiles
            # 1.6x faster than gathered ones, and than non-affine ones computed without any load
            slot = slot_base + at
        else:
            # (WIDE: page * stride overflows int32 on pools of 2^31 elements)
            slot = _index(tl.load(kv_indices + at), WIDE)
        # paged gather: PAGE_SIZE is a power-of-two constexpr, so these are shifts and masks
        page = slot // PAGE_SIZE
        in_page = slot % PAGE_SIZE
        k = tl.load(K + page[:, None] * stride_kp + in_page[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + page[:, None] * stride_vp + in_page[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if FULL:
        # every row sees every entry, so m_new is finite (m_i may be -inf before the first
        # tile): no selects, and the scale folds into one FMA with the max (log2 domain). These
        # per-entry instructions are most of a tall tile's non-MMA work
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_safe = m_new
        p = tl.exp2(s * qk_scale - m_new[:, None])
    elif MASKED:
        # a 16-byte record an entry: node range [lo, hi) and its offset in the node less the
        # entry index (one value for a whole segment, so the host builds it by one repeat);
        # (WIDE from 2^29 entries: 4 * entry overflows int32)
        rec = tree_mask + _index(at, WIDE) * 4
        lo = tl.load(rec, mask=rec_valid, other=0)
        hi = tl.where(n_valid, tl.load(rec + 1, mask=rec_valid, other=0), 0)  # (past the end: hidden)
        pos = tl.load(rec + 2, mask=rec_valid, other=0) + at
        # ancestor test on pre-order numbers: token's node is an ancestor-or-self of the
        # query's node, and within the query's own node only its first `prefix` tokens
        anc = (lo[None, :] <= qpos[:, None]) & (qpos[:, None] < hi[None, :])
        own_ok = (lo[None, :] < qpos[:, None]) | (pos[None, :] < qprefix[:, None])
        s = tl.where(anc & own_ok, s * qk_scale, float("-inf"))  # (log2 domain)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows that have seen nothing yet keep m = -inf; subtract 0 instead to avoid inf - inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
    else:
        s = tl.where(n_valid[None, :], s * qk_scale, float("-inf"))  # (log2 domain)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows that have seen nothing yet keep m = -inf; subtract 0 instead to avoid inf - inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _fold_row(m_i, l_i, acc, r, rows, O_part, LSE_part, head, offs_d, d_valid, stride_pn, stride_ph, stride_pln):
    """Fold partial row ``r`` (per tile row; skipped where negative or the tile's own row) into a
    tile's online-softmax state (log2 units). Its LSE is natural-log and its output normalised:
    it weighs ``2^lse2`` in all."""
    use = (r >= 0) & (r != rows)
    lse2 = tl.load(LSE_part + r * stride_pln + head, mask=use, other=float("-inf")) * LOG2E
    o = tl.load(O_part + r[:, None] * stride_pn + head[:, None] * stride_ph + offs_d[None, :],
                mask=use[:, None] & d_valid[None, :], other=0.0).to(tl.float32)
    return _fold_state(m_i, l_i, acc, lse2, o, TO_LOG2=1.0)


@triton.jit
def _store_out(Out, LSE_out, q_idx, head, offs_d, d_valid, o, lse, rows_out, stride_on, stride_oh, stride_ln,
               WRITE_LSE: tl.constexpr):
    """Store the tile rows ``rows_out`` as their queries' outputs (and LSEs with ``WRITE_LSE``)."""
    tl.store(Out + q_idx[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
             o.to(Out.dtype.element_ty), mask=rows_out[:, None] & d_valid[None, :])
    if WRITE_LSE:
        tl.store(LSE_out + q_idx * stride_ln + head, lse, mask=rows_out)


@triton.jit
def _store_rows(O_part, LSE_part, Out, LSE_out, row_direct, rows, q_idx, head, row_valid, offs_d, d_valid, o, lse,
                stride_pn, stride_ph, stride_pln, stride_on, stride_oh, stride_ln,
                DIRECT: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Store a tile's rows: as partial rows for the merge, or (``DIRECT``) the rows flagged in
    ``row_direct`` (their query's only row) as outputs."""
    to_part = row_valid
    if DIRECT:
        final = tl.load(row_direct + rows, mask=row_valid, other=0) != 0
        to_part = row_valid & ~final
        _store_out(Out, LSE_out, q_idx, head, offs_d, d_valid, o, lse, row_valid & final, stride_on, stride_oh,
                   stride_ln, WRITE_LSE=WRITE_LSE)
    # partials of 16-bit inputs are 16-bit: o is normalised, so it rounds like the output
    tl.store(O_part + rows[:, None] * stride_pn + head[:, None] * stride_ph + offs_d[None, :],
             o.to(O_part.dtype.element_ty), mask=to_part[:, None] & d_valid[None, :])
    tl.store(LSE_part + rows * stride_pln + head, lse, mask=to_part)


@triton.jit
def _attend_unit(
    work, kv_head, Q, K, V, K_desc, V_desc, O_part, LSE_part, Out, LSE_out,
    kv_indices, work_kv_start, work_kv_end, work_mask_start, work_row_indptr, row_q_indices, row_direct,
    tree_mask, query_pos, query_prefix, merge_indptr, merge_indices, qk_scale, layer_offset,
    stride_qn, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_pn, stride_ph, stride_pln, stride_on, stride_oh, stride_ln,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_SPLIT: tl.constexpr, CONTIG: tl.constexpr,
    SPLIT_TAIL: tl.constexpr, DIRECT: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr, TMA: tl.constexpr, MERGE_ROWS: tl.constexpr, WIDE: tl.constexpr,
    PERSIST: tl.constexpr,
):
    """One query tile of work unit ``work`` for KV head ``kv_head`` (K and V already offset to
    the layer's caches): see :func:`_tree_partial_attention_kernel`."""
    kv_start = tl.load(work_kv_start + work)
    kv_end = tl.load(work_kv_end + work)
    # with CONTIG, entry n of the unit is slot slot_base + n
    slot_base = _index(tl.zeros([], tl.int32), WIDE)
    if CONTIG:
        slot_base = _index(tl.load(kv_indices + kv_start), WIDE) - kv_start
    desc_row = slot_base
    desc_col = kv_head * HEAD_DIM
    if TMA:
        # the descriptors' rows are the slots from layer 0's on (the launcher checks that slots
        # are evenly strided and layers a whole number of slots apart)
        desc_row += layer_offset // stride_ks
    row_start = tl.load(work_row_indptr + work)
    num_rows = tl.load(work_row_indptr + work + 1) - row_start

    offs_m = tl.arange(0, BLOCK_M)
    q_local = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = q_local < num_rows
    q_idx = _index(tl.load(row_q_indices + row_start + q_local, mask=row_valid, other=0), WIDE)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q = tl.load(Q + q_idx[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        # Triton's CPU interpreter computes bf16 dots wrongly; it runs them in fp32 instead
        q = q.to(tl.float32)
    # the merge map of the rows' queries, read now so that only their other rows' loads wait
    # for the launches before (MERGE_ROWS)
    m_start = tl.zeros([BLOCK_M], tl.int32)
    m_count = m_start
    r0 = _index(m_start, WIDE) - 1
    r1 = r0
    if MERGE_ROWS:
        m_start = tl.load(merge_indptr + q_idx, mask=row_valid, other=0)
        m_count = tl.load(merge_indptr + q_idx + 1, mask=row_valid, other=0) - m_start
        r0 = _index(tl.load(merge_indices + m_start, mask=m_count > 0, other=-1), WIDE)
        r1 = _index(tl.load(merge_indices + m_start + 1, mask=m_count > 1, other=-1), WIDE)
    split = kv_end
    if HAS_MASK:
        qpos = tl.load(query_pos + q_idx, mask=row_valid, other=-1)
        qprefix = tl.load(query_prefix + q_idx, mask=row_valid, other=0)
        if MASK_SPLIT:
            # tile-aligned, so the tiles are the same as when masking all of them
            split = kv_start + (tl.load(work_mask_start + work) - kv_start) // BLOCK_N * BLOCK_N
        else:
            split = kv_start
    else:
        qpos = tl.zeros([BLOCK_M], tl.int32)  # (unused: no tile is masked)
        qprefix = qpos

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # unmasked tiles wholly inside the unit run the FULL step: those before the mask split (it
    # is tile-aligned), and with SPLIT_TAIL all but an unmasked unit's last, partial tile, which
    # then runs after the loop (outside its software pipeline: one more memory round trip)
    full_end = split
    if SPLIT_TAIL and not HAS_MASK:
        full_end = kv_start + (kv_end - kv_start) // BLOCK_N * BLOCK_N
    if MASK_SPLIT or not HAS_MASK:  # (a masked launch without a split keeps one loop)
        for n0 in range(kv_start, full_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, n0, kv_end, kv_indices, K, V, K_desc, V_desc, kv_head, offs_d, d_valid, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                tree_mask, qpos, qprefix, slot_base, desc_row, desc_col,
                BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, MASKED=False, FULL=HAS_MASK or SPLIT_TAIL,
                CONTIG=CONTIG, TMA=TMA, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST, WIDE=WIDE, PERSIST=PERSIST)
    if not HAS_MASK:
        if SPLIT_TAIL:
            if full_end < kv_end:  # the unit's last, partial tile
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, full_end, kv_end, kv_indices, K, V, K_desc, V_desc, kv_head, offs_d, d_valid, qk_scale,
                    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                    tree_mask, qpos, qprefix, slot_base, desc_row, desc_col,
                    BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, MASKED=False, FULL=False, CONTIG=CONTIG, TMA=TMA,
                    DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST, WIDE=WIDE, PERSIST=PERSIST)
    else:
        # a second loop rather than a per-tile branch: each is software-pipelined on its own
        for n0 in range(split, kv_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, n0, kv_end, kv_indices, K, V, K_desc, V_desc, kv_head, offs_d, d_valid, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                tree_mask, qpos, qprefix, slot_base, desc_row, desc_col,
                BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, MASKED=True, FULL=False, CONTIG=CONTIG, TMA=TMA,
                DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST, WIDE=WIDE, PERSIST=PERSIST)

    rows = _index(row_start + q_local, WIDE)
    if MERGE_ROWS:
        if PDL:  # (the launch before this one finishes after all the others: see above)
            tl.extra.cuda.gdc_wait()
        # every other row of the rows' queries (merge_indices[merge_indptr[q]:merge_indptr[q + 1]])
        m_i, l_i, acc = _fold_row(m_i, l_i, acc, r0, rows, O_part, LSE_part, head, offs_d, d_valid,
                                  stride_pn, stride_ph, stride_pln)
        m_i, l_i, acc = _fold_row(m_i, l_i, acc, r1, rows, O_part, LSE_part, head, offs_d, d_valid,
                                  stride_pn, stride_ph, stride_pln)
        for j in range(2, tl.max(m_count, axis=0)):
            r = _index(tl.load(merge_indices + m_start + j, mask=j < m_count, other=-1), WIDE)
            m_i, l_i, acc = _fold_row(m_i, l_i, acc, r, rows, O_part, LSE_part, head, offs_d, d_valid,
                                      stride_pn, stride_ph, stride_pln)
    has = l_i > 0.0
    # one reciprocal a row, then a multiply an element (a division an element is ~8 instructions)
    o = acc * (1.0 / tl.where(has, l_i, 1.0))[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    if MERGE_ROWS:  # every row is final
        _store_out(Out, LSE_out, q_idx, head, offs_d, d_valid, o, lse, row_valid, stride_on, stride_oh, stride_ln,
                   WRITE_LSE=WRITE_LSE)
    else:
        _store_rows(O_part, LSE_part, Out, LSE_out, row_direct, rows, q_idx, head, row_valid, offs_d, d_valid, o,
                    lse, stride_pn, stride_ph, stride_pln, stride_on, stride_oh, stride_ln,
                    DIRECT=DIRECT, WRITE_LSE=WRITE_LSE)


# work_offset (the launch's first work unit) and num_units take any value: specialising on them
# (== 1, multiple of 16) would compile new variants in the middle of decoding (pdl_first: two
# variants for one)
@triton.jit(do_not_specialize=["work_offset", "num_units", "pdl_first"])
def _tree_partial_attention_kernel(
    Q, K, V, K_desc, V_desc, O_part, LSE_part, Out, LSE_out,
    kv_indices, work_kv_start, work_kv_end, work_mask_start, work_row_indptr, row_q_indices, row_direct,
    tree_mask, query_pos, query_prefix, merge_indptr, merge_indices,
    work_offset, num_units, num_kv_heads, qk_scale, kv_layer, stride_layer, pdl_first,
    stride_qn, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_pn, stride_ph, stride_pln,
    stride_on, stride_oh, stride_ln,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_SPLIT: tl.constexpr, HEADS_INNER: tl.constexpr, CONTIG: tl.constexpr,
    SPLIT_TAIL: tl.constexpr, DIRECT: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr = False, TMA: tl.constexpr = False, MERGE_ROWS: tl.constexpr = False,
    PERSIST: tl.constexpr = False, WIDE: tl.constexpr = True,
):
    """One program = one query tile of one work item, for one KV head.

    The tile's rows are (query, head-in-group) pairs, so the GQA heads sharing a KV head share
    every K/V tile this program loads: each KV byte is read once per work item.

    ``K`` and ``V`` are offset by ``kv_layer[0] * stride_layer`` elements (``stride_layer`` 0
    when the caller passes one layer's caches).

    With ``HAS_MASK``, the KV tiles wholly before the unit's ``work_mask_start`` (entries every
    row sees) run without the tree mask, the others with it.

    With ``DIRECT``, rows flagged in ``row_direct`` (their query's only partial row) are final:
    they go straight to ``Out`` (and ``LSE_out`` with ``WRITE_LSE``), so a plan whose queries
    all have one row needs no merge launch.

    With ``PDL`` (launched as a programmatic dependent launch, Hopper and later), the next
    launch on the stream may start once every program of this one has started. A plan's first
    launch (``pdl_first``) waits for its predecessor (which wrote ``Q`` and the caches) before
    letting the next one start; the others read only what that predecessor's predecessors wrote,
    so they run beside it, and their grid's last program waits for it before exiting: every
    launch then finishes after the one before it (a grid ends only once all its programs have),
    and the merge's wait covers them all.

    With ``MERGE_ROWS`` (a plan's last launch, when each query with several partial rows has
    exactly one in it: :attr:`~treeattn.plan.format.Plan.merge_last`), every program merges its
    rows' queries' other rows, written by the launches before it, and writes the outputs: the
    plan needs no merge launch.

    With ``PERSIST``, the grid is 1-D and each program runs the launch's ``num_units`` units x
    KV heads in a grid-stride loop (in the order of the 2-D or ``HEADS_INNER`` grid): a launch
    of fewer programs than units, all started at once, so the launch after it gets the rest of
    every SM from the start (:func:`~treeattn.plan.lower.addressing.persistent_tall`).
    """
    if PDL:
        if pdl_first:
            tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # the caches of layer kv_layer[0] (read on the device, so one CUDA graph serves every layer)
    layer_offset = tl.load(kv_layer).to(tl.int64) * stride_layer
    K += layer_offset
    V += layer_offset
    # a persistent program strides over (unit, KV head) pairs; a one-shot program runs the pair
    # its grid position names. Two call sites on purpose: one loop for both (a one-iteration loop
    # and a division for one-shot programs) made the suite 2.4% slower at 32/32 heads (H200)
    if PERSIST:
        for t in range(tl.program_id(0), num_units * num_kv_heads, tl.num_programs(0)):
            if HEADS_INNER:
                work = t // num_kv_heads + work_offset
                kv_head = t % num_kv_heads
            else:
                work = t % num_units + work_offset
                kv_head = t // num_units
            _attend_unit(
                work, kv_head, Q, K, V, K_desc, V_desc, O_part, LSE_part, Out, LSE_out,
                kv_indices, work_kv_start, work_kv_end, work_mask_start, work_row_indptr, row_q_indices, row_direct,
                tree_mask, query_pos, query_prefix, merge_indptr, merge_indices, qk_scale, layer_offset,
                stride_qn, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                stride_pn, stride_ph, stride_pln, stride_on, stride_oh, stride_ln,
                GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGE_SIZE, HAS_MASK, MASK_SPLIT, CONTIG, SPLIT_TAIL,
                DIRECT, WRITE_LSE, DOT_PRECISION, UPCAST, PDL, TMA, MERGE_ROWS, WIDE, PERSIST)
    else:
        if HEADS_INNER:
            # a work unit's KV heads side by side in the grid: they read the same tokens' [Hkv, D]
            # rows (contiguous in the cache) at about the same time
            work = tl.program_id(0) // num_kv_heads + work_offset
            kv_head = tl.program_id(0) % num_kv_heads
        else:
            work = tl.program_id(0) + work_offset
            kv_head = tl.program_id(1)
        _attend_unit(
            work, kv_head, Q, K, V, K_desc, V_desc, O_part, LSE_part, Out, LSE_out,
            kv_indices, work_kv_start, work_kv_end, work_mask_start, work_row_indptr, row_q_indices, row_direct,
            tree_mask, query_pos, query_prefix, merge_indptr, merge_indices, qk_scale, layer_offset,
            stride_qn, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            stride_pn, stride_ph, stride_pln, stride_on, stride_oh, stride_ln,
            GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGE_SIZE, HAS_MASK, MASK_SPLIT, CONTIG, SPLIT_TAIL,
            DIRECT, WRITE_LSE, DOT_PRECISION, UPCAST, PDL, TMA, MERGE_ROWS, WIDE, PERSIST)
    if PDL and not MERGE_ROWS:
        # finish after the launch before (see above; MERGE_ROWS waited before its fold). The
        # grid's last program waiting is enough for that; the others leave their SM slots to the
        # programs still queued rather than hold them until the launch before ends (a leaf launch
        # beside a tall one: up to 1.2x on an H200)
        last = (tl.program_id(0) == tl.num_programs(0) - 1) & (tl.program_id(1) == tl.num_programs(1) - 1)
        if last:
            tl.extra.cuda.gdc_wait()
