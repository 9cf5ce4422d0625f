"""The tree-decoding engine: model interface + KV cache manager + sequence tree manager, driven by a
branch controller (DeFT App. A.1).

:meth:`TreeEngine.decode` is one decode step: one new token for each of a set of leaves, written
to the paged KV pool, then every layer attends over the decoding tree with treeattn (one plan per
step, or per *decode window* of several steps; sliding-window layers attend over the tree of the
tokens in their windows, planned every step in which some path is longer than the window).
:meth:`TreeEngine.verify` is one speculative
verification step (:mod:`treeattn.engine.speculative`): a draft token tree below a leaf, queried
as tree-structured queries. Nothing
in a step waits for the GPU, so the host prepares step ``t + 1`` while the GPU runs step ``t``; it
waits only before running further ahead than ``max_inflight`` steps.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import time

import numpy as np
import torch

from treeattn import DecodingTree, HeadConfig, KVPool, KVPoolOutOfMemory, TreeAttention
from treeattn.engine.graphs import AttentionGraph, DecodeGraphs
from treeattn.engine.node_slots import KVCacheManager
from treeattn.engine.planning import StepPlanner, upload
from treeattn.engine.speculative import SpeculativeSteps
from treeattn.engine.step import StepAttention, StepStats, Window
from treeattn.engine.tree_manager import SequenceTree
from treeattn.tree.window import window_tree

__all__ = ["TreeEngine"]

log = logging.getLogger(__name__)


def _window_tokens(dtree: DecodingTree) -> tuple:
    """A decode window's KV token counts for its step statistics: the planned tree's tokens, and
    the (visible, unique) tokens of the nodes above the queried leaves."""
    leaf = int(dtree.query_prefix.sum())      # the leaves' own tokens and reserved slots
    return dtree.num_tokens, (int(dtree.visible_tokens.sum()) - leaf, dtree.num_tokens - leaf)


class _QueuedPrefill:
    """A prefill whose forward pass waits for :meth:`TreeEngine.flush_prefill`: the chain of
    ``nodes`` (the first may be an existing leaf it extends) holding ``counts`` of the new tokens
    each; ``want``: store the logits of its last token."""

    __slots__ = ("nodes", "counts", "ids", "pos", "slots", "ctx", "want")

    def __init__(self, nodes, counts, ids, pos, slots, ctx):
        self.nodes, self.counts, self.ids, self.pos, self.slots, self.ctx = nodes, counts, ids, pos, slots, ctx
        self.want = True


class TreeEngine(SpeculativeSteps):
    """Tree decoding over one model.

    Parameters
    ----------
    model : TreeModel
    strategy : str
        treeattn strategy for every decode step (:data:`treeattn.STRATEGIES`).
    page_size : int
    kv_tokens : int
        KV pool capacity in tokens.
    backend : {"auto", "triton", "torch"}
        TreeAttention backend ("auto": Triton on CUDA, PyTorch on CPU).
    cuda_graphs : bool, optional
        Piecewise CUDA graphs for the non-attention part (default: on for CUDA; always off for a
        tensor-parallel model).
    window : int
        Longest decode window (steps planned at once when the controller promises a fixed set
        of leaves); 1 plans every step.
    auto_refresh : int
        See :class:`~treeattn.engine.planning.StepPlanner`.
    pdl : bool or None
        Attention launches as programmatic dependent launches (:class:`~treeattn.TreeAttention`);
        None (default): on Hopper and later GPUs with the Triton backend. Measured on an H200
        (``bench e2e``): ``auto``'s attention 4.6-17% less time a step.
    synchronize : bool
        Wait for the device after every step (accurate per-step wall times, no overlap).
    keep_reserved : bool
        Keep a node's unused decode-window slots when its window ends early (a new request joins
        a served batch) and use them for its next tokens, instead of leaving them unused.
    max_inflight : int or None
        On a GPU, the host enqueues a step's forward pass only once the step ``max_inflight``
        steps before it has finished, so at most that many forward passes are queued at once;
        None: no bound (the host runs as far ahead as CUDA's queues let it). Default 2: the host
        still plans and enqueues a step while the GPU runs the one before, and back-to-back steps
        run at their isolated GPU time. Unbounded, the host (2-3 ms a ToT step) ran many steps
        ahead of the GPU (5.6 ms), and the GPU took 5-12% longer a step than in isolation
        (measured on an H200).
    precompile : bool or None
        Compile every attention-kernel variant the model's plans can take when the engine is
        created (:meth:`precompile_kernels`), so that no decode step waits for Triton's JIT and
        a first run is as fast as the second. None (default): on a GPU with the Triton backend.
    compile_workers : int or None
        Processes that :meth:`precompile_kernels` compiles in on a GPU (each holds a CUDA context
        while it runs; 0: this process); None: one a CPU core, up to 16. 408 variants of
        Llama-3-8B took 54-65 s with 14 on an H100 host, over 393 s in one process.
    graph_tokens : int
        With ``precompile``, the CUDA graphs of decode steps of up to this many new tokens are
        captured at creation too (:meth:`prepare_graphs`; larger steps capture theirs at their
        first run). On an H200 (8B shape) the 13 buckets of 1-128 tokens took 3.2 s; a first
        beam search that captured its own 4-token graphs paid 92 ms in its run (0.50 s against
        0.42 s for the second).
    prefill_tokens : int
        Inside :meth:`batched_prefill`, the queued prefills run as soon as they hold this many new
        tokens, which bounds one pass's activations (a longer prompt still runs in one pass).
    """

    def __init__(self, model, *, strategy: str = "auto", page_size: int = 16, kv_tokens: int = 65536,
                 backend: str = "auto", cuda_graphs: bool | None = None, window: int = 16,
                 auto_refresh: int = 32, synchronize: bool = False, keep_reserved: bool = False,
                 pdl: bool | None = None, max_inflight: int | None = 2,
                 compile_workers: int | None = None, precompile: bool | None = None,
                 graph_tokens: int = 128, prefill_tokens: int = 8192):
        c = model.config
        self.model, self.device = model, model.device
        self.pool = KVPool(-(-kv_tokens // page_size) + 2, page_size, model.num_kv_heads, c.head_dim,
                           num_layers=c.num_layers, dtype=model.dtype, device=model.device)
        self.kv = KVCacheManager(self.pool)
        self.tree = SequenceTree(self.kv)
        self._paged = [(self.pool.k_cache(l), self.pool.v_cache(l)) for l in range(c.num_layers)]
        self.strategy = strategy
        self.backend = backend
        self._workspace = None
        # no side streams: destroying a graph with side-stream branches waits for its queued
        # replays (benchmarks/attention_graph_cost.py), and the engine drops one every step
        self.attention = TreeAttention(device=model.device, backend=backend, streams=0, pdl=pdl)
        # (its cost model rates launches one after another without PDL, overlapping with it)
        heads = HeadConfig(model.num_heads, model.num_kv_heads, c.head_dim, model.dtype)
        self.planner = StepPlanner(heads, strategy=strategy, device=model.device, auto_refresh=auto_refresh,
                                   cost=self.attention.cost)
        # the planning thread's own planner (:meth:`plan_ahead`): a step never waits for it
        self._ahead_planner = StepPlanner(heads, strategy=strategy, device=model.device,
                                          auto_refresh=auto_refresh, cost=self.attention.cost)
        #: the sliding window of the model's sliding-window layers (None: it has none)
        self.sliding_window = c.sliding_window if "sliding_attention" in c.layer_types else None
        # sliding layers' trees change their window start every step: their own planner keeps
        # the full layers' patching and `auto` decisions apart
        self.sliding_planner = None if self.sliding_window is None else StepPlanner(
            heads, strategy=strategy, device=model.device, auto_refresh=auto_refresh, cost=self.attention.cost)
        model.ensure_positions(min(c.max_position_embeddings, self.pool.num_slots))
        use_graphs = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        # a tensor-parallel model's collectives are not captured: it runs eagerly
        use_graphs = use_graphs and model.tp is None
        use_graphs = use_graphs and model.device.type == "cuda"
        self._attn_graph = None
        if use_graphs and self.attention.backend == "triton" and self.kv.layer_stride is not None:
            self._attn_graph = AttentionGraph(*self._paged[0], self.kv.layer_stride)
        self.graphs = DecodeGraphs(model, self.kv, layer_counter=None if self._attn_graph is None
                                   else self._attn_graph.counter) if use_graphs else None
        self.window = max(1, int(window))
        self.synchronize = synchronize
        self.keep_reserved = keep_reserved
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1 or None, got {max_inflight}")
        self.max_inflight = max_inflight
        self.compile_workers = min(16, os.cpu_count() or 1) if compile_workers is None else compile_workers
        self._inflight: collections.deque = collections.deque()   # end events of queued forwards
        self.compute = True
        #: profiling hook ``hook(event, layer)``, event in forward_begin / attn_begin / attn_end /
        #: forward_end (layer -1 for the forward events); called where the work is enqueued
        self.hook = None
        self.stats: list[StepStats] = []
        self._logits: dict[int, tuple] = {}
        # prefills whose forward pass is deferred (:meth:`batched_prefill`), and the nesting depth
        self._queued: list[_QueuedPrefill] = []
        self._batching = 0
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.prefill_tokens = int(prefill_tokens)
        self._win: Window | None = None
        # the next decode window, planned on a background thread: (nodes, own tokens at its first
        # step, steps, future host plan, its tree's KV tokens)
        self._ahead: tuple | None = None
        self._planning: concurrent.futures.ThreadPoolExecutor | None = None
        self._verify: tuple | None = None
        self._depth: tuple | None = None
        self._compiled = False
        #: seconds :meth:`precompile_kernels` took and the launches it made in this process (0
        #: until it ran: on a GPU the engine runs it at creation)
        self.compile_s, self.compiled_launches = 0.0, 0
        if precompile or (precompile is None and self.device.type == "cuda"
                          and self.attention.backend == "triton"):
            self.precompile_kernels()
            self.prepare_graphs(range(1, graph_tokens + 1))
            self._warm_model()

    # ------------------------------------------------------------------ logits
    def logits_of(self, node: int) -> torch.Tensor:
        """float32 ``[vocab]``: the model's logits after ``node``'s last token (its nearest ancestor's
        for a node that has no tokens yet)."""
        t, row = self._ref(node)
        return t[row]

    def _ref(self, node: int) -> tuple:
        self.flush_prefill()
        n = node
        while n is not None and n not in self._logits:
            n = self.tree.parent(n)
        if n is None:
            raise ValueError(f"node {node} has no logits yet: prefill its root first")
        return self._logits[n]

    def forget_logits(self, node: int) -> None:
        """Drop the logits stored for ``node`` (a cached prompt prefix nobody samples from), so that
        they do not hold memory while the node stays in the tree. A queued prefill ending at
        ``node`` still writes its KV (:meth:`batched_prefill`)."""
        self._logits.pop(node, None)
        for q in self._queued:
            if q.nodes[-1] == node:
                q.want = False

    def logits_for(self, nodes) -> torch.Tensor:
        """float32 ``[n, vocab]``: :meth:`logits_of` of each node (no host synchronisation)."""
        refs = [self._ref(n) for n in nodes]
        if not refs:
            raise ValueError("logits_for() needs at least one node")
        t0 = refs[0][0]
        if all(t is t0 for t, _ in refs):
            rows = [r for _, r in refs]
            if rows == list(range(t0.shape[0])):
                return t0
            return t0.index_select(0, upload(np.asarray(rows), self.device))
        return torch.stack([t[r] for t, r in refs])

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, self.model.config.vocab_size, dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------------ steps
    def prefill(self, node: int, tokens) -> torch.Tensor | None:
        """Append host token ids to leaf ``node`` with causal SDPA over its path; returns the
        float32 logits ``[vocab]`` after the last one (None inside :meth:`batched_prefill`: the
        forward pass is queued, the logits are :meth:`logits_of` ``node`` afterwards)."""
        if not len(tokens):
            raise ValueError("prefill needs at least one token")
        self._check_vocab(np.asarray(tokens))
        self._close_window()
        ctx = self.tree.path_slots(node)
        slots, pos = self.tree.extend(node, tokens)
        return self._prefill_run([node], [len(tokens)], np.asarray(tokens), pos, slots, ctx)

    def prefill_chain(self, parent: int | None, chunks) -> list:
        """Prefill consecutive token runs as a chain of new nodes below ``parent`` (new roots
        when None) in one forward pass; returns the nodes, the last one holding the logits.

        A prefix cache keeps one node per cached block but should not pay one forward pass per
        block. When the pool runs out of pages the chain is removed and
        :class:`treeattn.KVPoolOutOfMemory` raised (inside :meth:`batched_prefill` as well: only
        the forward pass is queued).
        """
        chunks = [np.asarray(c) for c in chunks]
        if not chunks or any(c.size == 0 for c in chunks):
            raise ValueError("prefill_chain needs non-empty token runs")
        ids = np.concatenate(chunks)
        self._check_vocab(ids)
        self._close_window()
        ctx = self.tree.path_slots(parent) if parent is not None else np.zeros(0, dtype=np.int64)
        nodes, slots, pos = [], [], []
        try:
            for c in chunks:
                top = nodes[-1] if nodes else parent
                nodes.append(self.tree.add_root() if top is None else self.tree.add_children(top, 1)[0])
                s, p = self.tree.extend(nodes[-1], c)
                slots.append(s)
                pos.append(p)
        except Exception:
            for n in reversed(nodes):
                self.tree.prune(n, cascade=False)
            raise
        self._prefill_run(nodes, [c.size for c in chunks], ids, np.concatenate(pos), np.concatenate(slots), ctx)
        return nodes

    @contextlib.contextmanager
    def batched_prefill(self):
        """A block whose prefills (:meth:`prefill`, :meth:`prefill_chain`) share one forward pass.

        Inside it a prefill does its bookkeeping at once (nodes, slots, positions; its errors,
        :class:`treeattn.KVPoolOutOfMemory` among them, are raised as outside) and queues its
        forward pass. Leaving the block, or anything that needs logits or runs a step
        (:meth:`logits_of`, :meth:`decode`, :meth:`verify`, :meth:`run`), runs the queued
        prefills in one pass of :meth:`TreeModel.prefill <treeattn.engine.model.TreeModel.prefill>`
        (:meth:`flush_prefill`): the norms, GEMMs and K/V writes once over all their tokens,
        attention per prefill. A prefill may take as context the tokens of an earlier one in the
        block (two prompts sharing a system prompt cached by the first): every prefill's K/V of a
        layer is written before any of them attends in that layer.

        Tokens whose nodes were pruned before the pass are left out of it (their slots may
        already belong to others). Blocks nest; the outermost one flushes, also when left by an
        exception (the queued nodes are in the tree and need their K/V).
        """
        self._batching += 1
        try:
            yield self
        finally:
            self._batching -= 1
            if not self._batching:
                self.flush_prefill()

    def flush_prefill(self) -> None:
        """Run the forward pass of the queued prefills (:meth:`batched_prefill`) now and store
        their logits; nothing when none are queued."""
        if not self._queued:
            return
        queue, self._queued = self._queued, []
        live = []
        for q in queue:
            alive = 0
            while alive < len(q.nodes) and q.nodes[alive] in self.tree:
                alive += 1
            if alive < len(q.nodes):        # evicted (its last node first) before its pass
                if not alive:
                    continue
                n = sum(q.counts[:alive])
                q.ids, q.pos, q.slots, q.want = q.ids[:n], q.pos[:n], q.slots[:n], False
            live.append(q)
        if not live:
            return
        d = self.device
        logits = self._prefill_model(
            upload(np.concatenate([q.ids for q in live]), d), upload(np.concatenate([q.pos for q in live]), d),
            upload(np.concatenate([q.slots for q in live]), d), [upload(q.ctx, d) for q in live],
            [q.ids.size for q in live])
        for i, q in enumerate(live):
            if q.want:
                self._logits[q.nodes[-1]] = (logits, i)

    def _check_vocab(self, ids: np.ndarray) -> None:
        vocab = self.model.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise ValueError(f"token id {bad} is out of the model's vocabulary [0, {vocab})")

    def _prefill_run(self, nodes: list, counts: list, ids: np.ndarray, pos, slots, ctx) -> torch.Tensor | None:
        """Run (or, inside :meth:`batched_prefill`, queue) the forward pass of new tokens ``ids``
        held by the chain ``nodes`` (``counts`` each) over context slots ``ctx``."""
        self._check_positions(pos)
        if self._batching and self.compute:
            self._queued.append(_QueuedPrefill(nodes, counts, ids, pos, slots, ctx))
            if sum(q.ids.size for q in self._queued) >= self.prefill_tokens:
                self.flush_prefill()
            return None
        self.flush_prefill()            # (a queued prefill may be this one's context)
        if self.compute:
            d = self.device
            logits = self._prefill_model(upload(ids, d), upload(pos, d), upload(slots, d), [upload(ctx, d)],
                                         [ids.size])
        else:
            logits = self._zeros(1)
        self._logits[nodes[-1]] = (logits, 0)
        return logits[0]

    def _prefill_model(self, tokens, positions, slots, contexts: list, lengths: list) -> torch.Tensor:
        """The model's prefill of segments of ``lengths`` tokens, concatenated, over their
        ``contexts`` slots; float32 ``[segments, vocab]`` (a hook: :mod:`treeattn.engine.sharded`
        overrides it)."""
        if len(contexts) == 1:
            return self.model.prefill(tokens, positions, slots, contexts[0], self.kv.caches)[None]
        return self.model.prefill(tokens, positions, slots, contexts, self.kv.caches, lengths=lengths)

    def decode(self, nodes, tokens: torch.Tensor, *, horizon: int = 1, events: tuple | None = None) -> torch.Tensor:
        """One new token for each leaf of ``nodes``; returns float32 logits ``[n, vocab]``.

        Parameters
        ----------
        nodes : sequence of int
            Active leaves.
        tokens : int64 ``[n]`` on the model's device
        horizon : int
            The controller promises these same leaves get one token per step for this many steps
            (this one included); up to ``window`` of them share one plan. A broken promise only
            costs a re-plan.
        events : pair of torch.cuda.Event, optional
            Recorded right before and right after the forward pass is enqueued, after the host's
            bookkeeping and planning: their elapsed time is the forward's GPU time, without the
            host's planning even when the GPU waited for it (CUDA; not recorded by a step that
            skips the model).
        """
        self.flush_prefill()
        t0 = time.perf_counter()
        nodes = list(nodes)
        if not self.compute:
            return self._skip(nodes, tokens, t0)
        slots, pos = self.tree.append_one(nodes, tokens)
        self._check_positions(pos)
        own = [self.kv.num_tokens(n) for n in nodes]
        w, plan_ms = self._win, 0.0
        if w is not None and w.left > 0 and w.nodes == tuple(nodes) and w.expect == own:
            self.planner.set_prefix(w.plan, np.asarray(own))
        elif (ahead := self._take_ahead(nodes, own)) is not None:
            (w, plan_ms), self._win = ahead, ahead[0]
            self.planner.set_prefix(w.plan, np.asarray(own))
        else:
            self._close_window()
            h = min(self.window, max(1, int(horizon)))
            try:
                extra = {n: self.kv.reserve(n, h - 1) for n in nodes} if h > 1 else None
            except KVPoolOutOfMemory:       # no room to plan ahead: plan this step alone
                for n in nodes:
                    self.kv.drop_reserved(n)
                h, extra = 1, None
            dtree = self.tree.decoding_tree(nodes, extra=extra)
            plan = self.planner.plan(dtree, first_prefix=np.asarray(own) if h > 1 else None)
            if h > 1:
                self.planner.set_prefix(plan, np.asarray(own))
            plan_ms = self.planner.last_ms
            w = self._win = Window(tuple(nodes), plan, h, own, *_window_tokens(dtree))
        w.left -= 1
        w.expect = [o + 1 for o in own]
        if horizon - 1 > w.left and self._ahead is None:
            # the same leaves continue past this window: plan the next one while the GPU works
            self.plan_ahead(nodes, horizon - 1 - w.left, after=w.left)
        mine = sum(own)
        sliding, sliding_ms = self._sliding_plan(pos, lambda: self.tree.decoding_tree(nodes))
        logits = self._forward(tokens, pos, slots, w.plan, "decode", t0, plan_ms + sliding_ms, w.tokens,
                               (w.above[0] + mine, w.above[1] + mine), sliding=sliding, events=events)
        for i, n in enumerate(nodes):
            self._logits[n] = (logits, i)
        return logits

    def plan_ahead(self, nodes, horizon: int, *, after: int) -> bool:
        """Plan the decode window that starts ``after`` decode steps from now, in the background.

        A controller calls it between steps when it knows which leaves the next window decodes
        (the same leaves, or fewer once some finished): their slots for that window are
        reserved now and the window is planned on a background thread while the GPU runs the
        current one, so no step waits for the host's planning. Nothing happens unless the
        current decode window ends exactly then; a step with other leaves drops the plan (that
        step then plans as usual).

        Parameters
        ----------
        nodes : sequence of int
            Active leaves of the next window, in the order that step's :meth:`decode` passes them.
        horizon : int
            Steps those leaves are promised from the next window's first step on.
        after : int
            Decode steps of the current leaves before that window starts.

        Returns
        -------
        bool: whether that window is planned (now or by an earlier call).
        """
        left = self._win.left if self._win is not None else 0   # steps the current window has left
        h = min(self.window, int(horizon))
        nodes = tuple(nodes)
        own = [self.kv.num_tokens(n) + left + 1 for n in nodes]
        if self._ahead is not None and self._ahead[:3] == (nodes, own, h):
            return True
        if h < 2 or after != left or not self.compute:
            return False
        self._drop_ahead()
        try:
            # the current window's remaining slots, then the next window's h
            extra = {n: self.kv.reserve(n, left + h) for n in nodes}
        except KVPoolOutOfMemory:
            return False
        dtree = self.tree.decoding_tree(list(nodes), extra=extra)
        if self._planning is None:
            self._planning = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="treeattn-plan")
        job = self._planning.submit(self._ahead_planner.plan_host, dtree, first_prefix=np.asarray(own))
        self._ahead = (nodes, own, h, job, _window_tokens(dtree))
        return True

    def _take_ahead(self, nodes, own) -> tuple | None:
        """``(window, ms)``: the window :meth:`plan_ahead` prepared, if it is the one this step
        starts, and the milliseconds this thread spent on it (waiting for it, uploading it)."""
        if self._ahead is None:
            return None
        want, expect, h, job, tokens = self._ahead
        if want != tuple(nodes) or expect != own:
            return None
        self._ahead = None
        t0 = time.perf_counter()
        plan = self.planner.to_device(job.result())
        return Window(want, plan, h, own, *tokens), (time.perf_counter() - t0) * 1e3

    def _drop_ahead(self) -> None:
        """Forget the background window (its planning, if running, finishes unused)."""
        if self._ahead is not None:
            want, _, _, job, _ = self._ahead
            self._ahead = None
            job.cancel()
            if not self.keep_reserved:
                # the current window still writes its tokens to the slots its plan reads
                w = self._win
                for n in want:
                    if n in self.tree:
                        self.kv.drop_reserved(n, keep=w.left if w is not None and n in w.nodes else 0)

    def _sliding_plan(self, pos: np.ndarray, tree) -> tuple:
        """``(plan, ms)`` of the sliding-window layers for queries at positions ``pos`` over the
        tree ``tree()`` (made only when needed); ``(None, 0.0)`` when no query sees more tokens than
        the window, so the full layers' plan serves them too (within a decode window as well)."""
        if self.sliding_window is None or int(pos.max()) < self.sliding_window:
            return None, 0.0
        plan = self.sliding_planner.plan(window_tree(tree(), self.sliding_window))
        return plan, self.sliding_planner.last_ms

    def _skip(self, nodes, tokens, t0) -> torch.Tensor:
        """Bookkeeping of a step that does not run the model (fast-forward): zeros as logits."""
        self._close_window()
        self.tree.append_one(nodes, tokens)
        logits = self._forward(tokens, np.zeros(len(nodes)), None, None, "skip", t0, 0.0, 0)
        for i, n in enumerate(nodes):
            self._logits[n] = (logits, i)
        return logits

    def _forward(self, tokens, pos, slots, plan, kind, t0, plan_ms, tree_tokens,
                 seen=(0, 0), *, sliding=None, events=None) -> torch.Tensor:
        t1 = time.perf_counter()
        n = len(pos)
        if self.compute:
            bounded = self.max_inflight is not None and self.device.type == "cuda"
            while bounded and len(self._inflight) >= self.max_inflight:
                self._inflight.popleft().synchronize()
            self._fire("forward_begin")
            if events is not None:
                events[0].record()
            logits = self._run_model(tokens, pos, slots, plan, sliding)
            if events is not None:
                events[1].record()
            self._fire("forward_end")
            if bounded:
                self._inflight.append(torch.cuda.Event())
                self._inflight[-1].record()
            if self.synchronize and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        else:
            logits = self._zeros(n)
        t2 = time.perf_counter()
        self.stats.append(StepStats(
            step=len(self.stats), kind=kind, queries=n, tree_nodes=self.tree.num_nodes,
            tree_tokens=int(tree_tokens), strategy=plan.strategy if plan is not None else "",
            kv_ms=(t1 - t0) * 1e3 - plan_ms, plan_ms=plan_ms, forward_ms=(t2 - t1) * 1e3,
            computed=self.compute, kv_bytes=int(plan.io.kv) if plan is not None else 0,
            visible_tokens=int(seen[0]), unique_tokens=int(seen[1])))
        for gone in [k for k in self._logits if k not in self.tree]:
            del self._logits[gone]
        return logits

    def _ensure_workspace(self, *plans) -> None:
        if self.attention.backend == "triton":
            need = max(p.workspace_bytes() for p in plans if p is not None) // 4
            if self._workspace is None or self._workspace.numel() < need:
                self._workspace = torch.empty(max(need, 1 << 20), dtype=torch.float32, device=self.device)
                self.attention = TreeAttention(self._workspace, device=self.device, backend=self.backend,
                                               streams=0, pdl=self.attention.pdl)

    def _attend_fn(self, plan, sliding=None):
        return StepAttention(self, plan, sliding)

    def _fire(self, event: str, layer: int = -1) -> None:
        if self.hook is not None:
            self.hook(event, layer)

    def _run_model(self, tokens, pos, slots, plan, sliding=None) -> torch.Tensor:
        self._ensure_workspace(plan, sliding)
        attend = self._attend_fn(plan, sliding)
        if self.graphs is not None and self.graphs.supports(len(pos)):
            return self.graphs.run(tokens, pos, slots, attend)
        d = self.device
        return self.model.decode(tokens, upload(pos, d), upload(slots, d), self.kv.caches, attend)

    def precompile_kernels(self) -> int:
        """Compile every attention-kernel variant this model's plans can use now, in
        ``compile_workers`` processes on a GPU (:func:`~treeattn.precompile.precompile`; a server
        calls it at start-up, so no request waits for Triton's JIT); returns the launches made in
        this process, 0 with the torch backend or once compiled."""
        if self._compiled:
            return 0
        self._compiled = True
        h, t0 = self.planner.heads, time.perf_counter()
        self.compiled_launches = self.attention.precompile(
            num_qo_heads=h.num_qo_heads, num_kv_heads=h.num_kv_heads, head_dim=h.head_dim, dtype=h.dtype,
            page_size=self.pool.page_size, workers=self.compile_workers, vocab=self.model.config.vocab_size)
        self.compile_s = time.perf_counter() - t0
        return self.compiled_launches

    def _warm_model(self) -> None:
        """A tiny beam search and a tiny sampling run with log-probabilities and EOS, then a reset:
        the kernels a first run would load (fused layers, prefill attention, GEMM handles, the
        beams' top-k and KV copies, the sampling kernels) are loaded here. On an H200 a first
        beam search took 8.1 ms a step against 5.8 ms for the second, after a first sampling run."""
        from treeattn.engine.beam import BeamSearchController          # (controllers sit above the engine)
        from treeattn.engine.controller import SamplingController

        prompt = [0] * 32
        self.run(BeamSearchController(prompt, num_beams=2, max_new_tokens=3))
        self.reset()
        self.run(SamplingController([prompt], n=2, max_new_tokens=3, eos_token_ids=[0], logprobs=True))
        self.reset()
        self.stats.clear()

    def prepare_graphs(self, counts) -> None:
        """Capture the CUDA graphs of steps with these numbers of new tokens now (checking each
        against eager execution on a dummy step), so that decoding never stops to capture."""
        if self.graphs is None:
            return
        planner = StepPlanner(self.planner.heads, strategy="sequence", device=self.device)
        t0, done = time.perf_counter(), []
        # largest bucket first: it sizes the static buffers once (a bigger bucket captured later
        # would reallocate them and drop every graph captured before)
        for m in sorted({self.graphs.bucket(c) for c in counts} - {None}, reverse=True):
            if not self.graphs.supports(m):
                break
            if m in self.graphs.ready:
                continue
            done.append(m)
            slots = self.kv.scratch(m)
            dtree = DecodingTree.from_parents([-1] * m, [1] * m, kv_indices=slots,
                                              page_size=self.pool.page_size, num_slots=self.pool.num_slots)
            plan = planner.plan(dtree)
            self._ensure_workspace(plan)
            self.graphs.check(torch.zeros(m, dtype=torch.int64, device=self.device),
                              np.zeros(m, dtype=np.int64), slots, self._attend_fn(plan))
        if done:
            log.info("captured the CUDA graphs of %s-token decode steps in %.1f s",
                     ", ".join(map(str, sorted(done))), time.perf_counter() - t0)

    def _check_positions(self, pos: np.ndarray) -> None:
        if pos.size:
            self.model.ensure_positions(int(pos.max()) + 1)

    def _close_window(self) -> None:
        self._drop_ahead()
        if self._win is not None:
            for n in self._win.nodes:
                if n in self.tree and not self.keep_reserved:
                    self.kv.drop_reserved(n)
            self._win = None

    # ------------------------------------------------------------------ driving
    def run(self, controller, *, max_steps: int | None = None, on_step=None, schedule=None) -> dict:
        """Drive ``controller`` (a :class:`~treeattn.engine.controller.BranchController`) until it
        stops or ``max_steps`` steps ran. Sequences left by an earlier run are decoded too: call
        :meth:`reset` between runs.

        Parameters
        ----------
        on_step : callable ``(step, StepStats or None)``, optional
            Called after every step (progress bars).
        schedule : callable ``step -> bool``, optional
            Whether step ``step`` runs the model; skipped steps only do the bookkeeping (their
            logits are zeros). Benchmarks use it to fast-forward a replay.

        Returns
        -------
        dict: the controller's result.
        """
        self.compute = True
        # a controller reads its prefills' logits at once: no batching while it runs
        self.flush_prefill()
        batching, self._batching = self._batching, 0
        self.prepare_graphs(controller.query_counts())   # (captured now, not in the first steps)
        step = 0
        try:
            controller.start(self)
            while max_steps is None or step < max_steps:
                self.compute = schedule(step) if schedule is not None else True
                before = len(self.stats)
                if not controller.step(self, step):
                    break
                step += 1
                if on_step is not None:
                    on_step(step, self.stats[-1] if len(self.stats) > before else None)
        finally:
            self.compute = True
            self._batching = batching
        return controller.result(self)

    def reset(self) -> None:
        """Prune every sequence, drop stored results and free every KV page the engine holds."""
        self._close_window()
        self._verify = None
        self._queued.clear()
        self._inflight.clear()
        self.tree.clear()
        self.tree.results.clear()
        self.kv.release_private()
        self._logits.clear()

    # --- user API
    def generate(self, prompts, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, max_new_tokens: int = 16, stop_token_ids=(), ignore_eos: bool = False,
                 logprobs: bool = True, prune_every: int = 8) -> list:
        """Sample ``n`` continuations of each prompt; the prompts form a forest, each prompt's KV
        shared by its samples (:class:`~treeattn.engine.controller.SamplingController`).

        Every argument is checked before any work (ValueError naming the problem). The engine must
        hold no sequences; it is reset afterwards (every KV page freed).

        Parameters
        ----------
        prompts : str, list of int, or a list of them
            Text needs the model's tokenizer.
        n : int
            Samples per prompt.
        temperature : float
            0: greedy (``top_p``, ``top_k`` and ``seed`` unused).
        top_p : float in (0, 1]
        top_k : int
            0: no top-k filtering.
        seed : int, optional
            A sample's tokens depend only on the seed, its prompt and its index ``j``, not on the
            other prompts or samples decoded with it. None: fresh entropy.
        max_new_tokens : int
        stop_token_ids : sequence of int
            Tokens that end a sample (it keeps the token), besides the model's EOS tokens.
        ignore_eos : bool
            Do not stop at the model's EOS tokens (``config.eos_token_ids``).
        logprobs : bool
            Report per-token and cumulative log-probabilities.
        prune_every : int
            Steps between the host's looks at which samples stopped (their KV is freed then).

        Returns
        -------
        list of :class:`~treeattn.engine.generate.GenerationOutput`, one per prompt.
        """
        from treeattn.engine.generate import generate    # (the user API sits above the engine)

        return generate(self, prompts, n=n, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                        max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                        logprobs=logprobs, prune_every=prune_every)

    def beam_search(self, prompt, *, num_beams: int = 4, max_new_tokens: int = 16, length_penalty: float = 1.0,
                    early_stopping=False, eos_token_ids=(), num_return_sequences: int | None = None):
        """Beam search over one prompt, as transformers' ``generate(num_beams=k, do_sample=False)``
        (:class:`~treeattn.engine.beam.BeamSearchController`).

        Every argument is checked before any work (ValueError naming the problem). The engine must
        hold no sequences; it is reset afterwards.

        Parameters
        ----------
        prompt : str or list of int
        num_beams : int in [1, vocab]
        max_new_tokens : int
        length_penalty : float
        early_stopping : bool or "never"
        eos_token_ids : sequence of int
        num_return_sequences : int in [1, num_beams], optional
            Default ``num_beams``.

        Returns
        -------
        :class:`~treeattn.engine.generate.BeamSearchOutput`
        """
        from treeattn.engine.generate import beam_search    # (the user API sits above the engine)

        return beam_search(self, prompt, num_beams=num_beams, max_new_tokens=max_new_tokens,
                           length_penalty=length_penalty, early_stopping=early_stopping,
                           eos_token_ids=eos_token_ids, num_return_sequences=num_return_sequences)
