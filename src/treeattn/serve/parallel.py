"""Serving a model split over several processes (``treeattn serve --tp N --sp M`` under
torchrun): :class:`ReplicatedScheduler`, the same scheduler loop on every rank.

Every rank holds its share of the weights (tensor parallelism) and of the KV cache (a
sequence-sharded pool), and every decode step and prefill is a collective of all of them: each
rank must take the same decisions in the same order. The scheduler loop is deterministic given
its inputs (the all-gathered logits are the same on every rank, and sampling is counter-based:
a row's noise depends on its request's seed, stream and output index only), so every rank runs
the whole loop (admission, prefix cache, preemption, sampling, stop checks) on its own, and
only the inputs that come from outside are replicated: rank 0 alone runs the HTTP server, and
at the top of every loop iteration it broadcasts what arrived since the last one (new requests
with their token ids, sampling parameters and the seed drawn for them, aborts of clients gone,
cache flushes, the stop) to every rank, which applies them in the same order before admitting
and stepping. A beam search (a loop of its own inside one iteration) exchanges them between its
steps. Nothing else differs between ranks, except, with a sequence-sharded KV cache, each
rank's free pages (it stores only its part of each sequence): the ranks then agree on the
fewest free pages (an all-reduce) wherever admission, eviction or preemption read them.

The exchange runs on a gloo group of all ranks (CPU tensors, :func:`control_group`), apart from
the GPUs' own collectives: an 8-byte length (0 when nothing arrived, the common case in a long
decode) and, only when something arrived, the pickled inputs. It is the host's work between two
steps, so with the scheduler's overlap it runs while the GPU decodes the next step. A server
without requests sends one every ``heartbeat_s`` seconds so that the other ranks, waiting for
it, never reach the group's timeout. A single-process server uses
:class:`~treeattn.serve.scheduler.Scheduler` itself: no exchange at all.

Shutdown: rank 0 drains its HTTP server on SIGTERM / SIGINT (running requests get the grace
period), then broadcasts the stop and every rank leaves its loop. The other ranks ignore those
signals (torchrun forwards its own to every rank) while they wait for the stop, and give up on
it ``grace + 10`` seconds after the signal. A rank that loses the others (a collective fails)
fails its requests and stops; torchrun then ends the group.
"""
from __future__ import annotations

import itertools
import logging
import pickle
import signal
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist

from treeattn.serve.scheduler import QueueFull, Request, Scheduler, _Cancelled, _seed_of

__all__ = ["ReplicatedScheduler", "control_group"]

log = logging.getLogger(__name__)

#: seconds a rank other than 0 waits for the stop after SIGTERM / SIGINT, beyond the grace period
_STOP_MARGIN_S = 10.0


def control_group():
    """A gloo process group of every rank, for the scheduler's exchange (collective: every rank
    calls it, after ``torch.distributed`` is initialised)."""
    return dist.new_group(backend="gloo")


def _ignore(event) -> None:
    """The events of a request on a rank without clients go nowhere."""


