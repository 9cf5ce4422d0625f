"""Triton helpers shared by the attention and merge kernels: log-sum-exp constants and the fold
of one attention state into a running one."""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _fold_state(m, den, acc, lse, o, TO_LOG2: tl.constexpr):
    """Fold a normalised state (output ``o [N, D]``, log-sum-exp ``lse [N]``) into a running one
    (max ``m``, denominator ``den``, numerator ``acc``; ``m`` in ``lse``'s units, ``TO_LOG2``
    converting them to log2: ``LOG2E`` for natural logs, 1.0 for log2) and return it. A state
    that saw nothing (``lse`` of -inf) weighs 0; -inf on both sides stays -inf, not NaN."""
    m_new = tl.maximum(m, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    scale_old = tl.exp2((m - m_safe) * TO_LOG2)
    w = tl.exp2((lse - m_safe) * TO_LOG2)
    return m_new, den * scale_old + w, acc * scale_old[:, None] + w[:, None] * o
