"""Tree-decoding engine on Llama-family models, with treeattn as the decode attention.

DeFT's system (App. A.1): a branch controller (:mod:`.controller`, :mod:`.beam`,
:mod:`.workloads`) drives the sequence tree manager (:mod:`.tree_manager`), which keeps the KV
cache manager (:mod:`.node_slots`, over :class:`treeattn.KVPool`) in step; the model interface
(:mod:`.model`, :mod:`.engine`) runs prefill with causal SDPA and decode steps with
:class:`treeattn.TreeAttention`.

>>> model = TreeModel.from_pretrained("Meta-Llama-3-8B", device="cuda", dtype=torch.bfloat16)
>>> engine = TreeEngine(model, strategy="auto")
>>> outs = engine.generate(["Once upon a time", "def fib(n):"], n=8, temperature=0.8, seed=0,
...                        max_new_tokens=256)
>>> best = engine.beam_search("Translate to French: cheese", num_beams=8, max_new_tokens=32)
>>> out = engine.run(SamplingController([prompt_ids], n=8, max_new_tokens=256,
...                                     callbacks=periodic_branching(32, factor=2, max_leaves=64)))
"""
from treeattn.engine.beam import BeamSearchController
from treeattn.engine.config import PRESETS, ModelConfig, load_config
from treeattn.engine.controller import BranchController, Callbacks, SamplingController, periodic_branching
from treeattn.engine.engine import TreeEngine
from treeattn.engine.generate import BeamSearchOutput, GenerationOutput, SampleOutput
from treeattn.engine.node_slots import KVCacheManager
from treeattn.engine.model import TreeModel
from treeattn.engine.parallel import TensorParallel
from treeattn.engine.sampling import Sampler
from treeattn.engine.step import StepStats
from treeattn.engine.tree_manager import Result, SequenceTree
from treeattn.engine.workloads import (WORKLOADS, BestOfNController, SpeculativeReplayController,
                                       ToTReplayController, WorkloadSpec, build_workload)

__all__ = [
    "PRESETS", "WORKLOADS", "BeamSearchController", "BeamSearchOutput", "BestOfNController", "BranchController",
    "Callbacks", "GenerationOutput", "KVCacheManager", "ModelConfig", "Result", "SampleOutput", "Sampler",
    "SamplingController", "SequenceTree", "SpeculativeReplayController", "StepStats", "TensorParallel",
    "ToTReplayController", "TreeEngine", "TreeModel", "WorkloadSpec", "build_workload", "load_config",
    "periodic_branching",
]
