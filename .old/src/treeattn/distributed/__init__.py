"""Multi-GPU decode: KV sharded across ranks of ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

* :func:`sharded_attention` / :class:`ShardedAttention`: one context's KV in contiguous slices,
  merged by Tree Attention (``method="tree"``: max all-reduce + one packed sum all-reduce) or the
  Ring Attention baseline (``method="ring"``).
* :func:`shard_tree` / :func:`sharded_tree_attention`: a decoding tree's KV split in balanced
  depth-first ranges, each rank's part planned prefix-aware.
* Engine entry points: :func:`plan_local` (a rank's local tree part -> :class:`LocalPlan`),
  :func:`sharded_decode` (per layer: local attention + all-reduce merge).
* :func:`comm_volume`, :func:`peak_memory`: the paper's eqs. 8-14; :class:`CommStats` records
  what is actually communicated.

Run under ``torchrun --nproc-per-node N`` (or any launcher that initialises the process group).
"""
from treeattn.distributed.combine import allreduce_merge, merge_running
from treeattn.distributed.comm import CommRecord, CommStats
from treeattn.distributed.formulas import comm_volume, peak_memory
from treeattn.distributed.local import LocalPlan, plan_local, plan_sequence_shard, run_local
from treeattn.distributed.sharded import METHODS, ShardedAttention, ShardPlan, sharded_attention
from treeattn.distributed.tree_shard import (LocalTreePart, local_tree_part, plan_tree_shard, shard_tree,
                                             sharded_decode, sharded_tree_attention)

__all__ = [
    "METHODS", "CommRecord", "CommStats", "LocalPlan", "LocalTreePart", "ShardPlan",
    "ShardedAttention", "allreduce_merge", "comm_volume", "local_tree_part", "merge_running",
    "peak_memory", "plan_local", "plan_sequence_shard", "plan_tree_shard", "run_local",
    "shard_tree", "sharded_attention", "sharded_decode", "sharded_tree_attention",
]
