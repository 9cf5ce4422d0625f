"""Branch controllers (DeFT App. A.1): they decide, step by step, when and how the decoding tree
branches, which branches are pruned, what every leaf feeds next and when decoding stops.

* :class:`BranchController` -- the interface the engine drives.
* :class:`Callbacks` -- user functions deciding branch / prune / stop, for
  :class:`SamplingController`; :func:`periodic_branching` builds the classic "branch every k steps".
* :class:`SamplingController` -- parallel sampling of ``n`` sequences per prompt (several prompts
  make a forest), with optional user callbacks and EOS handling.

Beam search lives in :mod:`treeattn.engine.beam`, the workload replays in
:mod:`treeattn.engine.workloads`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from treeattn.engine.sampling import Sampler

__all__ = ["BranchController", "Callbacks", "SamplingController", "periodic_branching"]


class BranchController:
    """What the engine calls: :meth:`start` once, :meth:`step` until it returns False, then
    :meth:`result`. A step changes the tree through ``engine.tree`` (branch / prune / finish) and
    runs exactly one model step (``engine.decode`` or ``engine.verify``), or none to stop."""

    def start(self, engine) -> None:
        """Create the roots and prefill their prompts."""
        raise NotImplementedError

    def step(self, engine, step: int) -> bool:
        """Decide and run decode step ``step``; False stops decoding."""
        raise NotImplementedError

    def result(self, engine) -> dict:
        """The outcome, read once decoding stopped."""
        return {}

    def query_counts(self) -> list:
        """Numbers of queries its steps can have, when known up front (lets the engine capture
        CUDA graphs before decoding)."""
        return []


@dataclass
class Callbacks:
    """User-defined tree control for :class:`SamplingController`, called before every step.

    Attributes
    ----------
    branch : callable ``(tree, node, step) -> int``, optional
        Children to split active leaf ``node`` into (``< 2``: keep it as it is).
    prune : callable ``(tree, node, step) -> bool``, optional
        Whether to prune active leaf ``node`` (its KV is freed).
    stop : callable ``(tree, step) -> bool``, optional
        Whether to stop decoding now.
    horizon : callable ``(tree, step) -> int``, optional
        For how many steps from ``step`` on the callbacks leave the tree alone (lets the engine
        plan several steps at once); without it every step is planned on its own.
    """

    branch: Callable | None = None
    prune: Callable | None = None
    stop: Callable | None = None
    horizon: Callable | None = None


def periodic_branching(every: int, factor: int = 2, max_leaves: int = 64) -> Callbacks:
    """Split every active leaf into ``factor`` children each ``every`` steps (DeFT Fig. 5) while
    the tree stays within ``max_leaves`` active leaves."""
    if every < 1 or factor < 2:
        raise ValueError(f"periodic branching needs every >= 1 and factor >= 2, got {every}, {factor}")

    def branch(tree, node, step):
        due = step > 0 and step % every == 0
        return factor if due and len(tree.active()) + factor - 1 <= max_leaves else 1

    def horizon(tree, step):
        return every - step % every

    return Callbacks(branch=branch, horizon=horizon)


class SamplingController(BranchController):
    """Sample ``n`` continuations of each prompt (a forest when there are several prompts).

    Parameters
    ----------
    prompts : list of list of int
        Token ids; each prompt becomes a root whose KV all its samples share.
    n : int
        Samples per prompt (the root branches into ``n`` leaves before the first step).
    sampler : Sampler, optional
        Default: temperature 1, seed 0.
    max_new_tokens : int
        Decode steps.
    eos_token_ids : sequence of int
        A leaf that samples one of them is fed it, then finished (its result stored) and pruned
        (reading the tokens synchronises every step; leave empty for fully asynchronous decoding).
    callbacks : Callbacks, optional
    """

    def __init__(self, prompts, *, n: int = 1, sampler: Sampler | None = None, max_new_tokens: int = 16,
                 eos_token_ids=(), callbacks: Callbacks | None = None):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if n < 1 or max_new_tokens < 0:
            raise ValueError(f"n must be >= 1 and max_new_tokens >= 0, got {n}, {max_new_tokens}")
        self.prompts = [[int(t) for t in p] for p in prompts]
        self.n, self.max_new_tokens = n, max_new_tokens
        self.sampler = sampler or Sampler()
        self.eos = set(int(e) for e in eos_token_ids)
        self.cb = callbacks or Callbacks()

    def query_counts(self) -> list:
        return [] if self.cb != Callbacks() or self.eos else [self.n * len(self.prompts)]

    def start(self, engine) -> None:
        for i, prompt in enumerate(self.prompts):
            root = engine.tree.add_root({"prompt": i})
            engine.prefill(root, prompt)
            if self.n > 1:
                engine.tree.branch(root, self.n)

    def _apply_callbacks(self, tree, step: int) -> bool:
        cb = self.cb
        if cb.prune is not None:
            for leaf in tree.active():
                if leaf in tree and cb.prune(tree, leaf, step):
                    tree.prune(leaf)
        if cb.branch is not None:
            for leaf in tree.active():
                k = int(cb.branch(tree, leaf, step))
                if k >= 2:
                    tree.branch(leaf, k)
        return not (cb.stop is not None and cb.stop(tree, step))

    def step(self, engine, step: int) -> bool:
        tree = engine.tree
        if step >= self.max_new_tokens or not self._apply_callbacks(tree, step):
            return False
        leaves = tree.active()
        if not leaves:
            return False
        tokens = self.sampler(engine.logits_for(leaves))
        left = self.max_new_tokens - step
        if self.eos or (self.cb != Callbacks() and self.cb.horizon is None):
            horizon = 1
        else:
            horizon = min(left, self.cb.horizon(tree, step)) if self.cb.horizon else left
        engine.decode(leaves, tokens, horizon=horizon)
        if self.eos:
            for leaf, t in zip(leaves, tokens.tolist()):
                if t in self.eos:      # store the result, then free the leaf's KV
                    tree.finish(leaf, reason="eos", logits=engine.logits_of(leaf),
                                prompt=_prompt_index(tree, leaf))
                    tree.prune(leaf)
        return True

    def result(self, engine) -> dict:
        """``{"leaves": [{"node", "prompt", "tokens", "logits", "finished"}]}``: every finished
        and every still active leaf (tokens include the prompt; logits: float32 ``[vocab]``
        after the last token)."""
        tree = engine.tree
        out = {}
        for res in tree.results:
            out[res.node] = {"node": res.node, "prompt": res.info.get("prompt"),
                             "tokens": tree.result_tokens(res), "logits": res.info.get("logits"),
                             "finished": True}
        for leaf in tree.active():
            out[leaf] = {"node": leaf, "prompt": _prompt_index(tree, leaf), "tokens": tree.tokens(leaf),
                         "logits": engine.logits_of(leaf), "finished": False}
        return {"leaves": [out[k] for k in sorted(out)]}


def _prompt_index(tree, node: int):
    while tree.parent(node) is not None:
        node = tree.parent(node)
    return tree.meta(node).get("prompt")
