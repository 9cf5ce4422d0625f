"""treeattn: prefix-aware tree attention for tree-structured LLM decoding.

Pipeline: a :class:`DecodingTree` (from parents and lengths, workload files, or a :class:`KVPool`)
-> a planner (:data:`STRATEGIES`) -> a :class:`Plan` of int32 index tensors -> Triton kernels that
read every shared KV token once and merge partial results with log-sum-exp.
"""
import importlib.metadata

from treeattn.api import BACKENDS, TreeAttention, merge_states, tree_attention
from treeattn.paged_kv import KVPool, KVPoolOutOfMemory
from treeattn.plan import STRATEGIES, CostModel, HeadConfig, Plan, PlanIO, make_plan
from treeattn.reference import reference_attention
from treeattn.tree import DecodingTree

try:
    __version__ = importlib.metadata.version("treeattn")
except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed: no metadata to read
    __version__ = "0+unknown"

__all__ = [
    "BACKENDS", "STRATEGIES", "CostModel", "DecodingTree", "HeadConfig", "KVPool",
    "KVPoolOutOfMemory", "Plan", "PlanIO", "TreeAttention", "make_plan", "merge_states",
    "reference_attention", "tree_attention",
]
