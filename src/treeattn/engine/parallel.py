"""Tensor parallelism of :class:`~treeattn.engine.model.TreeModel` over ``torch.distributed``
(NCCL on GPUs, gloo on CPU), and the 2-D grid of process groups that composes it with the
sequence-sharded KV cache of :class:`~treeattn.engine.sharded.ShardedTreeEngine`.

A tensor-parallel (TP) rank holds (Megatron-LM's layout):

* q/k/v: its ``1 / tp`` of the query and KV heads (column-parallel), so its KV pool holds only
  its KV heads; gate/up: its ``1 / tp`` of the intermediate features (column-parallel);
* o and down: the matching input columns (row-parallel), each followed by one all-reduce of the
  ``[n, hidden]`` partial sums; their biases live on TP rank 0 only, so they are added once;
* the embedding and the LM head: its ``1 / tp`` of the vocabulary. The lookup is masked to the
  rank's ids and all-reduced; the logits of each vocabulary slice are all-gathered, so every
  rank holds the whole ``[n, vocab]`` and samples the same tokens;
* the norms whole (every rank computes the same hidden states).

A grid of ``tp x sp`` ranks (:func:`make_grid`) places rank ``r`` at TP rank ``r % tp`` of the TP
group of SP index ``r // tp`` (TP neighbours are adjacent ranks, on one host's fast links), and
at SP rank ``r // tp`` of the SP group of TP rank ``r % tp``: the ranks of an SP group hold the
same heads and split the sequence between them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Grid", "TensorParallel", "init_grid", "make_grid"]


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group; a model built with it holds its share of
    the weights (:func:`~treeattn.engine.weights.load_weights`) and runs the group's collectives.

    Attributes
    ----------
    rank : int
        Rank in the TP group, ``0 <= rank < size``.
    size : int
        Ranks of the TP group.
    group : ProcessGroup or None
        The TP group (None: the default group).
    """

    rank: int
    size: int
    group: object = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallelism: rank {self.rank} of {self.size} ranks is not a valid rank")

    def check(self, config) -> None:
        """Raise ValueError unless ``config`` (a :class:`~treeattn.engine.config.ModelConfig`)
        splits evenly over the group, naming every size that does not."""
        bad = [f"{name} ({n})" for name, n in (
            ("num_attention_heads", config.num_heads), ("num_key_value_heads", config.num_kv_heads),
            ("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size))
            if n % self.size]
        if bad:
            raise ValueError(f"tensor parallelism over {self.size} ranks needs {', '.join(bad)} "
                             f"divisible by {self.size}")

    def part(self, n: int) -> slice:
        """This rank's slice of ``n`` rows split evenly over the group (ValueError if ``n`` is
        not divisible by the group size)."""
        if n % self.size:
            raise ValueError(f"tensor parallelism: {n} rows do not split over {self.size} ranks")
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns ``x``."""
        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: ``tokens`` int64 ``[n]`` (global ids) in this rank's slice
        ``table [vocab / size, hidden]`` of the embedding -> ``[n, hidden]``, the same on every
        rank. Exact: each row is one rank's row plus zeros."""
        rows = table.shape[0]
        local = tokens - self.rank * rows
        miss = (local < 0) | (local >= rows)
        e = table.index_select(0, local.clamp(0, rows - 1)).masked_fill_(miss[:, None], 0)
        return self.all_reduce(e)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather the vocabulary slices ``x [n, vocab / size]`` of the group's ranks into
        ``[n, vocab]`` (rank order = vocabulary order)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class Grid:
    """This process's place in a ``tp x sp`` grid of ranks (:func:`make_grid`).

    Attributes
    ----------
    rank, world : int
        Global rank and ranks.
    tp : TensorParallel or None
        Its TP group; None when ``tp == 1`` (the model is not split).
    sp_group : ProcessGroup or None
        Its SP group (the ranks that split the sequence with it); None when ``sp == 1``.
    sp_rank : int
        Its rank in the SP group.
    """

    rank: int
    world: int
    tp: TensorParallel | None
    sp_group: object
    sp_rank: int


def make_grid(tp: int, sp: int) -> Grid:
    """Create the TP and SP process groups of a ``tp x sp`` grid over the initialised default
    group (collective: every rank must call it with the same numbers).

    Raises
    ------
    ValueError
        ``tp`` or ``sp`` below 1, or ``tp * sp`` is not the world size.
    """
    if tp < 1 or sp < 1:
        raise ValueError(f"tp and sp must be >= 1, got tp={tp}, sp={sp}")
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp * sp != world:
        raise ValueError(f"tp {tp} x sp {sp} = {tp * sp} ranks, but the process group has {world}")
    s, t = divmod(rank, tp)
    # every rank creates every group, in the same order (torch.distributed requires it)
    tp_groups = [dist.new_group([i * tp + j for j in range(tp)]) for i in range(sp)] if tp > 1 else []
    sp_groups = [dist.new_group([i * tp + j for i in range(sp)]) for j in range(tp)] if sp > 1 else []
    return Grid(rank, world, TensorParallel(t, tp, tp_groups[s]) if tp > 1 else None,
                sp_groups[t] if sp > 1 else None, s)


def init_grid(tp: int, sp: int, device_type: str, *, command: str = "run") -> Grid:
    """Initialise ``torch.distributed`` from torchrun's environment (NCCL on CUDA, gloo on CPU)
    and build the ``tp x sp`` grid (:func:`make_grid`).

    Returns a one-rank grid without initialising anything when ``tp * sp`` is 1 and the process
    was not started by torchrun. ``command``: the ``treeattn`` sub-command the error messages
    name.

    Raises
    ------
    ValueError
        ``tp * sp > 1`` outside torchrun, or torchrun started another number of processes.
    """
    if tp < 1 or sp < 1:
        raise ValueError(f"--tp and --sp must be >= 1, got --tp {tp} --sp {sp}")
    world = tp * sp
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is None or "RANK" not in os.environ:
        if world > 1:
            raise ValueError(f"--tp {tp} --sp {sp} needs {world} processes started by torchrun: "
                             f"torchrun --nproc-per-node {world} -m treeattn.cli {command} ...")
        return Grid(0, 1, None, None, 0)
    if int(env_world) != world:
        raise ValueError(f"--tp {tp} x --sp {sp} = {world} ranks, but torchrun started {env_world} processes")
    if not dist.is_initialized():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return make_grid(tp, sp)
