"""Launchers of the fused layer kernels (:mod:`treeattn.kernels.layers`) used by
:class:`treeattn.engine.model.TreeModel` on CUDA.

Each function validates shapes, dtypes and strides (tensor metadata only: no host synchronisation
and no allocation whose size depends on tensor values, so every call can be captured in a CUDA
graph), allocates its outputs unless they are given, and launches one kernel. On CPU tensors they
run only under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported).
"""
from __future__ import annotations

import torch
import triton

from treeattn.kernels.layers import _copy_slots_kernel, _rms_norm_kernel, _rope_kv_kernel, _swiglu_kernel

__all__ = ["add_rms_norm", "copy_slots", "rms_norm", "rope_qkv_cache", "swiglu"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INDEX = (torch.int64, torch.int32)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x [..., C]`` as a 2-D ``[rows, C]`` tensor with a unit last stride (a view when possible)."""
    _check(x.dim() >= 1 and x.dtype in _FLOATS, f"{name}: expected a float tensor [..., C], got "
                                                f"{x.dtype} {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] == 1 else x2.contiguous()


def _norm_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def _norm(x, residual, weight, eps, h_out, out):
    hidden = x.shape[-1]
    _check(weight.shape == (hidden,) and weight.dtype in _FLOATS,
           f"weight: expected [{hidden}] float, got {weight.dtype} {tuple(weight.shape)}")
    _check(weight.device == x.device and weight.stride(0) == 1, "weight: must be contiguous on x's device")
    x2 = _rows(x, "x")
    y_dtype = torch.promote_types(weight.dtype, x.dtype)   # `weight * x.to(dtype)` promotes so
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device) if out is None else out
    _check(y.shape == x.shape and y.dtype == y_dtype and y.device == x.device,
           f"out: expected {y_dtype} {tuple(x.shape)}, got {y.dtype} {tuple(y.shape)}")
    y2 = y.view(-1, hidden)
    r2 = h2 = x2
    if residual is not None:
        _check(residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device,
               f"delta: expected {x.dtype} {tuple(x.shape)}, got {residual.dtype} {tuple(residual.shape)}")
        r2 = _rows(residual, "delta")
        h_out = torch.empty_like(x) if h_out is None else h_out
        _check(h_out.shape == x.shape and h_out.dtype == x.dtype and h_out.device == x.device,
               f"h_out: expected {x.dtype} {tuple(x.shape)}")
        h2 = h_out.view(-1, hidden)
    if y2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(y2.shape[0],)](
            x2, r2, h2, y2, weight, x2.stride(0), r2.stride(0), h2.stride(0), y2.stride(0), hidden,
            float(eps), HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_norm_warps(block))
    return h_out, y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
             ) -> torch.Tensor:
    """Fused RMSNorm (one kernel), as :func:`treeattn.engine.model.rms_norm` computes it.

    Parameters
    ----------
    x : [..., hidden] float32, float16 or bfloat16
    weight : [hidden] float, contiguous
    eps : float
    out : [..., hidden] tensor of dtype ``promote_types(weight.dtype, x.dtype)``, optional
        Must be viewable as ``[rows, hidden]`` with a unit last stride.

    Returns
    -------
    ``weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)``, shaped like ``x``.
    """
    return _norm(x, None, weight, eps, None, out)[1]


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 h_out: torch.Tensor | None = None, out: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and RMSNorm in one kernel: ``h_new = h + delta; y = rms_norm(h_new)``.

    Parameters
    ----------
    h, delta : [..., hidden], same float dtype
    weight : [hidden] float, contiguous
    eps : float
    h_out : like ``h``, optional
        Where ``h_new`` goes (may be ``h`` or ``delta`` itself: every element is read before it
        is written, by the same program).
    out : optional, as in :func:`rms_norm`

    Returns
    -------
    h_new : like ``h`` (``h + delta`` rounded to the dtype)
    y : ``rms_norm(h_new, weight, eps)``
    """
    return _norm(h, delta, weight, eps, h_out, out)


