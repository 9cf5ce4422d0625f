"""The collectives the sharded attention issues, each recorded in an optional :class:`CommStats`.

Recording is what the benchmark calls the *measured* communication volume: the size of every
tensor handed to ``torch.distributed`` and, for collectives, the bytes each rank puts on the wire
under the standard ring algorithms (the same convention as NCCL's "bus bandwidth" and as the
Tree Attention paper's eq. 12): all-reduce ``2 (p - 1) / p x bytes``, all-gather
``(p - 1) x input bytes``, send ``bytes``, receive ``0``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CommRecord", "CommStats", "all_gather_counts", "all_reduce", "group_info", "ring_exchange"]


@dataclass(frozen=True)
class CommRecord:
    """One communication call of one rank.

    Attributes
    ----------
    op : {"all_reduce", "all_gather", "send", "recv"}
    numel : int
        Elements of the tensor passed (the input tensor for an all-gather).
    elem_bytes : int
        Bytes per element.
    world_size : int
        Ranks in the group.
    """

    op: str
    numel: int
    elem_bytes: int
    world_size: int

    @property
    def bytes(self) -> int:
        return self.numel * self.elem_bytes

    @property
    def wire_elements(self) -> float:
        """Elements this rank sends for the call under the ring algorithms (see module docstring)."""
        p = self.world_size
        if self.op == "all_reduce":
            return 2.0 * (p - 1) / p * self.numel
        if self.op == "all_gather":
            return float((p - 1) * self.numel)
        if self.op == "send":
            return float(self.numel)
        return 0.0

    @property
    def wire_bytes(self) -> float:
        return self.wire_elements * self.elem_bytes


@dataclass
class CommStats:
    """Accumulates :class:`CommRecord` s of one rank; pass it as ``stats=`` to record."""

    records: list = field(default_factory=list)

    def add(self, op: str, tensor: torch.Tensor, world_size: int) -> None:
        self.records.append(CommRecord(op, tensor.numel(), tensor.element_size(), world_size))

    def clear(self) -> None:
        self.records.clear()

    def wire_elements(self, ops=None) -> float:
        """Elements this rank sent, over the records whose op is in ``ops`` (default: all)."""
        return sum(r.wire_elements for r in self.records if ops is None or r.op in ops)

    def wire_bytes(self, ops=None) -> float:
        """Bytes this rank sent, over the records whose op is in ``ops`` (default: all)."""
        return sum(r.wire_bytes for r in self.records if ops is None or r.op in ops)

    def summary(self) -> dict:
        """``{op: {"calls", "numel", "bytes", "wire_bytes"}}``, JSON-ready."""
        out: dict = {}
        for r in self.records:
            s = out.setdefault(r.op, {"calls": 0, "numel": 0, "bytes": 0, "wire_bytes": 0.0})
            s["calls"] += 1
            s["numel"] += r.numel
            s["bytes"] += r.bytes
            s["wire_bytes"] += r.wire_bytes
        return out


def group_info(group=None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group`` (default: the world)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("treeattn.distributed needs torch.distributed initialised "
                           "(torch.distributed.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def all_reduce(t: torch.Tensor, op, *, group=None, stats: CommStats | None = None) -> torch.Tensor:
    """In-place ``torch.distributed.all_reduce`` of ``t``; returns ``t``."""
    dist.all_reduce(t, op=op, group=group)
    if stats is not None:
        stats.add("all_reduce", t, dist.get_world_size(group))
    return t


def all_gather_counts(n: int, *, device, group=None, stats: CommStats | None = None) -> list[int]:
    """Every rank's ``n`` (host ints, rank order); one all-gather of an int64 scalar."""
    world = dist.get_world_size(group)
    mine = torch.tensor([int(n)], dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    if stats is not None:
        stats.add("all_gather", mine, world)
    return [int(x) for x in torch.cat(parts).tolist()]


def ring_exchange(send: list, recv: list, *, rank: int, world_size: int, group=None,
                  stats: CommStats | None = None) -> list:
    """Send ``send`` tensors to rank ``rank + 1`` and receive ``recv`` tensors from ``rank - 1``
    (ring order within ``group``), batched into one ``batch_isend_irecv``.

    Either list may be empty (a peer with nothing to pass on); both sides of each link must agree.
    Returns the request handles to ``wait()`` on.
    """
    nxt = _global_rank(group, (rank + 1) % world_size)
    prv = _global_rank(group, (rank - 1) % world_size)
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recv]
    if stats is not None:
        for t in send:
            stats.add("send", t, world_size)
        for t in recv:
            stats.add("recv", t, world_size)
    return dist.batch_isend_irecv(ops) if ops else []
