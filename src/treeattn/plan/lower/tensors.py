"""A plan's index tensors on its device: every int32 array in one buffer, each starting 64-byte
aligned, moved in one copy (the API's plans as they are built, the engine's host plans as they
are used)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from treeattn.plan.format import Plan

__all__ = ["ALIGN", "pack_int32", "plan_to_device"]

#: Plan index tensors start at multiples of this many int32 (64 bytes) of their shared buffer:
#: Triton specialises kernels on pointer alignment, and a plan-dependent alignment would compile
#: new variants mid-run.
ALIGN = 16


def pack_int32(arrays: dict, device, *, pinned: bool = False) -> tuple[dict, dict]:
    """int32 tensors on ``device`` for ``arrays`` (name -> array of any shape; ``None`` stays
    ``None``) and their int32 host copies. CPU tensors share the host copies; on other devices
    they are views of one buffer moved in one copy, from pinned memory without blocking the
    host where ``pinned``."""
    device = torch.device(device)
    tensors = dict.fromkeys(arrays)
    if device.type == "cpu":
        host = {k: np.ascontiguousarray(a, dtype=np.int32) for k, a in arrays.items() if a is not None}
        tensors.update((k, torch.from_numpy(h)) for k, h in host.items())
        return tensors, host
    spans, at = {}, 0
    for k, a in arrays.items():
        if a is not None:
            spans[k] = (at, at + a.size)
            at += -(-a.size // ALIGN) * ALIGN
    staging = torch.empty(at, dtype=torch.int32, pin_memory=pinned)
    buf = staging.numpy()
    host = {}
    for k, (lo, hi) in spans.items():
        host[k] = buf[lo:hi].reshape(np.shape(arrays[k]))
        host[k][...] = arrays[k]
    dev = staging.to(device, non_blocking=pinned)
    tensors.update((k, dev[lo:hi].view(host[k].shape)) for k, (lo, hi) in spans.items())
    return tensors, host


def plan_to_device(plan: Plan, device) -> Plan:
    """``plan``, whose index tensors are on the CPU, with them on ``device``
    (:func:`pack_int32`, pinned: the copy does not block the host); the plan itself where
    ``device`` is the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return plan
    names = [f.name for f in dataclasses.fields(plan) if isinstance(getattr(plan, f.name), torch.Tensor)]
    tensors, _ = pack_int32({n: getattr(plan, n).numpy() for n in names}, device, pinned=True)
    return dataclasses.replace(plan, **tensors)
