"""Per-step pieces of :class:`~treeattn.engine.engine.TreeEngine`: its host-side step statistics,
its decode window, and a step's attention as :class:`~treeattn.engine.graphs.DecodeGraphs` calls
it (eager, or one captured :class:`~treeattn.engine.graphs.AttentionGraph` replayed per layer)."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

log = logging.getLogger(__name__)

__all__ = ["StepAttention", "StepStats", "Window"]


@dataclass
class StepStats:
    """Host-side numbers of one decode / verify step (no device synchronisation).

    ``kv_ms``: tree and KV-cache bookkeeping; ``plan_ms``: attention planning and its upload
    (0 when a decode window reused its plan); ``forward_ms``: issuing the forward pass (its wall
    time when the engine synchronises); ``kv_bytes``: KV bytes one layer's attention loads under
    the step's plan (``plan.io.kv``); ``visible_tokens``: KV tokens the step's queries see, summed
    over queries (what attention without prefix sharing reads); ``unique_tokens``: distinct KV
    tokens they see (what attention that reads each shared token once reads).
    """

    step: int
    kind: str
    queries: int
    tree_nodes: int
    tree_tokens: int
    strategy: str
    kv_ms: float
    plan_ms: float
    forward_ms: float
    computed: bool
    kv_bytes: int = 0
    visible_tokens: int = 0
    unique_tokens: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Window:
    """A decode window: ``plan`` serves the next ``left`` steps of ``nodes``."""

    nodes: tuple
    plan: object
    left: int
    expect: list       # own tokens each node must hold before the next step
    tokens: int        # KV tokens of the planned tree
    above: tuple       # (visible, unique) KV tokens of the nodes above the queried leaves


class StepAttention:
    """A decode step's attention for :class:`DecodeGraphs`: ``attend(layer, q, out)`` runs one
    layer eagerly; ``for_step(q, out)`` captures the step's :class:`AttentionGraph` once per plan
    and returns ``layer -> None`` that replays the layer's (eager layers when there is none or
    capture fails).

    ``plan`` serves the full-attention layers and, when ``sliding`` is None, the sliding-window
    layers too; ``sliding`` is the plan of the tree of the sliding windows
    (:func:`~treeattn.tree.window.window_tree`)."""

    def __init__(self, engine, plan, sliding=None):
        self.engine, self.plan, self.sliding = engine, plan, sliding
        c = engine.model.config
        self.sm_scale = c.sm_scale
        self.plans = [sliding if sliding is not None and c.layer_window(layer) is not None else plan
                      for layer in range(c.num_layers)]

    def __call__(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        e = self.engine
        e._fire("attn_begin", layer)
        o = e.attention.run(q, *e._paged[layer], self.plans[layer], out=out, sm_scale=self.sm_scale)
        e._fire("attn_end", layer)
        return o

    def for_step(self, q: torch.Tensor, out: torch.Tensor):
        e = self.engine
        graphs, runner = None, e._attn_graph
        if runner is not None:
            try:
                graphs = {id(p): runner.capture(e.attention, q, out, p, sm_scale=self.sm_scale)
                          for p in {id(p): p for p in self.plans}.values()}
            except RuntimeError as err:  # eager attention is always correct
                log.warning("capturing the attention graph failed (%s); attention runs eagerly", err)
                e._attn_graph = None
        if graphs is None:
            return lambda layer: self(layer, q, out)
        by_layer = [graphs[id(p)] for p in self.plans]

        def replay(layer: int) -> None:
            e._fire("attn_begin", layer)
            runner.replay(by_layer[layer])
            e._fire("attn_end", layer)
        return replay