class ReplicatedScheduler(Scheduler):
    """A :class:`~treeattn.serve.scheduler.Scheduler` whose loop runs on every rank of a
    ``torch.distributed`` world in lockstep (see the module).

    Rank 0 is the one clients talk to: :meth:`submit`, :meth:`abort`, :meth:`flush_cache` and
    :meth:`stop` work there only, :meth:`call` runs its function on rank 0's engine thread
    (to read state, never to change it). Every other rank runs :meth:`follow`.

    Parameters
    ----------
    engine : TreeEngine
        This rank's engine: a tensor-parallel model's share, a
        :class:`~treeattn.engine.sharded.ShardedTreeEngine` for a sequence-sharded KV cache.
    group : ProcessGroup
        A gloo group of every rank (:func:`control_group`); global rank 0 leads.
    agree_pages : bool
        The ranks' pools differ (a sequence-sharded KV cache): agree on the fewest free pages.
    heartbeat_s : float
        Most seconds between two exchanges while idle.
    **kw
        :class:`~treeattn.serve.scheduler.Scheduler` options.

    Attributes
    ----------
    error : Exception or None
        Why the loop ended by itself (a failed exchange).
    stop_listeners : list of callable
        Called without arguments on the engine thread when the loop ends by itself (rank 0's
        server drains then).
    """

    def __init__(self, engine, *, group, agree_pages: bool = False, heartbeat_s: float = 10.0, **kw):
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.group, self.agree_pages, self.heartbeat_s = group, bool(agree_pages), float(heartbeat_s)
        self.rank = dist.get_rank()
        self._ops: list = []                  # rank 0: inputs not broadcast yet
        self._emits: dict = {}                # rank 0: request id -> its client's emit
        self._flushes: dict = {}              # rank 0: flush id -> its Future
        self._flush_ids = itertools.count()
        self._length = torch.zeros(1, dtype=torch.int64)
        self._stopping = False                # the stop was applied (on every rank at once)
        self.error: Exception | None = None
        self.stop_listeners: list = []
        super().__init__(engine, **kw)

    # ------------------------------------------------------------------ rank 0, other threads
    def _leader(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{what} on rank {self.rank}: only rank 0 takes requests")

    def submit(self, prompt, params, emit) -> int:
        """Queue a request (token ids) on every rank; returns its id. Raises :class:`QueueFull`."""
        self._leader("submit")
        with self._cv:
            if self.error is not None:
                raise QueueFull(f"the server lost its other ranks: {self.error}")
            if self._queued >= self.max_queue:
                raise QueueFull(f"the queue holds {self._queued} requests (limit {self.max_queue})")
            self._queued += 1
            rid = next(self._ids)
            self._emits[rid] = emit
            self._ops.append(("submit", rid, [int(t) for t in prompt], params, _seed_of(params)))
            self._cv.notify_all()
        return rid

    def abort(self, request_id: int) -> None:
        """Drop a request on every rank (client gone)."""
        self._leader("abort")
        self._post_op(("abort", request_id))

    def flush_cache(self) -> int:
        """Evict every unreferenced cached prefix on every rank; returns the number of blocks."""
        self._leader("flush_cache")
        fut: Future = Future()
        with self._cv:
            key = next(self._flush_ids)
            self._flushes[key] = fut
        self._post_op(("flush", key))
        return fut.result(30.0)

    def _post_op(self, op: tuple) -> None:
        with self._cv:
            self._ops.append(op)
            self._cv.notify_all()

    # ------------------------------------------------------------------ other ranks
    def follow(self, *, grace: float) -> int:
        """Run the loop on a rank other than 0 until rank 0 stops it (call from the main thread).

        SIGTERM and SIGINT are ignored while rank 0 drains; the rank gives up on the stop
        ``grace + 10`` seconds after the first of them. Returns an exit status: 0 when stopped
        by rank 0, 1 when it lost the other ranks or gave up.
        """
        if self.rank == 0:
            raise RuntimeError("rank 0 serves (run_server); follow() is for the other ranks")
        deadline = []

        def on_signal(signum, frame) -> None:
            if not deadline:
                log.info("rank %d: %s, waiting for rank 0 to stop the group", self.rank,
                         signal.Signals(signum).name)
                deadline.append(time.monotonic() + grace + _STOP_MARGIN_S)
        before = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            while self._thread.is_alive():
                self._thread.join(0.2)          # (short waits: the signal handler runs between them)
                if deadline and time.monotonic() > deadline[0]:
                    log.error("rank %d: no stop from rank 0 within %.0f s of the signal", self.rank,
                              grace + _STOP_MARGIN_S)
                    return 1
        finally:
            for s, h in before.items():
                signal.signal(s, h)
        self._thread = None
        return 0 if self.error is None else 1

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while not self._stopping:
                self._exchange(wait=True)
                if not self._stopping:
                    self._iterate()
        except Exception as e:          # a failed collective: the other ranks are gone
            log.exception("rank %d lost the other ranks", self.rank)
            self.error = e
            for req in list(self._running) + list(self._waiting):
                req.emit(f"the server lost its other ranks: {e}")
            with self._cv:
                for rid in [op[1] for op in self._ops if op[0] == "submit"]:
                    self._emits.pop(rid)(f"the server lost its other ranks: {e}")
                self._ops.clear()
                for fut in self._flushes.values():
                    fut.set_exception(RuntimeError("the server lost its other ranks"))
                self._flushes.clear()
            for fn in self.stop_listeners:
                fn()

    def _exchange(self, *, wait: bool) -> list:
        """Broadcast (rank 0) or receive the inputs that arrived since the last exchange, and apply
        them; returns them. ``wait``: rank 0 first waits, while idle, for something to arrive (at
        most ``heartbeat_s``)."""
        if self.rank == 0:
            with self._cv:
                if wait and not (self._stop or self._ops or self._calls or self._waiting or self._running):
                    self._cv.wait(self.heartbeat_s)
                ops, self._ops = self._ops, []
                if self._stop:
                    ops.append(("stop",))
            payload = pickle.dumps(ops) if ops else b""
            self._length[0] = len(payload)
            dist.broadcast(self._length, 0, group=self.group)
            if payload:
                dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, group=self.group)
        else:
            dist.broadcast(self._length, 0, group=self.group)
            ops = []
            if int(self._length[0]):
                buf = torch.empty(int(self._length[0]), dtype=torch.uint8)
                dist.broadcast(buf, 0, group=self.group)
                ops = pickle.loads(buf.numpy().tobytes())
        for op in ops:
            self._apply(op)
        return ops

    def _apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "submit":
            _, rid, prompt, params, seed = op
            if self.rank == 0:
                emit = self._emits.pop(rid)
            else:
                emit = _ignore
                with self._cv:
                    self._queued += 1
            self._waiting.append(Request(rid, prompt, params, emit, seed=seed))
        elif kind == "abort":
            self._abort(op[1])
        elif kind == "flush":
            n = self.cache.clear()
            if self.rank == 0:
                with self._cv:
                    fut = self._flushes.pop(op[1])
                fut.set_result(n)
        elif kind == "stop":
            self._stopping = True
        else:
            raise ValueError(f"unknown scheduler input {kind!r}")

    def _between_beam_steps(self, req: Request) -> None:
        """Exchange the inputs between two steps of a beam search (its client may have left)."""
        ops = self._exchange(wait=False)
        self._run_calls()
        if self._stopping or ("abort", req.id) in ops:
            raise _Cancelled

    def _free_pages(self) -> int:
        free = self.engine.pool.num_free_pages
        if not self.agree_pages:
            return free
        t = torch.tensor([free], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t[0])
