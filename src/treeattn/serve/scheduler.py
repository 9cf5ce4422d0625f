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

**Overlap.** The host's work of a step (reading the sampled tokens, stop checks, emitting events,
admissions, planning the next step) runs while the GPU runs the next decode step: step ``t``'s
sampled tokens are copied to pinned host memory, then decode step ``t + 1`` is enqueued with them
as the device tensor they are, for every row that goes on *as far as the host knows* (it has not
reached ``max_tokens``, which is known up front), and only then does the host wait for step ``t``'s
tokens. A row that stopped at step ``t`` (EOS, a stop token or string) was decoded once more; that
token is never sampled or emitted, and its KV is freed with the row. Sampling itself never lags:
step ``t + 1``'s sampling is enqueued after step ``t``'s tokens were read, so penalties see the
whole output so far and a row's random counter is its output index, as in the synchronous loop.

**Chunked prefill.** While requests are running, one loop iteration prefills at most
``prefill_chunk`` prompt tokens (rounded to the prefix cache's blocks); a longer prompt is cached
a chunk at a time, one chunk between two decode steps, as pinned prefix-cache blocks
(:meth:`~treeattn.serve.radix.PrefixCache.insert_prefix`) that other prompts may already share,
and joins the batch with its last chunk. Chunks run as their own forward passes between decode
steps, not inside them: a decode step is a captured CUDA graph of a fixed batch with treeattn's
tree attention, a chunk a variable-length causal SDPA pass over its cached context.

**Batched prefill.** The prompts admitted in one iteration, and the chunk cached in it, share one
forward pass (:meth:`~treeattn.engine.TreeEngine.batched_prefill`): its GEMMs read the weights once
for all of them, attention runs per prompt. A prompt may match blocks another prompt of the same
iteration just cached (a new system prompt shared by both): the pass writes every prompt's K/V of a
layer before any of them attends in it.

**Step times.** The loop waits for the device once per step, when the sampled tokens come to the
host; the wall time between two such waits (or from an idle wake-up) is counted as ``prefill_ms``
when the loop issued a prefill in it (the interval also holds one decode step) and as ``decode_ms``
otherwise, so no synchronisation is added to time them. On a GPU a decode step's GPU time is that
of its forward pass (CUDA events around its launch, after the host planned it, see
:meth:`~treeattn.engine.TreeEngine.decode`) plus that of sampling its logits (events around
:func:`~treeattn.serve.sampling.choose_tokens`); both events pairs precede the copy of the step's
tokens, so they are read (``Event.query``, ``elapsed_time``) once the tokens came, without another
wait. Only the host's work inside a pair (launching the sampling kernels, the graph's input
copies) counts as GPU time when the GPU waits for it; the rest of the host's work (reading
tokens, stop checks, planning) does not, so ``wall / GPU`` shows how far the host holds the GPU
back. :meth:`Scheduler.decode_times` keeps both for the latest decode steps; ``step_listeners``
see every step's.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from treeattn import KVPoolOutOfMemory
from treeattn.engine.beam import BeamSearchController
from treeattn.engine.planning import upload
from treeattn.engine.sampling import sample_streams
from treeattn.serve.radix import PrefixCache
from treeattn.serve.sampling import RowOptions, choose_tokens

__all__ = ["SamplingParams", "Request", "Scheduler", "QueueFull", "Event"]

log = logging.getLogger(__name__)

#: decode steps whose wall and GPU times :meth:`Scheduler.decode_times` keeps (the latest)
_DECODE_TIMES = 1 << 16


class QueueFull(RuntimeError):
    """The scheduler's waiting queue is at its limit."""


class _Cancelled(Exception):
    """A beam search whose client left (or the scheduler stops) ends between two steps."""


