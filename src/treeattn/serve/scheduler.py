"""Continuous batching on a :class:`~treeattn.engine.TreeEngine` over a shared-prefix cache.

One engine thread owns the engine. Every iteration it runs the calls queued by other threads
(submit, abort, stats), admits waiting requests while free KV pages allow (evicting unreferenced
cached prefixes, least recently used first), then samples one token for every running sequence and
runs one decode step for those that go on. Requests join and leave between any two steps; the
decoding tree of a step is the prefix cache with the running sequences as its leaves, so shared
prompts are read once per step by treeattn. When the pool runs out of pages the newest request is
preempted (its KV freed, its tokens kept) and later resumed by prefilling prompt plus output.

The attention plan is updated lazily (PAT section 5.1): the engine plans a *decode window* of
``min(tokens left)`` steps at once and reuses it until the batch changes.

The loop waits for the device once per step, when the sampled tokens come to the host; the wall
time between two such waits (or from an idle wake-up) is counted as ``prefill_ms`` when the loop
issued a prefill in it (the interval also holds one decode step) and as ``decode_ms`` otherwise, so
no synchronisation is added to time them.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from treeattn import KVPoolOutOfMemory
from treeattn.engine.planning import upload
from treeattn.engine.sampling import Sampler
from treeattn.serve.radix import PrefixCache

__all__ = ["SamplingParams", "Request", "Scheduler", "QueueFull"]

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The scheduler's waiting queue is at its limit."""


@dataclass(frozen=True)
class SamplingParams:
    """How a request's ``n`` choices are generated (``temperature == 0``: greedy)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False

    def sampler(self) -> Sampler | None:
        """The request's own seeded sampler, or None for greedy decoding."""
        if self.temperature == 0:
            return None
        seed = self.seed if self.seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        return Sampler(self.temperature, top_p=self.top_p, seed=seed)


@dataclass
class Request:
    """A request inside the scheduler.

    ``emit(list of (choice, token or None, finish_reason or None))`` is called from the engine
    thread after every step that concerns the request; ``emit(message)`` with a string reports a
    failure (the request is gone).
    """

    id: int
    prompt: list
    params: SamplingParams
    emit: object
    sampler: Sampler | None = None
    outputs: list = field(default_factory=list)       # generated token ids per choice
    finish: list = field(default_factory=list)        # finish reason per choice (None: running)
    leaves: dict = field(default_factory=dict)        # choice -> engine leaf node
    anchors: set = field(default_factory=set)         # cached nodes the leaves hang below
    arrival: float = field(default_factory=time.monotonic)


