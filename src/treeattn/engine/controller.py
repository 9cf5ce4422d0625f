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

import numpy as np
import torch

from treeattn.engine.planning import upload
from treeattn.engine.sampling import Sampler, sample_streams

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


class _Snapshot:
    """The device's finish steps of a batch's rows, copied to the host without blocking."""

    def __init__(self, finish: torch.Tensor, nodes: tuple):
        self.nodes = nodes
        if finish.device.type == "cuda":
            self.host = torch.empty(finish.shape, dtype=finish.dtype, pin_memory=True)
            self.host.copy_(finish, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = finish.clone(), None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def values(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class SamplingController(BranchController):
    """Sample ``n`` continuations of each prompt (a forest when there are several prompts).

    Parameters
    ----------
    prompts : list of list of int
        Token ids; each prompt becomes a root whose KV all its samples share.
    n : int
        Samples per prompt (the root branches into ``n`` leaves before the first step).
    sampler : Sampler, optional
        Default: temperature 1, seed 0. Sample ``j`` of a prompt draws from the random stream
        :func:`~treeattn.engine.sampling.sample_streams` gives it (leaves a callback branches off
        it from streams derived from its own), so its tokens do not depend on the other
        sequences decoded with it.
    max_new_tokens : int
        Decode steps.
    eos_token_ids : sequence of int
        A sample that draws one of them is finished: it is fed that token, and from then on fed
        ``eos_token_ids[0]`` (those steps are discarded) until the next prune point, where its
        result (tokens up to its first EOS, the logits after it) is stored and its leaf pruned.
    callbacks : Callbacks, optional
        With ``eos_token_ids``, leaves that finished since the last prune point still look active
        to them.
    prune_every : int
        Steps between prune points. Whether a sample finished is only known on the device; every
        ``prune_every`` steps the controller copies the finished flags to the host without
        waiting, and prunes those leaves once the copy has landed (at the latest at the next prune
        point). 1 prunes every step (a host synchronisation per step).
    logprobs : bool
        Record the log-probability of every generated token (:meth:`Sampler.logprobs`).
    forced_lengths : int array ``[len(prompts), n]``, optional
        Sample ``j`` of prompt ``i`` is fed ``eos_token_ids[0]`` as its ``forced_lengths[i, j]``-th
        generated token (workload replays: random weights never emit EOS on their own); values
        outside ``[1, max_new_tokens]`` force nothing.
    """

    def __init__(self, prompts, *, n: int = 1, sampler: Sampler | None = None, max_new_tokens: int = 16,
                 eos_token_ids=(), callbacks: Callbacks | None = None, prune_every: int = 8,
                 logprobs: bool = False, forced_lengths=None):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if n < 1 or max_new_tokens < 0:
            raise ValueError(f"n must be >= 1 and max_new_tokens >= 0, got {n}, {max_new_tokens}")
        if prune_every < 1:
            raise ValueError(f"prune_every must be >= 1, got {prune_every}")
        self.prompts = [[int(t) for t in p] for p in prompts]
        self.n, self.max_new_tokens = n, max_new_tokens
        self.sampler = sampler or Sampler()
        self.eos = tuple(dict.fromkeys(int(e) for e in eos_token_ids))
        self.cb = callbacks or Callbacks()
        self.prune_every = int(prune_every)
        self.logprobs = bool(logprobs)
        self.forced = None
        if forced_lengths is not None:
            self.forced = np.asarray(forced_lengths, dtype=np.int64)
            if self.forced.shape != (len(self.prompts), n):
                raise ValueError(f"forced_lengths must have shape ({len(self.prompts)}, {n}), "
                                 f"got {self.forced.shape}")
            if not self.eos:
                raise ValueError("forced_lengths needs eos_token_ids (the token it forces)")

    def query_counts(self) -> list:
        total = self.n * len(self.prompts)
        if self.cb.branch is not None:
            return []               # (branching: the counts are the callbacks' to decide)
        # rows only leave (EOS, pruning callbacks): every smaller batch can come
        return list(range(1, total + 1)) if self.eos or self.cb != Callbacks() else [total]

    def start(self, engine) -> None:
        tree, seed = engine.tree, self.sampler.seed
        leaves, streams, forced = [], {}, []
        for i, prompt in enumerate(self.prompts):
            root = tree.add_root({"prompt": i} if self.n > 1 else {"prompt": i, "sample": 0})
            engine.prefill(root, prompt)
            kids = tree.branch(root, self.n, [{"sample": j} for j in range(self.n)]) if self.n > 1 else [root]
            streams.update(zip(kids, sample_streams(seed, prompt, self.n).tolist()))
            leaves.extend(kids)
            if self.forced is not None:
                forced.extend(self.forced[i].tolist())
        d = engine.device
        self._streams = streams                # node -> its random stream (host)
        self._rows = tuple(leaves)             # the nodes the device state's rows belong to
        self._stream = upload(np.asarray([streams[n] for n in leaves]), d)
        self._stop = upload(np.asarray(forced), d) if self.forced is not None else None
        self._eos = upload(np.asarray(self.eos), d) if self.eos else None
        self._finish = torch.full((len(leaves),), -1, dtype=torch.int64, device=d)   # step of the 1st EOS
        self._final = None                     # float32 [rows, V]: logits after each row's 1st EOS
        self._cum = torch.zeros(len(leaves), dtype=torch.float32, device=d)
        self._lp_steps: list = []              # float32 [rows] of every step
        self._lp_refs: dict = {n: [] for n in leaves}   # node -> (step, row) of its generated tokens
        self._pending: _Snapshot | None = None
        self._announced = False                # the engine knows the next prune point's leaves

    # ------------------------------------------------------------------ rows
    def _sync_rows(self, engine, leaves: list) -> None:
        """Re-align the device state with ``leaves``: a leaf a callback branched off a row inherits
        that row's state and a stream derived from its stream."""
        if tuple(leaves) == self._rows:
            return
        tree = engine.tree
        pos = {n: i for i, n in enumerate(self._rows)}
        idx = []
        for leaf in leaves:
            node = leaf
            while node not in pos:
                node = tree.parent(node)
            idx.append(pos[node])
            if leaf not in self._streams:
                parent = tree.parent(leaf)
                k = tree.children(parent).index(leaf)
                self._streams[leaf] = int(sample_streams(self._streams[parent], [k], 1)[0])
                self._lp_refs[leaf] = list(self._lp_refs[parent])
        d = engine.device
        sel = upload(np.asarray(idx), d)
        self._stream = upload(np.asarray([self._streams[n] for n in leaves]), d)
        self._finish = self._finish.index_select(0, sel)
        self._cum = self._cum.index_select(0, sel)
        if self._stop is not None:
            self._stop = self._stop.index_select(0, sel)
        if self._final is not None:
            self._final = self._final.index_select(0, sel)
        self._rows = tuple(leaves)

    # ------------------------------------------------------------------ finishing
    def _poll(self, engine, step: int, *, final: bool = False) -> None:
        """At prune points, prune the leaves the last snapshot shows finished and take a new
        snapshot (``final``: wait for everything, the run stops). Between them, once the
        snapshot has landed, tell the engine which leaves the next prune point keeps, so that it
        plans that window in the background; pruning them as soon as it lands instead would
        break the current window and plan on the critical path."""
        point = final or (step > 0 and step % self.prune_every == 0)
        if point:
            if self._pending is not None:
                self._apply(engine, self._pending, step)
            self._pending = _Snapshot(self._finish, self._rows)
            self._announced = False
        if final:
            self._apply(engine, self._pending, step)
            self._pending = None
        elif not (point or self._announced) and self.cb == Callbacks() and (
                self._pending is None or self._pending.ready()):
            nxt = step + self.prune_every - step % self.prune_every
            done = set() if self._pending is None else {
                n for n, first in zip(self._pending.nodes, self._pending.values()) if first >= 0}
            keep = [n for n in self._rows if n not in done]
            self._announced = nxt >= self.max_new_tokens or not keep or engine.plan_ahead(
                keep, min(self.prune_every, self.max_new_tokens - nxt), after=nxt - step)

    def _apply(self, engine, snap: _Snapshot, step: int) -> None:
        """Finish and prune the leaves ``snap`` shows finished, before decode step ``step``."""
        tree = engine.tree
        row = {n: i for i, n in enumerate(self._rows)}
        for node, first in zip(snap.nodes, snap.values()):
            if first < 0 or node not in row or node not in tree:   # running, or pruned / branched since
                continue
            # generated tokens: steps 0 .. first; those fed after the first EOS are dropped
            res = tree.finish(node, reason="eos", logits=self._final[row[node]].clone(),
                              prompt=_root_meta(tree, node, "prompt"), sample=_root_meta(tree, node, "sample"),
                              logprob_refs=self._lp_refs[node][: first + 1])
            res.tokens = res.tokens[: len(res.tokens) - (step - 1 - first)]
            tree.prune(node)

    # ------------------------------------------------------------------ steps
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

    def _steps_to_event(self, step: int) -> int:
        """Steps from ``step`` on (this one included) before the controller may change the batch."""
        return self.prune_every - step % self.prune_every if self.eos else self.max_new_tokens - step

    def _before_step(self, engine, step: int) -> None:
        """A subclass's decisions before step ``step`` (after the prune points)."""

    def step(self, engine, step: int) -> bool:
        tree = engine.tree
        if self.eos:
            self._poll(engine, step)
        self._before_step(engine, step)
        if step >= self.max_new_tokens or not self._apply_callbacks(tree, step):
            self._stop_now(engine, step)
            return False
        leaves = tree.active()
        if not leaves:
            return False
        self._sync_rows(engine, leaves)
        logits = engine.logits_for(leaves)
        # (the draw and the log-probabilities' normaliser from one pass over the logits; top-k /
        # top-p, which sort the vocabulary, filter once for both)
        if self.logprobs:
            tokens, norm = self.sampler.draw(logits, streams=self._stream, step=step)
        else:
            tokens = self.sampler.sample(logits, streams=self._stream, step=step)
        running = self._finish < 0
        if self.eos:
            if self._stop is not None:
                tokens = torch.where(self._stop == step + 1, self.eos[0], tokens)
            tokens = torch.where(running, tokens, self.eos[0])
            hit = running & (tokens[:, None] == self._eos[None, :]).any(-1)
            self._finish = torch.where(hit, step, self._finish)
        if self.logprobs:
            lp = self.sampler.logprobs(logits, tokens, norm=norm)
            self._cum = self._cum + torch.where(running, lp, 0.0)
            for i, leaf in enumerate(leaves):
                self._lp_refs[leaf].append((len(self._lp_steps), i))
            self._lp_steps.append(lp)
        left = self.max_new_tokens - step
        if self.cb != Callbacks() and self.cb.horizon is None:
            horizon = 1
        else:
            horizon = min(left, self._steps_to_event(step))
            if self.cb.horizon is not None:
                horizon = min(horizon, self.cb.horizon(tree, step))
        out = engine.decode(leaves, tokens, horizon=horizon)
        if self.eos:
            if self._final is None:
                self._final = torch.zeros_like(out)
            self._final = torch.where(hit[:, None], out, self._final)
        return True

    def _stop_now(self, engine, step: int) -> None:
        """Decoding stops before step ``step``: finish the leaves that drew an EOS."""
        if self.eos and engine.tree.active():
            self._sync_rows(engine, engine.tree.active())
            self._poll(engine, step, final=True)

    def result(self, engine) -> dict:
        """``{"leaves": [{"node", "prompt", "sample", "tokens", "logits", "logprobs", "finished"}]}``:
        every finished and every still active leaf (tokens include the prompt; logits: float32
        ``[vocab]`` after the last token; logprobs: one per generated token, None unless
        ``logprobs``)."""
        tree = engine.tree
        host = torch.cat(self._lp_steps).tolist() if self._lp_steps else []
        starts = np.cumsum([0] + [t.numel() for t in self._lp_steps]).tolist()

        def lps(refs):
            return [host[starts[s] + i] for s, i in refs] if self.logprobs else None

        out = {}
        for res in tree.results:
            out[res.node] = {"node": res.node, "prompt": res.info.get("prompt"), "sample": res.info.get("sample"),
                             "tokens": tree.result_tokens(res), "logits": res.info.get("logits"),
                             "logprobs": lps(res.info.get("logprob_refs", [])), "finished": True}
        for leaf in tree.active():
            out[leaf] = {"node": leaf, "prompt": _root_meta(tree, leaf, "prompt"),
                         "sample": _root_meta(tree, leaf, "sample"), "tokens": tree.tokens(leaf),
                         "logits": engine.logits_of(leaf), "logprobs": lps(self._lp_refs.get(leaf, [])),
                         "finished": False}
        return {"leaves": [out[k] for k in sorted(out)]}

    def running_logprobs(self) -> torch.Tensor:
        """float32 ``[rows]`` on the device: each row's summed log-probability so far (its tokens
        after a first EOS excluded), rows in the order of the last step's leaves."""
        return self._cum


def _root_meta(tree, node: int, key: str):
    """``key`` of the nearest node on ``node``'s path to its root that has it (None if none)."""
    while node is not None:
        meta = tree.meta(node)
        if key in meta:
            return meta[key]
        node = tree.parent(node)
    return None
