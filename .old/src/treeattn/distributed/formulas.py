"""Communication volume and peak memory of sharded decode, after the Tree Attention paper ("Tree
Attention: topology-aware decoding for long-context attention on GPU clusters", section 6,
eqs. 8-14; ``shared/papers/tree-attention-multi-gpu-decoding.txt``).

The paper's symbols: ``p`` devices, ``t = N / p`` tokens per device, batch ``b``, ``n_h`` heads of
size ``d_h`` and hidden size ``d = n_h d_h``. Its KV has as many heads as its queries and one
context per batch row; here queries may share one context (``B`` queries over one KV, e.g.
parallel samples) and KV heads may be fewer (GQA), so the formulas are evaluated with

* ``b`` = number of queries for query-sized terms, with ``d = Hq x D``;
* ``b_kv`` = number of contexts (1 for :func:`treeattn.distributed.sharded_attention`) and
  ``d_kv = Hkv x D`` for KV-sized terms.

With ``Hq = Hkv`` and one query per context these are exactly the paper's formulas. Volumes are
in elements (the paper's unit) with the byte counts of this implementation alongside (the Tree
method all-reduces fp32; the ring method moves KV in the KV dtype).
"""
from __future__ import annotations

__all__ = ["comm_volume", "peak_memory"]


def _t(num_tokens: int, world_size: int) -> float:
    return num_tokens / world_size


def comm_volume(method: str, world_size: int, *, num_queries: int, num_qo_heads: int, head_dim: int,
                num_kv_heads: int | None = None, num_tokens: int = 0, num_contexts: int = 1,
                kv_bytes: int = 2, acc_bytes: int = 4) -> dict:
    """Communication volume of one sharded decode step.

    Parameters
    ----------
    method : {"tree", "ring"}
    world_size : int
        ``p``.
    num_queries, num_qo_heads, head_dim : int
        ``b``, ``n_h``, ``d_h``.
    num_kv_heads : int, optional
        Default ``num_qo_heads``.
    num_tokens : int
        Total context ``N`` (ring only).
    num_contexts : int
        ``b_kv`` (ring only).
    kv_bytes, acc_bytes : int
        Bytes per KV element and per all-reduced (fp32) element.

    Returns
    -------
    dict
        tree: ``numel`` (eq. 13: ``b d + 2 b n_h``), ``per_rank_elements`` (eq. 14:
        ``2 (p - 1) / p x numel``, what each rank sends under a ring all-reduce),
        ``total_elements`` (``p x`` that) and ``per_rank_bytes`` / ``total_bytes``.
        ring: ``eq10_elements`` (``2 b_kv t d_kv x p``: every device passing its shard once),
        ``per_rank_elements`` (``(p - 1) x 2 b_kv t d_kv``: a full ring pass, ``p - 1`` steps),
        ``total_elements`` (``(p - 1) x`` eq. 10; equal to eq. 10 for ``p = 2``) and bytes.
    """
    p = int(world_size)
    if p < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    hkv = num_qo_heads if num_kv_heads is None else num_kv_heads
    b, nh, dh = num_queries, num_qo_heads, head_dim
    if method == "tree":
        numel = b * nh * dh + 2 * b * nh  # eq. 13
        per_rank = 2.0 * (p - 1) / p * numel  # eq. 14
        return {"method": "tree", "numel": numel, "per_rank_elements": per_rank,
                "total_elements": p * per_rank, "per_rank_bytes": per_rank * acc_bytes,
                "total_bytes": p * per_rank * acc_bytes}
    if method == "ring":
        shard = 2.0 * num_contexts * _t(num_tokens, p) * hkv * dh  # eq. 11
        eq10 = shard * p
        per_rank = (p - 1) * shard
        return {"method": "ring", "eq10_elements": eq10, "per_rank_elements": per_rank,
                "total_elements": p * per_rank, "per_rank_bytes": per_rank * kv_bytes,
                "total_bytes": p * per_rank * kv_bytes}
    raise ValueError(f"unknown method {method!r}; expected 'tree' or 'ring'")


def peak_memory(method: str, world_size: int, *, num_tokens: int, num_queries: int,
                num_qo_heads: int, head_dim: int, num_kv_heads: int | None = None,
                num_contexts: int = 1, elem_bytes: int = 2) -> dict:
    """Peak memory per device of one sharded decode step (eqs. 8 and 9).

    ``Mem_ring = 4 b_kv t d_kv + 2 b d`` (local and incoming KV shard, query and output);
    ``Mem_tree = 2 b_kv t d_kv + 2 b d + 2 b n_h`` (local KV, query and numerator, denominator and
    max). The paper counts one incoming shard; with ``p >= 3`` a double-buffered ring holds two
    (``6 b_kv t d_kv``), reported as ``ring_double_buffered_elements``.

    Returns
    -------
    dict with ``elements`` and ``bytes`` (``elements x elem_bytes``, the paper's uniform dtype).
    """
    p = int(world_size)
    hkv = num_qo_heads if num_kv_heads is None else num_kv_heads
    kv = 2.0 * num_contexts * _t(num_tokens, p) * hkv * head_dim  # one shard of K and V
    bd = num_queries * num_qo_heads * head_dim
    if method == "ring":
        elements = 2 * kv + 2 * bd  # eq. 8
        out = {"method": "ring", "elements": elements, "bytes": elements * elem_bytes}
        out["ring_double_buffered_elements"] = elements + (kv if p >= 3 else 0.0)
        return out
    if method == "tree":
        elements = kv + 2 * bd + 2 * num_queries * num_qo_heads  # eq. 9
        return {"method": "tree", "elements": elements, "bytes": elements * elem_bytes}
    raise ValueError(f"unknown method {method!r}; expected 'tree' or 'ring'")
