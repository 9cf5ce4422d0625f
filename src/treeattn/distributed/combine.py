"""Combining partial attention states across ranks.

Tree Attention (Alg. 3 of the paper, steps 3-6): every rank holds ``(o, lse)`` over its own KV.

1. ``m = all_reduce(MAX, lse)``                                   (``[Q, Hq]`` fp32)
2. ``n = o * exp(lse - m)``, ``d = exp(lse - m)``, packed into one fp32 buffer ``[Q, Hq, D + 1]``
3. one ``all_reduce(SUM)`` of the packed buffer (the paper's two sum all-reduces, fused)
4. ``out = n_g / d_g``

Ranks (or queries) without local KV contribute ``lse = -inf``: ``d = 0``. The rank holding the
maximum contributes ``exp(0) = 1`` exactly, so ``d_g >= 1`` whenever some rank sees a token; the
division uses ``max(d_g, 1)``, which gives ``0`` (not NaN) for a query no rank has KV for.

On CUDA the pack and unpack steps are single Triton kernels; elsewhere they are PyTorch ops.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import triton

from treeattn.distributed.comm import CommStats, all_reduce
from treeattn.kernels.combine import _pack_kernel, _unpack_kernel
from treeattn.launchers import check_triton_device

__all__ = ["allreduce_merge", "merge_running", "pack_partial", "unpack_merged"]

_FLOAT32_MIN = -3.4028234663852886e38


def _use_triton(t: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        return t.is_cuda
    if use_triton:
        check_triton_device(t)
    return use_triton


def pack_partial(o: torch.Tensor, lse: torch.Tensor, m: torch.Tensor, *,
                 use_triton: bool | None = None) -> torch.Tensor:
    """Local numerator and denominator against the global max, packed for one all-reduce.

    Parameters
    ----------
    o : [Q, H, D], any float dtype
        Local attention output (normalised over the local KV).
    lse : [Q, H] float32
        Local natural-log LSE (``-inf`` without local KV).
    m : [Q, H] float32
        Global maximum of ``lse`` over ranks.
    use_triton : bool, optional
        Default: on CUDA tensors.

    Returns
    -------
    buf : [Q, H, D + 1] float32, contiguous: ``buf[..., :D] = o * w``, ``buf[..., D] = w`` with
    ``w = exp(lse - m)``.
    """
    nq, h, d = o.shape
    buf = torch.empty((nq, h, d + 1), dtype=torch.float32, device=o.device)
    if nq * h == 0:
        return buf
    if _use_triton(o, use_triton):
        _pack_kernel[(nq * h,)](o.contiguous(), lse.contiguous(), m.contiguous(), buf, d,
                                BLOCK_D=triton.next_power_of_2(d))
        return buf
    w = torch.exp(lse - m.clamp_min(_FLOAT32_MIN))
    torch.mul(o, w[..., None], out=buf[..., :d])
    buf[..., d] = w
    return buf


def unpack_merged(buf: torch.Tensor, dtype: torch.dtype, *, use_triton: bool | None = None
                  ) -> torch.Tensor:
    """``out = buf[..., :D] / max(buf[..., D], 1)`` in ``dtype`` (``[Q, H, D]``)."""
    nq, h, d1 = buf.shape
    d = d1 - 1
    if nq * h and _use_triton(buf, use_triton):
        out = torch.empty((nq, h, d), dtype=dtype, device=buf.device)
        _unpack_kernel[(nq * h,)](buf, out, d, BLOCK_D=triton.next_power_of_2(d))
        return out
    return (buf[..., :d] / buf[..., d:].clamp_min(1.0)).to(dtype)


def allreduce_merge(o: torch.Tensor, lse: torch.Tensor, *, group=None,
                    stats: CommStats | None = None, use_triton: bool | None = None) -> torch.Tensor:
    """Exact attention output from every rank's partial state (Tree Attention, Alg. 3).

    Collective: every rank of ``group`` must call it with the same shapes.

    Parameters
    ----------
    o : [Q, H, D] float16 / bfloat16 / float32
        This rank's output over its KV (``0`` where it has none).
    lse : [Q, H] float32
        This rank's natural-log LSE (``-inf`` where it has no KV).
    group : ProcessGroup, optional
    stats : CommStats, optional
        Records the two all-reduces (``Q*H`` and ``Q*H*(D+1)`` fp32 elements).

    Returns
    -------
    out : [Q, H, D] in o's dtype, identical on every rank.
    """
    if o.dim() != 3 or lse.shape != o.shape[:2] or lse.dtype != torch.float32:
        raise ValueError(f"o must be [Q, H, D] and lse [Q, H] float32; got {tuple(o.shape)}, "
                         f"{tuple(lse.shape)} {lse.dtype}")
    m = all_reduce(lse.clone(), dist.ReduceOp.MAX, group=group, stats=stats)
    buf = pack_partial(o, lse, m, use_triton=use_triton)
    all_reduce(buf, dist.ReduceOp.SUM, group=group, stats=stats)
    return unpack_merged(buf, o.dtype, use_triton=use_triton)


def merge_running(acc_o: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax step: merge state ``(o, lse)`` into the running ``(acc_o, acc_lse)``.

    Parameters
    ----------
    acc_o : [Q, H, D] float32; acc_lse : [Q, H] float32
    o : [Q, H, D] any float dtype; lse : [Q, H] float32 (``-inf`` for an empty KV set)

    Returns
    -------
    (acc_o [Q, H, D] float32, acc_lse [Q, H] float32), normalised over the union of the KV sets.
    """
    new = torch.logaddexp(acc_lse, lse)
    ref = new.clamp_min(_FLOAT32_MIN)  # both -inf: weights exp(-inf) = 0, state stays empty
    a = torch.exp(acc_lse - ref)[..., None]
    b = torch.exp(lse - ref)[..., None]
    return acc_o * a + o.float() * b, new
