"""Graph-stable device plans, so that a whole decode step (every layer's attention included) can
be one CUDA graph.

A captured graph bakes in its kernels' grid sizes, constexpr variants and tensor addresses. A plan
changes all of them every step, so the engine used to replay graphs only between the attention
calls and launched attention eagerly: 32 layers x 2-4 launches of ~30 us of host time each, as
long as the GPU work of a small step. Here a plan is *padded* to capacity classes and copied into
one persistent device buffer at offsets fixed by those classes. Plans with the same
:attr:`StaticPlan.signature` then have identical launches at identical addresses, and a graph
captured with one replays correctly for all of them.

Padding is inert:

* a padded work unit has an empty KV range and no rows: its program loads three integers and
  stores nothing;
* padded merge entries repeat the last merged query, whose output is then written twice with the
  same values;
* padded queries (up to the graph bucket's token count) and padded rows are referenced by no work
  unit.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from treeattn.plan.plan import Launch, Plan

__all__ = ["StaticPlan", "StaticPlanBuffer", "capacity"]

#: int32 elements between the starts of the buffer's fields (64 bytes: the alignment the kernels
#: are specialised for)
_ALIGN = 16
#: fields sized by the planned KV entries, by the partial rows and by the queries
_KV_FIELDS = ("kv_indices", "mask_lo", "mask_hi", "mask_pos")
_ROW_FIELDS = ("row_q_indices", "merge_indices", "row_direct")
_QUERY_FIELDS = ("query_pos", "query_prefix")


def capacity(n: int) -> int:
    """Capacity class of a count: 0, or the next power of two."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


@dataclass(frozen=True, eq=False)
class StaticPlan:
    """A padded plan whose tensors are views of a :class:`StaticPlanBuffer`.

    Attributes
    ----------
    plan : Plan
        For ``num_queries`` queries (the graph bucket); the caller's real queries come first.
    signature : tuple
        Equal signatures mean equal launches, variants and tensor addresses.
    """

    plan: Plan
    signature: tuple


def _pad(a: np.ndarray, size: int, fill: int = 0) -> np.ndarray:
    out = np.full(size, fill, dtype=np.int32)
    out[: a.size] = a
    return out


class StaticPlanBuffer:
    """One persistent int32 device buffer that graph-stable plans are copied into.

    The buffer grows (a new allocation) when a plan needs more room; its ``generation`` is part of
    every signature, so graphs captured against the old buffer are never replayed again.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.generation = 0
        self._buf: torch.Tensor | None = None

    def place(self, plan: Plan, num_queries: int) -> StaticPlan:
        """Pad host ``plan`` (CPU tensors) to ``num_queries`` queries and capacity classes, and
        copy it into the buffer (no host synchronisation)."""
        if plan.device.type != "cpu":
            raise ValueError("StaticPlanBuffer.place takes a host (CPU) plan")
        if num_queries < plan.num_queries:
            raise ValueError(f"cannot pad a plan of {plan.num_queries} queries to {num_queries}")
        arrays, launches, merge_cap = self._padded(plan, num_queries)
        names = [n for n in arrays if arrays[n] is not None]
        sizes = [arrays[n].size for n in names]
        starts = np.cumsum([0] + [-(-s // _ALIGN) * _ALIGN for s in sizes]).tolist()
        if self._buf is None or self._buf.numel() < starts[-1]:
            old = 0 if self._buf is None else self._buf.numel()
            self._buf = torch.empty(max(starts[-1], 2 * old, 1 << 16), dtype=torch.int32,
                                    device=self.device)
            self.generation += 1
        host = torch.empty(starts[-1], dtype=torch.int32,
                           pin_memory=self.device.type == "cuda")
        hv = host.numpy()
        for n, at, s in zip(names, starts, sizes):
            hv[at: at + s] = arrays[n]
        self._buf[: starts[-1]].copy_(host, non_blocking=True)
        views = {n: self._buf[at: at + s] for n, at, s in zip(names, starts, sizes)}
        static = dataclasses.replace(plan, num_queries=num_queries, launches=launches, **views)
        layout = tuple(zip(names, sizes))
        signature = (self.generation, num_queries, plan.has_mask, plan.num_direct > 0,
                     tuple(dataclasses.astuple(x) for x in launches), merge_cap, layout)
        return StaticPlan(static, signature)

    @staticmethod
    def _padded(plan: Plan, num_queries: int) -> tuple[dict, tuple, int]:
        """Host int32 arrays of the padded plan, its launches and its merge capacity."""
        ws, we = plan.work_kv_start.numpy(), plan.work_kv_end.numpy()
        indptr = plan.work_row_indptr.numpy()
        starts, ends, ptr, launches, at = [], [], [indptr[:1]], [], 0
        for x in plan.launches:
            real = x.work_end - x.work_start
            cap = capacity(real)
            pad = cap - real
            starts += [ws[x.work_start: x.work_end], np.zeros(pad, np.int32)]
            ends += [we[x.work_start: x.work_end], np.zeros(pad, np.int32)]
            ptr += [indptr[x.work_start + 1: x.work_end + 1], np.full(pad, indptr[x.work_end], np.int32)]
            launches.append(Launch(x.block_m, x.block_n, at, at + cap, x.num_warps, x.num_stages))
            at += cap
        rows = capacity(plan.num_rows)
        kv = capacity(plan.kv_indices.numel())
        merged = plan.merge_q_indices.numpy()
        merge_cap = capacity(merged.size)
        mindptr = plan.merge_indptr.numpy()
        arrays = {
            "work_kv_start": np.concatenate(starts).astype(np.int32),
            "work_kv_end": np.concatenate(ends).astype(np.int32),
            "work_row_indptr": np.concatenate(ptr).astype(np.int32),
            # the same query merged again writes the same values
            "merge_q_indices": _pad(merged, merge_cap, merged[-1] if merged.size else 0),
            "merge_indptr": _pad(mindptr, num_queries + 1, mindptr[-1]),
        }
        for names, size in ((_KV_FIELDS, kv), (_ROW_FIELDS, rows), (_QUERY_FIELDS, num_queries)):
            for n in names:
                t = getattr(plan, n)
                arrays[n] = None if t is None else _pad(t.numpy(), size)
        return arrays, tuple(launches), merge_cap