class Scheduler:
    """Continuous batching over one engine, driven by its own thread.

    Parameters
    ----------
    engine : TreeEngine
        Built with ``keep_reserved=True`` (decode-window slots survive batch changes).
    max_queue : int
        Most requests waiting for admission; :meth:`submit` raises :class:`QueueFull` beyond.
    max_batch : int
        Most sequences (choices) decoded in one step.
    block_tokens : int
        Granularity of the prefix cache (:class:`~treeattn.serve.radix.PrefixCache`).
    """

    def __init__(self, engine, *, max_queue: int = 256, max_batch: int = 64, block_tokens: int = 64):
        self.engine = engine
        self.cache = PrefixCache(engine, block_tokens)
        self.max_queue, self.max_batch = int(max_queue), int(max_batch)
        self.eos = frozenset(engine.model.config.eos_token_ids)
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._calls: deque = deque()          # callables run on the engine thread
        self._queued = 0                      # submitted, not yet admitted or dropped
        self._waiting: deque = deque()        # engine thread only
        self._running: list = []              # engine thread only
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.preemptions = 0
        self.decoded = 0                      # sequences sampled, summed over steps
        self.max_batch_seen = 0
        self.strategies: dict[str, int] = {}  # decode steps per attention strategy the engine used
        self.plan_ms = 0.0                    # host time the engine spent planning attention
        self.kv_visible = 0                   # KV tokens seen by the decode queries, summed per query
        self.kv_unique = 0                    # distinct KV tokens seen by each step's decode queries
        self.prefill_ms = 0.0                 # wall time between device waits that prefilled
        self.prefill_steps = 0                # steps whose interval prefilled
        self.decode_ms = 0.0                  # wall time between device waits that only decoded
        self._synced = time.perf_counter()    # the last device wait (or idle wake-up)
        self._synced_miss = 0                 # the cache's prefilled tokens at that time

    # ------------------------------------------------------------------ other threads
    def start(self) -> Scheduler:
        """Start the engine thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="treeattn-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (running requests are dropped)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def num_queued(self) -> int:
        """Requests submitted and not yet admitted (or dropped)."""
        with self._cv:
            return self._queued

    def pages_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
        """KV pages a request needs at most (its prompt blocks, ``n`` outputs, copy-on-write)."""
        ps = self.engine.pool.page_size
        blocks = -(-prompt_len // self.cache.block)
        return -(-prompt_len // ps) + blocks + n * (-(-max_tokens // ps) + 2)

    @property
    def capacity_pages(self) -> int:
        """Pages one request may use (the pool less a few for the engine's own needs)."""
        return self.engine.pool.num_pages - 2

    def submit(self, prompt, params: SamplingParams, emit) -> int:
        """Queue a request (token ids); returns its id. Raises :class:`QueueFull`."""
        with self._cv:
            if self._queued >= self.max_queue:
                raise QueueFull(f"the queue holds {self._queued} requests (limit {self.max_queue})")
            self._queued += 1
            req = Request(next(self._ids), [int(t) for t in prompt], params, emit)
            self._calls.append(lambda: self._waiting.append(req))
            self._cv.notify_all()
        return req.id

    def abort(self, request_id: int) -> None:
        """Drop a request (client gone): waiting, it leaves the queue; running, its KV is freed."""
        self._post(lambda: self._abort(request_id))

    def call(self, fn, timeout: float = 30.0):
        """Run ``fn()`` on the engine thread between two steps and return its result."""
        fut: Future = Future()

        def run():
            try:
                fut.set_result(fn())
            except Exception as e:  # handed to the caller
                fut.set_exception(e)
        self._post(run)
        return fut.result(timeout)

    def stats(self) -> dict:
        """Queue, batch, pool and cache numbers (read on the engine thread).

        Besides the counters of the class: ``kv_visible_tokens`` and ``kv_unique_tokens`` sum,
        over decode steps, the KV tokens the step's queries see (per query: what attention
        without prefix sharing reads) and the distinct ones (what attention reading each shared
        token once reads); ``prefill_ms``, ``prefill_steps`` and ``decode_ms``: see the module.
        """
        def read():
            pool, c = self.engine.pool, self.cache
            return {"waiting": len(self._waiting), "running": len(self._running), "steps": self.steps,
                    "preemptions": self.preemptions, "decoded_tokens": self.decoded,
                    "max_batch_seen": self.max_batch_seen, "strategies": dict(self.strategies),
                    "plan_ms": self.plan_ms, "kv_visible_tokens": self.kv_visible,
                    "kv_unique_tokens": self.kv_unique, "prefill_ms": self.prefill_ms,
                    "prefill_steps": self.prefill_steps, "decode_ms": self.decode_ms,
                    "free_pages": pool.num_free_pages,
                    "num_pages": pool.num_pages, "cached_blocks": c.num_nodes,
                    "prefix_hit_tokens": c.hit_tokens, "prefill_tokens": c.miss_tokens}
        return self.call(read)

    def flush_cache(self) -> int:
        """Evict every unreferenced cached prefix; returns the number of blocks evicted."""
        return self.call(self.cache.clear)

    def _post(self, fn) -> None:
        with self._cv:
            self._calls.append(fn)
            self._cv.notify_all()

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not (self._stop or self._calls or self._waiting or self._running):
                    self._cv.wait()
                if self._stop:
                    return
                calls = list(self._calls)
                self._calls.clear()
            for fn in calls:
                fn()
            if not self._running:         # no decode in flight: the next interval starts now
                self._synced = time.perf_counter()
            try:
                self._admit()
                if self._running:
                    self._step()
            except Exception as e:       # keep serving: fail the batch, free its KV
                log.exception("engine step failed")
                for req in list(self._running):
                    self._fail(req, f"engine error: {e}")

    def _dequeue(self, req: Request) -> None:
        self._waiting.remove(req)
        with self._cv:
            self._queued -= 1

    def _abort(self, request_id: int) -> None:
        for req in list(self._waiting):
            if req.id == request_id:
                self._dequeue(req)
        for req in list(self._running):
            if req.id == request_id:
                self._free(req)
                self._running.remove(req)

    def _fail(self, req: Request, msg: str) -> None:
        self._free(req)
        if req in self._running:
            self._running.remove(req)
        req.emit(msg)

    def _free(self, req: Request) -> None:
        """Free the request's leaves (its cached prompt blocks stay, unreferenced)."""
        tree = self.engine.tree
        for leaf in req.leaves.values():
            if leaf in tree:
                tree.prune(leaf, cascade=False)
        req.leaves.clear()
        for node in req.anchors:
            self.cache.release(node)
        req.anchors.clear()

    def _batch_size(self) -> int:
        return sum(len(r.leaves) for r in self._running)

    def _ensure_free(self, pages: int) -> bool:
        pool = self.engine.pool
        if pool.num_free_pages < pages:
            self.cache.evict(pages)
        return pool.num_free_pages >= pages

    def _admit(self) -> None:
        while self._waiting:
            req = self._waiting[0]
            if not req.outputs:
                req.outputs = [[] for _ in range(req.params.n)]
                req.finish = [None] * req.params.n
                req.sampler = req.params.sampler()
            live = [i for i, f in enumerate(req.finish) if f is None]
            if self._running and self._batch_size() + len(live) > self.max_batch:
                return
            longest = len(req.prompt) + max(len(o) for o in req.outputs)
            need = self.pages_needed(longest, 1, len(live))
            if not self._ensure_free(need):
                if self._running:
                    return
                self._dequeue(req)
                self._fail(req, "the request does not fit in the KV cache")
                continue
            try:
                self._place(req, live)
            except KVPoolOutOfMemory:
                self._free(req)
                if self._running:
                    return
                self._dequeue(req)
                self._fail(req, "the request does not fit in the KV cache")
                continue
            self._dequeue(req)
            self._running.append(req)

    def _place(self, req: Request, live: list) -> None:
        """Prefill the contexts (prompt + output so far) of choices ``live`` and hang a leaf for
        each below its context's last block."""
        groups: dict[tuple, list] = {}
        for i in live:
            groups.setdefault(tuple(req.prompt + req.outputs[i]), []).append(i)
        for ctx, choices in groups.items():
            node = self.cache.insert(ctx)
            req.anchors.add(node)
            for i, leaf in zip(choices, self.engine.tree.add_children(node, len(choices))):
                req.leaves[i] = leaf

    def _preempt_for(self, pages: int) -> None:
        """Evict cached prefixes, then preempt the newest requests, until ``pages`` are free."""
        while not self._ensure_free(pages) and len(self._running) > 1:
            req = self._running.pop()
            self._free(req)
            self._waiting.appendleft(req)
            with self._cv:
                self._queued += 1
            self.preemptions += 1
            log.info("preempted request %d (%d pages free)", req.id, self.engine.pool.num_free_pages)

    def _step(self) -> None:
        eng = self.engine
        self._preempt_for(self._batch_size())
        order = [(req, i) for req in self._running for i in sorted(req.leaves)]
        self.decoded += len(order)
        self.max_batch_seen = max(self.max_batch_seen, len(order))
        leaves = [req.leaves[i] for req, i in order]
        logits = eng.logits_for(leaves)
        tokens = logits.argmax(dim=-1)
        at = 0
        for req in self._running:
            k = len(req.leaves)
            if req.sampler is not None:
                tokens[at: at + k] = req.sampler(logits[at: at + k])
            at += k
        host = tokens.tolist()            # waits for the device
        self._count_interval()
        cont, cont_tok, events = [], [], {}
        for (req, i), tok in zip(order, host):
            p = req.params
            ev = events.setdefault(req.id, (req, []))[1]
            if tok in self.eos and not p.ignore_eos:
                req.finish[i] = "stop"
                ev.append((i, None, "stop"))
            else:
                req.outputs[i].append(tok)
                done = len(req.outputs[i]) >= p.max_tokens
                req.finish[i] = "length" if done else None
                ev.append((i, tok, req.finish[i]))
            if req.finish[i] is None:
                cont.append((req, i))
                cont_tok.append(tok)
            else:
                eng.tree.prune(req.leaves.pop(i), cascade=False)
        for req, ev in events.values():
            req.emit(ev)
            if not req.leaves:
                self._free(req)
                self._running.remove(req)
        if cont:
            horizon = min(req.params.max_tokens - len(req.outputs[i]) for req, i in cont)
            eng.decode([req.leaves[i] for req, i in cont], upload(np.asarray(cont_tok), eng.device),
                       horizon=horizon)
        self.steps += 1
        # the engine appends one StepStats per step: fold them into counters so that a long-running
        # server does not accumulate them
        for st in eng.stats:
            self.plan_ms += st.plan_ms
            if st.strategy:
                self.strategies[st.strategy] = self.strategies.get(st.strategy, 0) + 1
            self.kv_visible += st.visible_tokens
            self.kv_unique += st.unique_tokens
        eng.stats.clear()

    def _count_interval(self) -> None:
        """Add the wall time since the last device wait to ``prefill_ms`` or ``decode_ms``."""
        now, miss = time.perf_counter(), self.cache.miss_tokens
        ms = (now - self._synced) * 1e3
        if miss != self._synced_miss:
            self.prefill_ms += ms
            self.prefill_steps += 1
        else:
            self.decode_ms += ms
        self._synced, self._synced_miss = now, miss