def rope_qkv_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int, *, q_out: torch.Tensor | None = None,
                   layer_out: torch.Tensor | None = None, layer: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE of q and k and the K/V cache write of ``n`` tokens, in one kernel.

    Parameters
    ----------
    qkv : [n, (Hq + 2 Hkv) * D] float, unit last stride
        The fused q/k/v projection output. Its key part is overwritten with the rotated keys.
    cos, sin : [P, D] tables (rotate-half layout, as :func:`treeattn.engine.model.apply_rope`),
        same dtype as ``qkv``, unit last stride; ``positions`` must be ``< P`` (not checked: that
        would need a host synchronisation).
    positions, slots : int64 or int32 [n]
        Position (row of the tables) and cache slot of every token.
    k_cache, v_cache : [num_slots, Hkv, D], dtype of ``qkv``, unit last stride
        Flat caches; row ``slots[i]`` receives token ``i``'s rotated key / value.
    num_heads, num_kv_heads, head_dim : int
        ``Hq``, ``Hkv`` and ``D`` (even).
    q_out : [n, Hq, D], dtype of ``qkv``, unit last stride, optional
        Where the rotated queries go (a new contiguous tensor by default).
    layer_out : int32 [1], optional
        Receives ``layer`` (the attention graph's layer counter,
        :class:`~treeattn.engine.graphs.AttentionGraph`), written by the same kernel.
    layer : int
        The value for ``layer_out``.

    Returns
    -------
    q : [n, Hq, D] rotated queries (``q_out`` when given)
    k : [n, Hkv, D] rotated keys, a view of ``qkv``
    v : [n, Hkv, D] values, a view of ``qkv``
    """
    hq, hkv, d = num_heads, num_kv_heads, head_dim
    _check(d % 2 == 0 and d > 0, f"head_dim must be even, got {d}")
    qs, kvs = hq * d, hkv * d
    _check(qkv.dim() == 2 and qkv.shape[1] == qs + 2 * kvs and qkv.dtype in _FLOATS
           and qkv.stride(1) == 1, f"qkv: expected a float [n, {qs + 2 * kvs}] with unit last stride, "
                                   f"got {qkv.dtype} {tuple(qkv.shape)} strides {qkv.stride()}")
    n, dt, dev = qkv.shape[0], qkv.dtype, qkv.device
    for name, t in (("cos", cos), ("sin", sin)):
        _check(t.dim() == 2 and t.shape[1] == d and t.dtype == dt and t.stride(1) == 1 and t.device == dev,
               f"{name}: expected {dt} [P, {d}] with unit last stride, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("positions", positions), ("slots", slots)):
        _check(t.shape == (n,) and t.dtype in _INDEX and t.device == dev,
               f"{name}: expected int64 [{n}] on {dev}, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(t.dim() == 3 and t.shape[1:] == (hkv, d) and t.dtype == dt and t.stride(2) == 1
               and t.device == dev, f"{name}: expected {dt} [num_slots, {hkv}, {d}] with unit last "
                                    f"stride, got {t.dtype} {tuple(t.shape)}")
    q = torch.empty(n, hq, d, dtype=dt, device=dev) if q_out is None else q_out
    _check(q.shape == (n, hq, d) and q.dtype == dt and q.stride(2) == 1 and q.device == dev,
           f"q_out: expected {dt} [{n}, {hq}, {d}] with unit last stride")
    if layer_out is not None:
        _check(layer_out.shape == (1,) and layer_out.dtype == torch.int32 and layer_out.device == dev,
               f"layer_out: expected int32 [1] on {dev}, got {layer_out.dtype} {tuple(layer_out.shape)}")
    if n:
        positions, slots = positions.contiguous(), slots.contiguous()
        half = d // 2
        _rope_kv_kernel[(n, hq + 2 * hkv)](
            qkv, cos, sin, positions, slots, q, k_cache, v_cache, q if layer_out is None else layer_out, layer,
            qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, HEAD_DIM=d, HALF=half,
            BLOCK_HALF=triton.next_power_of_2(half), WRITE_LAYER=layer_out is not None,
            num_warps=1 if half <= 64 else 2)
    elif layer_out is not None:
        layer_out.fill_(layer)
    k = qkv[:, qs: qs + kvs].view(n, hkv, d)
    v = qkv[:, qs + kvs:].view(n, hkv, d)
    return q, k, v


def swiglu(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate, up = gate_up.chunk(2, -1)`` in one kernel.

    Parameters
    ----------
    gate_up : [n, 2 I] float, unit last stride
    out : [n, I], dtype of ``gate_up``, unit last stride, optional

    Returns
    -------
    [n, I] in ``gate_up``'s dtype (PyTorch's roundings: silu rounded, then the product).
    """
    _check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.dtype in _FLOATS
           and gate_up.stride(1) == 1, f"gate_up: expected a float [n, 2 I] with unit last stride, "
                                       f"got {gate_up.dtype} {tuple(gate_up.shape)}")
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    _check(y.shape == (n, inter) and y.dtype == gate_up.dtype and y.stride(1) == 1
           and y.device == gate_up.device, f"out: expected {gate_up.dtype} [{n}, {inter}]")
    if n and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _swiglu_kernel[(n, triton.cdiv(inter, block))](gate_up, y, gate_up.stride(0), y.stride(0), inter,
                                                      BLOCK=block, num_warps=4 if block >= 512 else 1)
    return y


def copy_slots(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``kv[:, dst[i]] = kv[:, src[i]]`` for every ``i`` where ``src[i] != dst[i]``, in one kernel;
    the other pairs move no bytes.

    Parameters
    ----------
    kv : [planes, slots, ...] float tensor
        Every layer's K and V cache as planes (:class:`~treeattn.engine.node_slots.KVCacheManager`'s
        stacked view); each slot's elements contiguous.
    src, dst : int64 or int32 [m] on ``kv``'s device
        No slot may be both a destination and the source of another pair (the pairs run in
        any order).
    """
    _check(kv.dim() >= 2 and kv.dtype in _FLOATS, f"kv: expected a float [planes, slots, ...] tensor, got "
                                                  f"{kv.dtype} {tuple(kv.shape)}")
    row = kv[0, 0].numel()
    _check(kv[0, 0].is_contiguous() and kv.stride(1) >= row, "kv: each slot's elements must be contiguous")
    for name, t in (("src", src), ("dst", dst)):
        _check(t.dim() == 1 and t.dtype in _INDEX and t.device == kv.device,
               f"{name}: expected int64/int32 [m] on {kv.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    _check(src.shape == dst.shape, f"src and dst differ in length: {src.shape[0]} vs {dst.shape[0]}")
    if not src.shape[0]:
        return
    block = triton.next_power_of_2(row)
    planes = min(triton.next_power_of_2(kv.shape[0]), max(1, 16384 // block))   # ~32 KB of 16-bit rows
    _copy_slots_kernel[(src.shape[0], triton.cdiv(kv.shape[0], planes))](
        kv, src, dst, kv.shape[0], row, kv.stride(0), kv.stride(1), BLOCK=block, PLANES=planes, num_warps=4)
