"""Tree-decoding engine on Llama-family models, with treeattn as the decode attention.

DeFT's system (App. A.1): a branch controller (:mod:`.controller`, :mod:`.beam`,
:mod:`.workloads`) drives the sequence tree manager (:mod:`.tree_manager`), which keeps the KV
cache manager (:mod:`.kv`, over :class:`treeattn.KVPool`) in step; the model interface
(:mod:`.model`, :mod:`.engine`) runs prefill with causal SDPA and decode steps with
:class:`treeattn.TreeAttention`.
"""
from treeattn.engine.beam import BeamSearchController
from treeattn.engine.config import PRESETS, ModelConfig, load_config
from treeattn.engine.controller import BranchController, Callbacks, SamplingController, periodic_branching
from treeattn.engine.engine import StepStats, TreeEngine
from treeattn.engine.kv import KVCacheManager
from treeattn.engine.model import TreeModel
from treeattn.engine.sampling import Sampler
from treeattn.engine.tree_manager import Result, SequenceTree

__all__ = [
    "PRESETS", "BeamSearchController", "BranchController", "Callbacks", "KVCacheManager", "ModelConfig",
    "Result", "Sampler", "SamplingController", "SequenceTree", "StepStats", "TreeEngine", "TreeModel",
    "load_config", "periodic_branching",
]
