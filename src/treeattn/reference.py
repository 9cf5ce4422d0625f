"""Pure-PyTorch attention: the dense reference every test compares against, and the ``torch``
backend that executes a plan work item by work item (float64-capable, the CPU default)."""
from __future__ import annotations

import math

import numpy as np
import torch

from treeattn.plan.format import Plan
from treeattn.tree import DecodingTree

__all__ = ["visibility_mask", "reference_attention", "run_plan_torch", "merge_states_torch"]


def visibility_mask(tree: DecodingTree) -> np.ndarray:
    """bool [Q, T]: whether query ``q`` sees token ``t`` (tokens in node-id order, as in
    ``tree.kv_indices``)."""
    tok_node = np.repeat(np.arange(tree.num_nodes), tree.lengths)
    tok_pos = np.arange(tree.num_tokens) - tree.kv_indptr[tok_node]
    topo = tree.topology
    qn = tree.query_nodes[:, None]
    anc = (topo.tin[tok_node][None, :] <= topo.tin[qn]) & (topo.tin[qn] < topo.tout[tok_node][None, :])
    own = tok_node[None, :] == qn
    return anc & (~own | (tok_pos[None, :] < tree.query_prefix[:, None]))


def _slots_view(cache: torch.Tensor) -> torch.Tensor:
    """[num_pages, page_size, H, D] -> [num_pages * page_size, H, D] (a copy if not viewable)."""
    return cache.reshape(-1, cache.shape[-2], cache.shape[-1])


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        tree: DecodingTree, *, sm_scale: float | None = None,
                        dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense masked attention of every query over the whole tree, in ``dtype``.

    Parameters
    ----------
    q : [Q, Hq, D]
    k_cache, v_cache : [num_pages, page_size, Hkv, D]
        Paged pool addressed by ``tree.kv_indices``.

    Returns
    -------
    o : [Q, Hq, D] in ``dtype``; lse : [Q, Hq] natural-log LSE in ``dtype``.
    """
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[-2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    slots = torch.tensor(tree.kv_indices, device=q.device)
    k = _slots_view(k_cache)[slots].to(dtype)  # [T, Hkv, D]
    v = _slots_view(v_cache)[slots].to(dtype)
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,thd->hqt", q.to(dtype), k) * scale
    mask = torch.as_tensor(visibility_mask(tree), device=q.device)
    s = s.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, Q]
    p = torch.exp(s - lse[..., None])
    o = torch.einsum("hqt,thd->qhd", p, v)
    return o, lse.transpose(0, 1).contiguous()


def merge_states_torch(o: torch.Tensor, lse: torch.Tensor, indptr: torch.Tensor,
                       indices: torch.Tensor, *, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial states ``o [R, H, D]``, ``lse [R, H]`` (natural log) into one per segment of
    ``indptr`` over rows ``indices``. Returns ``(o [N, H, D] in out_dtype, lse [N, H] fp32)``."""
    n = indptr.numel() - 1
    counts = (indptr[1:] - indptr[:-1]).long()
    seg = torch.repeat_interleave(torch.arange(n, device=o.device), counts)
    rows = indices.long()
    lse_r = lse[rows].double()
    m = torch.full((n, lse.shape[1]), float("-inf"), dtype=torch.float64, device=o.device)
    m = m.scatter_reduce(0, seg[:, None].expand_as(lse_r), lse_r, reduce="amax")
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse_r - m_safe[seg])  # [R, H]
    den = torch.zeros_like(m).index_add_(0, seg, w)
    num = torch.zeros((n,) + o.shape[1:], dtype=torch.float64, device=o.device)
    num.index_add_(0, seg, w[..., None] * o[rows].double())
    out = torch.where(den[..., None] > 0, num / den.clamp_min(1e-300)[..., None], torch.zeros_like(num))
    lse_out = torch.where(den > 0, m_safe + torch.log(den.clamp_min(1e-300)), torch.full_like(den, float("-inf")))
    return out.to(out_dtype), lse_out.float()


def run_plan_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Plan,
                   *, sm_scale: float, acc_dtype: torch.dtype = torch.float32
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Execute ``plan`` with PyTorch ops, one work unit at a time.

    Returns fp32 (or ``acc_dtype``) partial outputs ``[R, Hq, D]`` and LSEs ``[R, Hq]``, the same
    contract as the Triton partial-attention kernel.
    """
    hq, d = plan.heads.num_qo_heads, plan.heads.head_dim
    group = plan.heads.group
    kv = plan.kv_indices.long()
    k_all, v_all = _slots_view(k_cache), _slots_view(v_cache)
    rows = plan.num_rows
    o_part = torch.empty((rows, hq, d), dtype=acc_dtype, device=q.device)
    lse_part = torch.empty((rows, hq), dtype=acc_dtype, device=q.device)
    starts, ends = plan.work_kv_start.tolist(), plan.work_kv_end.tolist()
    indptr = plan.work_row_indptr.tolist()
    row_q = plan.row_q_indices.long()
    for w in range(plan.num_work):
        r0, r1, s, e = indptr[w], indptr[w + 1], starts[w], ends[w]
        slots = kv[s:e]
        k = k_all[slots].to(acc_dtype).repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_all[slots].to(acc_dtype).repeat_interleave(group, dim=1)
        qs = row_q[r0:r1]
        sc = torch.einsum("qhd,nhd->qhn", q[qs].to(acc_dtype), k) * sm_scale
        if plan.has_mask:
            lo, hi, pos = plan.tree_mask[s:e, :3].long().unbind(1)
            pos = pos + torch.arange(s, e, device=pos.device)
            qp, qpre = plan.query_pos[qs].long()[:, None], plan.query_prefix[qs].long()[:, None]
            vis = (lo[None] <= qp) & (qp < hi[None]) & ((lo[None] < qp) | (pos[None] < qpre))
            sc = sc.masked_fill(~vis[:, None, :], float("-inf"))
        lse = torch.logsumexp(sc, dim=-1)
        lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(sc - lse_safe[..., None])
        o_part[r0:r1] = torch.einsum("qhn,nhd->qhd", p, v)
        lse_part[r0:r1] = lse
    return o_part, lse_part