@dataclass(frozen=True)
class SamplingParams:
    """How a request's ``n`` choices are generated (``temperature == 0``: greedy).

    ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (``(token, bias)`` pairs) have
    OpenAI's meaning over the choice's generated tokens. A choice stops at the model's EOS tokens
    (unless ``ignore_eos``) or one of ``stop_token_ids`` (neither is part of the output), or once
    its decoded text contains one of ``stop`` (the token that completed it is). ``logprobs``: the
    number of alternatives to report per token (0: only the chosen one's), None: none.
    ``use_beam_search``: one beam search of ``beam_width`` beams returning the ``n`` best
    (:class:`~treeattn.engine.beam.BeamSearchController`; greedy, no penalties).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()
    stop: tuple = ()
    stop_token_ids: tuple = ()
    logprobs: int | None = None
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False


class Event(NamedTuple):
    """What one step did to one choice: its new token (None: it stopped at an EOS or stop token),
    the finish reason once it ended, and with ``logprobs`` the token's log-probability and the
    ``(token, logprob)`` alternatives."""

    choice: int
    token: int | None
    finish: str | None
    logprob: float | None = None
    top: tuple = ()


@dataclass
class Request:
    """A request inside the scheduler.

    ``emit(list of Event)`` is called from the engine thread after every step that concerns the
    request; ``emit(message)`` with a string reports a failure (the request is gone).
    """

    id: int
    prompt: list
    params: SamplingParams
    emit: object
    seed: int = 0
    streams: list = field(default_factory=list)        # random stream per choice
    outputs: list = field(default_factory=list)       # generated token ids per choice
    finish: list = field(default_factory=list)        # finish reason per choice (None: running)
    leaves: dict = field(default_factory=dict)        # choice -> engine leaf node
    anchors: set = field(default_factory=set)         # cached nodes the leaves hang below
    pinned: int | None = None                         # last cached chunk of a prompt being prefilled
    counted: int = 0                                  # context tokens its chunks cached (and counted)
    arrival: float = field(default_factory=time.monotonic)


class _HostCopy:
    """A step's sampled tokens (and log-probabilities) on their way to the host.

    On a GPU they are copied into pinned memory behind the work enqueued so far, so that
    :meth:`wait` waits for that work only, not for the decode step enqueued after the copy.
    """

    def __init__(self, choice):
        parts = [choice.tokens, choice.logprobs, choice.top_ids, choice.top_values]
        self._done = None
        if choice.tokens.device.type == "cuda":
            parts = [None if t is None else
                     torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                     for t in parts]
            self._done = torch.cuda.Event()
            self._done.record()
        self._parts = parts

    def wait(self) -> tuple:
        """``(tokens, logprobs, top_ids, top_values)`` as lists (None where not computed)."""
        if self._done is not None:
            self._done.synchronize()
        return tuple(None if t is None else t.tolist() for t in self._parts)


def _timing_events() -> tuple:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _elapsed_ms(*pairs) -> float | None:
    """GPU milliseconds between the events of each recorded pair, summed; None when a pair is
    missing or has not completed (never waited for)."""
    if any(p is None for p in pairs) or not all(end.query() for _, end in pairs):
        return None
    return sum(start.elapsed_time(end) for start, end in pairs)


def _seed_of(params: SamplingParams) -> int:
    """The seed of a request's random streams: its own, else a fresh one."""
    return params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % 2**63)


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
    prefill_chunk : int
        Most prompt tokens prefilled between two decode steps while requests are running (rounded
        down to ``block_tokens``, at least one block); a longer prompt is prefilled in chunks (see
        the module). 0: every admitted prompt is prefilled at once.
    overlap : bool
        Enqueue decode step ``t + 1`` before reading step ``t``'s tokens (see the module). False:
        read them first (the host's work of a step then leaves the GPU idle); for comparisons.

    Attributes
    ----------
    step_listeners : list of callable
        Each is called on the engine thread after every step with ``(kind, wall_s, gpu_s)``:
        ``kind`` "decode" or "prefill" (the step's interval prefilled), its wall seconds and a
        decode step's GPU seconds (None on a CPU, for a prefill, or when not measured; see the
        module). They must be quick and not raise: the next step waits for them.
    """

    def __init__(self, engine, *, max_queue: int = 256, max_batch: int = 64, block_tokens: int = 64,
                 prefill_chunk: int = 2048, overlap: bool = True):
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: no chunking), got {prefill_chunk}")
        self.engine = engine
        self.cache = PrefixCache(engine, block_tokens, free_pages=self._free_pages)
        self.max_queue, self.max_batch = int(max_queue), int(max_batch)
        self.prefill_chunk, self.overlap = int(prefill_chunk), bool(overlap)
        self.eos = frozenset(engine.model.config.eos_token_ids)
        self.tokenizer = engine.model.tokenizer    # stop strings are matched on decoded text
        self._ids = itertools.count()
        self._cancelled: set = set()          # aborted ids a running beam search checks each step
        self._beams = 0                       # beam searches running (outside the decode batch)
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
        self.prefill_chunks = 0               # partial chunks of long prompts prefilled
        self.decode_ms = 0.0                  # wall time between device waits that only decoded
        self.decode_steps = 0                 # steps whose interval only decoded
        self.decode_gpu_ms = 0.0              # GPU time of the decode steps measured (CUDA)
        self.decode_gpu_steps = 0             # decode steps with a GPU time
        self.step_listeners: list = []
        self._decode_times: deque = deque(maxlen=_DECODE_TIMES)   # (wall_ms, gpu_ms or None)
        self._timed = engine.device.type == "cuda"
        self._forward_events = None           # the pair around the decode forward enqueued last
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

    def max_request_len(self) -> int:
        """The longest prompt plus ``max_tokens`` that one choice alone fits in the pool, however
        it is split (what ``/v1/models`` advertises as ``max_model_len``)."""
        def fits(total: int) -> bool:
            p = np.arange(1, total)
            ps, blk = self.engine.pool.page_size, self.cache.block
            need = -(-p // ps) + -(-p // blk) + (-(-(total - p) // ps) + 2)   # pages_needed, vectorised
            return bool(need.max() <= self.capacity_pages)
        lo, hi = 1, self.engine.pool.num_slots + 1     # fits(lo); not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def submit(self, prompt, params: SamplingParams, emit) -> int:
        """Queue a request (token ids); returns its id. Raises :class:`QueueFull`."""
        with self._cv:
            if self._queued >= self.max_queue:
                raise QueueFull(f"the queue holds {self._queued} requests (limit {self.max_queue})")
            self._queued += 1
            req = Request(next(self._ids), [int(t) for t in prompt], params, emit, seed=_seed_of(params))
            self._calls.append(lambda: self._waiting.append(req))
            self._cv.notify_all()
        return req.id

    def abort(self, request_id: int) -> None:
        """Drop a request (client gone): waiting, it leaves the queue; running, its KV is freed
        before the next step."""
        with self._cv:
            self._cancelled.add(request_id)
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

        ``running``: requests in the decode batch, and a beam search while it runs (alone, between
        the batch's steps). Besides the counters of the class: ``kv_visible_tokens`` and ``kv_unique_tokens`` sum,
        over decode steps, the KV tokens the step's queries see (per query: what attention
        without prefix sharing reads) and the distinct ones (what attention reading each shared
        token once reads); ``prefill_ms``, ``prefill_steps``, ``decode_ms`` and ``decode_steps``:
        see the module; ``decode_gpu_ms`` and ``decode_gpu_steps``: the GPU time of the decode
        steps that have one and their number (0 on a CPU); ``prefill_chunks``: chunks of long
        prompts prefilled before their last one.
        """
        def read():
            pool, c = self.engine.pool, self.cache
            return {"waiting": len(self._waiting), "running": len(self._running) + self._beams, "steps": self.steps,
                    "preemptions": self.preemptions, "decoded_tokens": self.decoded,
                    "max_batch_seen": self.max_batch_seen, "strategies": dict(self.strategies),
                    "plan_ms": self.plan_ms, "kv_visible_tokens": self.kv_visible,
                    "kv_unique_tokens": self.kv_unique, "prefill_ms": self.prefill_ms,
                    "prefill_steps": self.prefill_steps, "decode_ms": self.decode_ms,
                    "decode_steps": self.decode_steps, "decode_gpu_ms": self.decode_gpu_ms,
                    "decode_gpu_steps": self.decode_gpu_steps, "prefill_chunks": self.prefill_chunks,
                    "free_pages": pool.num_free_pages,
                    "num_pages": pool.num_pages, "cached_blocks": c.num_nodes,
                    "prefix_hit_tokens": c.hit_tokens, "prefill_tokens": c.miss_tokens}
        return self.call(read)

    def decode_times(self, since: int = 0) -> dict:
        """Wall and GPU milliseconds of decode steps ``since`` (0-based, counted as
        ``decode_steps``) to now, as far as kept (the latest 65536).

        Returns
        -------
        dict
            ``first``: the index of the first step returned; ``wall_ms``: list of float;
            ``gpu_ms``: list of float or None (no GPU time), one per step.
        """
        if since < 0:
            raise ValueError(f"since must be >= 0, got {since}")

        def read():
            first = self.decode_steps - len(self._decode_times)
            skip = max(0, since - first)
            rows = list(itertools.islice(self._decode_times, skip, None))
            return {"first": first + skip, "wall_ms": [w for w, _ in rows], "gpu_ms": [g for _, g in rows]}
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
            self._iterate()

    def _iterate(self) -> None:
        """One turn of the loop: the queued calls, admissions, then one step."""
        self._run_calls()
        if not self._running:         # no decode in flight: the next interval starts now
            self._synced = time.perf_counter()
            self._forward_events = None
        try:
            self._admit()
            if self._running:
                self._step()
        except Exception as e:       # keep serving: fail the batch, free its KV
            log.exception("engine step failed")
            for req in list(self._running):
                self._fail(req, f"engine error: {e}")
            # a failed batched prefill leaves the blocks it cached without K/V: evict them all
            # (the waiting requests' chunks too) so that no prompt matches them
            for req in self._waiting:
                self._unpin(req)
            self.cache.clear()

    def _run_calls(self) -> None:
        with self._cv:
            calls = list(self._calls)
            self._calls.clear()
        for fn in calls:
            fn()

    def _dequeue(self, req: Request) -> None:
        self._waiting.remove(req)
        with self._cv:
            self._queued -= 1

    def _abort(self, request_id: int) -> None:
        with self._cv:
            self._cancelled.discard(request_id)
        for req in list(self._waiting):
            if req.id == request_id:
                self._free(req)                 # a prompt half prefilled in chunks: unpin them
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
        self._unpin(req)

    def _unpin(self, req: Request) -> None:
        """Let the chunks of ``req``'s half-prefilled prompt be evicted (they stay cached until then,
        and its next chunk starts from what is left of them)."""
        if req.pinned is not None:
            self.cache.unpin(req.pinned)
            req.pinned = None
        req.counted = 0

    def _batch_size(self) -> int:
        return sum(len(r.leaves) for r in self._running)

    def _free_pages(self) -> int:
        """Free pages of the KV pool, as admission, eviction and preemption see them."""
        return self.engine.pool.num_free_pages

    def _ensure_free(self, pages: int) -> bool:
        if self._free_pages() < pages:
            self.cache.evict(pages)
        return self._free_pages() >= pages

    def _admit(self) -> None:
        """Admit waiting requests while the batch and the KV pool allow; the prompts admitted (and
        chunks cached) in one call share one forward pass (:meth:`TreeEngine.batched_prefill`)."""
        with self.engine.batched_prefill():
            self._admit_waiting()

    def _admit_waiting(self) -> None:
        spent = self.cache.miss_tokens            # prompt tokens prefilled in this call: miss_tokens - spent
        while self._waiting:
            req = self._waiting[0]
            if not req.outputs:
                p = req.params
                req.outputs = [[] for _ in range(p.n)]
                req.finish = [None] * p.n
                req.streams = sample_streams(req.seed, req.prompt, p.n).tolist()
            if req.params.use_beam_search:
                if self._running:           # a beam search runs alone, once the batch drained
                    return
                self._dequeue(req)
                self._beams += 1
                try:
                    self._beam(req)
                finally:
                    self._beams -= 1
                continue
            live = [i for i, f in enumerate(req.finish) if f is None]
            if self._running and self._batch_size() + len(live) > self.max_batch:
                return
            longest = len(req.prompt) + max(len(o) for o in req.outputs)
            need = self.pages_needed(longest - req.counted, 1, len(live))
            if not self._ensure_free(need):
                if self._running:
                    return
                self._dequeue(req)
                self._fail(req, "the request does not fit in the KV cache")
                continue
            left = None
            if self.prefill_chunk and self._running:
                left = self.prefill_chunk - (self.cache.miss_tokens - spent)
            try:
                end = self._chunk_end(req, live, left, first=self.cache.miss_tokens == spent)
                if end is not None:
                    if end:
                        self._prefill_chunk(req, live, end)
                    return                    # the rest of the prompt after the next decode step
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

    @staticmethod
    def _context(req: Request, live: list) -> list:
        """The longest common prefix of the contexts (prompt + output so far) of choices ``live``."""
        outs = [req.outputs[i] for i in live]
        k = 0
        while all(len(o) > k for o in outs) and len({o[k] for o in outs}) == 1:
            k += 1
        return req.prompt + outs[0][:k]

    def _chunk_end(self, req: Request, live: list, left: int | None, *, first: bool) -> int | None:
        """Where ``req``'s next prefill chunk ends when the ``left`` prompt tokens this iteration
        may still prefill (None: no limit) do not cover the rest of its context: a block boundary
        (0: none fits before the next decode step). None: the whole request is placed now."""
        if left is None:
            return None
        ctx = self._context(req, live)
        if len(ctx) - req.counted <= left:        # (the cache holds at least the chunks counted)
            return None
        at = self.cache.match(ctx)[1]
        if len(ctx) - at <= left:
            return None
        blk = self.cache.block
        end = (at + max(left, 0)) // blk * blk
        if end <= at:
            if not first:
                return 0
            end = at - at % blk + blk         # a chunk budget under one block: one block a step
        return end if end < len(ctx) else None

    def _prefill_chunk(self, req: Request, live: list, end: int) -> None:
        """Cache ``req``'s context up to ``end`` (a block boundary), pinned until it is placed."""
        before = req.pinned
        req.pinned, req.counted = self.cache.insert_prefix(self._context(req, live), end, counted=req.counted)
        if before is not None:
            self.cache.unpin(before)
        self.prefill_chunks += 1

    def _place(self, req: Request, live: list) -> None:
        """Prefill the contexts (prompt + output so far) of choices ``live`` and hang a leaf for
        each below its context's last block."""
        groups: dict[tuple, list] = {}
        for i in live:
            groups.setdefault(tuple(req.prompt + req.outputs[i]), []).append(i)
        for ctx, choices in groups.items():
            node = self.cache.insert(ctx, counted=req.counted)
            req.anchors.add(node)
            for i, leaf in zip(choices, self.engine.tree.add_children(node, len(choices))):
                req.leaves[i] = leaf
        self._unpin(req)                         # its chunks now hang above the anchors

    def _preempt_for(self, pages: int) -> None:
        """Evict cached prefixes, then preempt the newest requests, until ``pages`` are free."""
        if not self._ensure_free(pages):
            for req in self._waiting:           # running requests go before a half-prefilled prompt
                self._unpin(req)
        while not self._ensure_free(pages) and len(self._running) > 1:
            req = self._running.pop()
            self._free(req)
            self._waiting.appendleft(req)
            with self._cv:
                self._queued += 1
            self.preemptions += 1
            log.info("preempted request %d (%d pages free)", req.id, self.engine.pool.num_free_pages)

    def _beam(self, req: Request) -> None:
        """Run ``req``'s beam search to its end on the idle engine (its own prompt root, outside
        the prefix cache), then emit every returned sequence at once."""
        p, eng = req.params, self.engine
        if not self._ensure_free(self.pages_needed(len(req.prompt), p.max_tokens, p.beam_width)):
            req.emit("the beam search does not fit in the KV cache")
            return
        ctl = BeamSearchController(req.prompt, num_beams=p.beam_width, max_new_tokens=p.max_tokens,
                                   length_penalty=p.length_penalty, early_stopping=p.early_stopping,
                                   eos_token_ids=() if p.ignore_eos else sorted(self.eos | set(p.stop_token_ids)),
                                   num_return_sequences=p.n)

        try:
            out = eng.run(ctl, on_step=lambda step, stats: self._between_beam_steps(req))
        except _Cancelled:
            log.info("beam search %d cancelled", req.id)
            return
        except KVPoolOutOfMemory:
            req.emit("the beam search does not fit in the KV cache")
            return
        finally:
            if getattr(ctl, "nodes", None):
                root = ctl.nodes[0] if len(ctl.nodes) == 1 else eng.tree.parent(ctl.nodes[0])
                if root in eng.tree:
                    eng.tree.prune(root, cascade=False)
            self._fold_stats()
        self.steps += 1
        events = []
        for i, seq in enumerate(out["sequences"]):
            gen = seq[len(req.prompt):]
            stopped = bool(gen) and gen[-1] in ctl.eos
            if stopped:
                gen = gen[:-1]
            req.outputs[i] = gen
            events += [Event(i, t, None) for t in gen[:-1]]
            last = gen[-1] if gen else None
            events.append(Event(i, last, "stop" if stopped else "length"))
        req.emit(events)

    def _between_beam_steps(self, req: Request) -> None:
        """Run the queued calls (submissions, aborts and stats() wait for no beam search); raise
        :class:`_Cancelled` when ``req``'s client left or the scheduler stops."""
        with self._cv:
            if self._stop or req.id in self._cancelled:
                raise _Cancelled
        self._run_calls()

    def _options(self, order: list) -> RowOptions:
        """The sampling options of the step's rows ``(request, choice)``."""
        n = len(order)
        f64 = np.zeros
        temp, top_p, pres, freq = f64(n), f64(n), f64(n), f64(n)
        seeds, streams, steps = (np.zeros(n, dtype=np.int64) for _ in range(3))
        outputs, rows, cols, vals = [], [], [], []
        top, want = 0, False
        for r, (req, i) in enumerate(order):
            p = req.params
            temp[r], top_p[r], pres[r], freq[r] = p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty
            seeds[r], streams[r], steps[r] = req.seed % 2**32, req.streams[i], len(req.outputs[i])
            outputs.append(req.outputs[i])
            for tok, b in p.logit_bias:
                rows.append(r)
                cols.append(tok)
                vals.append(b)
            if p.logprobs is not None:
                want, top = True, max(top, p.logprobs)
        bias = (np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64), np.asarray(vals, dtype=np.float64))
        return RowOptions(temp, top_p, seeds, streams, steps, pres, freq, outputs, bias, top, want)

    def _hits_stop(self, req: Request, i: int) -> bool:
        """Whether choice ``i``'s text now contains one of its stop strings; only the tail that can
        hold a new match is decoded (a character takes at most 4 byte-level tokens)."""
        longest = max(len(x) for x in req.params.stop)
        tail = self.tokenizer.decode(req.outputs[i][-(4 * longest + 4):])
        return any(x in tail for x in req.params.stop)

    def _step(self) -> None:
        eng = self.engine
        self._preempt_for(self._batch_size())
        order = [(req, i) for req in self._running for i in sorted(req.leaves)]
        self.decoded += len(order)
        self.max_batch_seen = max(self.max_batch_seen, len(order))
        leaves = [req.leaves[i] for req, i in order]
        logits, options = eng.logits_for(leaves), self._options(order)
        sampling = _timing_events() if self._timed else None
        if sampling is not None:
            sampling[0].record()
        choice = choose_tokens(logits, options)
        if sampling is not None:
            sampling[1].record()
        pending = _HostCopy(choice)          # (behind both pairs of this step's events)
        forward, self._forward_events = self._forward_events, None
        # tokens each row may take after this one (0: it reaches max_tokens now)
        left = [req.params.max_tokens - len(req.outputs[i]) - 1 for req, i in order]
        going = [r for r, n in enumerate(left) if n > 0]
        if self.overlap and going:          # the next step runs on the GPU while the host reads this one
            tokens = choice.tokens
            if len(going) < len(order):
                tokens = tokens.index_select(0, upload(np.asarray(going), eng.device))
            self._decode(order, going, tokens, left)
        host, lps, top_ids, top_values = pending.wait()
        self._count_interval(_elapsed_ms(forward, sampling))
        events = {}
        for r, ((req, i), tok) in enumerate(zip(order, host)):
            p = req.params
            ev = events.setdefault(req.id, (req, []))[1]
            lp, top = None, ()
            if p.logprobs is not None:
                lp = lps[r]
                top = tuple(zip(top_ids[r][: p.logprobs], top_values[r][: p.logprobs])) if p.logprobs else ()
            if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
                req.finish[i] = "stop"
                ev.append(Event(i, None, "stop", lp, top))
            else:
                req.outputs[i].append(tok)
                if p.stop and self._hits_stop(req, i):
                    req.finish[i] = "stop"
                else:
                    req.finish[i] = "length" if len(req.outputs[i]) >= p.max_tokens else None
                ev.append(Event(i, tok, req.finish[i], lp, top))
            if req.finish[i] is not None:   # (overlapped, it was decoded once more: that token is dropped)
                eng.tree.prune(req.leaves.pop(i), cascade=False)
        for req, ev in events.values():
            req.emit(ev)
            if not req.leaves:
                self._free(req)
                self._running.remove(req)
        if not self.overlap:
            going = [r for r in going if order[r][0].finish[order[r][1]] is None]
            if going:
                self._decode(order, going, upload(np.asarray(host)[going], eng.device), left)
        self.steps += 1
        self._fold_stats()

    def _decode(self, order: list, rows: list, tokens: torch.Tensor, left: list) -> None:
        """Enqueue the decode step of rows ``rows`` of ``order`` with their sampled ``tokens``
        (device int64 ``[len(rows)]``); ``left``: tokens each row of ``order`` may take after them."""
        events = _timing_events() if self._timed else None
        self.engine.decode([order[r][0].leaves[order[r][1]] for r in rows], tokens,
                           horizon=min(left[r] for r in rows), events=events)
        self._forward_events = events

    def _fold_stats(self) -> None:
        """Fold the engine's per-step StepStats into counters, so that a long-running server does
        not accumulate them."""
        eng = self.engine
        for st in eng.stats:
            self.plan_ms += st.plan_ms
            if st.strategy:
                self.strategies[st.strategy] = self.strategies.get(st.strategy, 0) + 1
            self.kv_visible += st.visible_tokens
            self.kv_unique += st.unique_tokens
        eng.stats.clear()

    def _count_interval(self, gpu_ms: float | None) -> None:
        """Add the wall time since the last device wait to ``prefill_ms`` or ``decode_ms``, and a
        decode step's ``gpu_ms`` (None: not measured) to its counters; tell the listeners."""
        now, miss = time.perf_counter(), self.cache.miss_tokens
        ms = (now - self._synced) * 1e3
        if miss != self._synced_miss:
            kind, gpu_ms = "prefill", None
            self.prefill_ms += ms
            self.prefill_steps += 1
        else:
            kind = "decode"
            self.decode_ms += ms
            self.decode_steps += 1
            self._decode_times.append((ms, gpu_ms))
            if gpu_ms is not None:
                self.decode_gpu_ms += gpu_ms
                self.decode_gpu_steps += 1
        self._synced, self._synced_miss = now, miss
        for fn in self.step_listeners:
            fn(kind, ms / 1e3, None if gpu_ms is None else gpu_ms / 1e3)
