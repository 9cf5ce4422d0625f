"""Measured ``auto`` in the engine: an autotuner over the cost model's near-best strategies.

The cost model was fitted on kernel-benchmark timings whose launches overlap on side streams; in
the engine they run in a CUDA graph replayed for every layer, on one stream (one after another, or
overlapping as programmatic dependent launches on Hopper), and close calls
can go the wrong way (Tree-of-Thoughts sorting on an H200: ``node_chunk`` rated 4-7% faster than
``sequence``, measured ~2.5 us a layer slower). So when ``auto`` decides for a new shape key (see
:class:`~treeattn.engine.planning.StepPlanner`), the strategies it rates within ``margin`` of its
best estimate become *arms*, and the key's next plans cycle through them. The engine times the
attention of a few layers in every step of a trial plan on the device; once each arm has
``samples`` measured plans, the one with the lowest mean per-layer time is the key's strategy from
then on (a bounded memo of keys, so that a key seen again is not tried again).

Arms take turns in a serpentine order (A B C C B A A B C ...), and a trial plan ends its decode
window after ``window`` steps, so that a trial takes a few dozen steps. With an even ``samples``, a
tree that grows linearly over the trial gives every arm the same mean size. A plan's sample is the
median over the steps it ran, which drops one-off stalls.

Nothing waits for the device: CUDA events are read only once ``query()`` says they completed,
when later plans are made.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["EventTimer", "HostTimer", "StrategyTuner"]


class EventTimer:
    """Device timestamps: CUDA events recorded on the current stream, read once completed."""

    @staticmethod
    def mark() -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @staticmethod
    def elapsed(start: torch.cuda.Event, end: torch.cuda.Event) -> float | None:
        """Seconds from ``start`` to ``end``; None while the device has not reached ``end``."""
        if not end.query():
            return None
        return start.elapsed_time(end) * 1e-3


class HostTimer:
    """Host timestamps (``time.perf_counter``), for devices whose work is done when a call returns
    (CPU)."""

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def elapsed(start: float, end: float) -> float:
        return end - start


@dataclass
class _Trial:
    """One shape key: its arms (best estimate first) and what was measured."""

    arms: tuple
    estimates: dict
    samples: dict = field(default_factory=dict)     # arm -> [seconds per layer, one per plan]
    turn: int = 0
    winner: str | None = None
    reason: str = ""

    def next_arm(self) -> str:
        n = len(self.arms)
        i, lap = self.turn % n, self.turn // n
        self.turn += 1
        return self.arms[i if lap % 2 == 0 else n - 1 - i]


@dataclass
class _Record:
    """A trial plan's measurements: per step, the (start, end) marks of its timed layers."""

    key: tuple
    arm: str
    plan: object
    steps: list = field(default_factory=list)


class _Probe:
    """``probe(event, layer)`` for the engine's attention events of one step."""

    def __init__(self, timer, layers: frozenset, marks: list):
        self.timer, self.layers, self.marks, self._start = timer, layers, marks, None

    def __call__(self, event: str, layer: int) -> None:
        if layer not in self.layers:
            return
        if event == "attn_begin":
            self._start = self.timer.mark()
        elif event == "attn_end" and self._start is not None:
            self.marks.append((self._start, self.timer.mark()))
            self._start = None


class StrategyTuner:
    """Picks among ``auto``'s near-best strategies by timing them (see the module docstring).

    Parameters
    ----------
    timer : EventTimer or HostTimer or object
        ``mark()`` returns a timestamp taken in stream order, ``elapsed(start, end)`` the seconds
        between two, or None while they are not available yet.
    margin : float
        Strategies whose estimate is within this fraction of the best one are tried.
    max_arms : int
        Try at most this many (``auto``'s own pick and the next best estimates).
    samples : int
        Measured plans each arm needs before the key decides.
    window : int
        Steps a trial plan runs at most (the engine ends its decode window there, so that arms
        take turns every few steps rather than every window).
    layers : int
        Layers timed per step (spread over the model; each costs two timer marks).
    memo_size : int
        Shape keys remembered (least recently used ones are dropped).
    """

    def __init__(self, *, timer, margin: float = 0.15, max_arms: int = 3, samples: int = 2,
                 window: int = 4, layers: int = 4, memo_size: int = 64):
        self.timer = timer
        self.margin, self.max_arms, self.samples = float(margin), int(max_arms), max(1, int(samples))
        self.window = max(1, int(window))
        self.layers, self.memo_size = max(1, int(layers)), max(1, int(memo_size))
        self._keys: OrderedDict = OrderedDict()     # shape key -> _Trial
        self._open: _Record | None = None           # the latest trial plan (it may run again)
        self._closed: list = []                     # earlier trial plans, marks maybe incomplete
        self.trial_plans = 0
        self.measured_steps = 0
        self.decisions = 0

    # ------------------------------------------------------------------ planning
    def choose(self, key: tuple) -> tuple:
        """``(strategy, note, is_trial)`` for the next plan of ``key``: its measured winner or its
        next trial arm; ``(None, "", False)`` when it has neither (``auto`` decides, then
        :meth:`start`)."""
        self._close()
        self.poll()
        trial = self._keys.get(key)
        if trial is None:
            return None, "", False
        self._keys.move_to_end(key)
        if trial.winner is not None:
            return trial.winner, trial.reason, False
        arm = trial.next_arm()
        return arm, self._trial_note(trial, arm), True

    def start(self, key: tuple, chosen: str, candidates) -> str:
        """``auto`` chose ``chosen`` for ``key`` from ``candidates`` (``(strategy, estimated
        seconds)``, best first): its near-best ones become the key's arms, ``chosen`` first, and
        this plan is ``chosen``'s first trial. Returns a note for the plan's reason ("" when there
        is nothing to try)."""
        if not candidates:
            return ""
        best, est = candidates[0][1], dict(candidates)
        arms = [chosen]
        for name, seconds in candidates:
            # planners that made the same items share one (bit-identical) estimate: one arm
            if (len(arms) < self.max_arms and seconds <= best * (1.0 + self.margin)
                    and all(est[a] != seconds for a in arms)):
                arms.append(name)
        if len(arms) < 2:
            return ""
        trial = _Trial(tuple(arms), {a: est[a] for a in arms})
        self._keys[key] = trial
        while len(self._keys) > self.memo_size:
            self._keys.popitem(last=False)
        return self._trial_note(trial, trial.next_arm())

    def track(self, key: tuple, arm: str, plan) -> None:
        """``plan`` (as the engine will run it) is a trial of ``arm`` for ``key``."""
        self.trial_plans += 1
        self._open = _Record(key, arm, plan)

    def _trial_note(self, trial: _Trial, arm: str) -> str:
        arms = ", ".join(f"{a} {trial.estimates[a] * 1e6:.1f}us" for a in trial.arms)
        return f"measuring auto's near-best strategies ({arms} estimated): trial of {arm}"

    def steps(self, plan, steps: int) -> int:
        """Steps of a decode window of ``steps`` that ``plan`` should run."""
        return min(steps, self.window) if self._open is not None and self._open.plan is plan else steps

    # ------------------------------------------------------------------ measuring
    def probe(self, plan, num_layers: int):
        """``probe(event, layer)`` timing this step's attention when ``plan`` is the current
        trial plan, else None (nothing to do on other steps)."""
        rec = self._open
        if rec is None or rec.plan is not plan:
            return None
        rec.steps.append([])
        self.measured_steps += 1
        stride = max(1, num_layers // self.layers)
        return _Probe(self.timer, frozenset(range(0, num_layers, stride)[: self.layers]), rec.steps[-1])

    def _close(self) -> None:
        if self._open is not None:
            self._closed.append(self._open)
            self._open = None

    def poll(self) -> None:
        """Take in the trial plans whose timings are complete, deciding keys whose arms all have
        ``samples`` of them."""
        waiting = []
        for rec in self._closed:
            steps = [s for s in rec.steps if s]
            if steps and self.timer.elapsed(*steps[-1][-1]) is None:
                waiting.append(rec)         # marks complete in order: the last one decides
                continue
            trial = self._keys.get(rec.key)
            if not steps or trial is None or trial.winner is not None:
                continue
            per_layer = [sum(self.timer.elapsed(a, b) for a, b in s) / len(s) for s in steps]
            trial.samples.setdefault(rec.arm, []).append(float(np.median(per_layer)))
            if all(len(trial.samples.get(a, ())) >= self.samples for a in trial.arms):
                self._decide(trial)
        self._closed = waiting

    def _decide(self, trial: _Trial) -> None:
        mean = {a: float(np.mean(trial.samples[a])) for a in trial.arms}
        trial.winner = min(trial.arms, key=mean.get)
        ranked = sorted(trial.arms, key=mean.get)
        times = ", ".join(f"{a} {mean[a] * 1e6:.1f}us/layer" for a in ranked)
        est = ", ".join(f"{a} {trial.estimates[a] * 1e6:.1f}us" for a in trial.arms)
        trial.reason = f"measured: {times} (cost model estimates: {est})"
        self.decisions += 1

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict:
        """JSON-able: counters and, per remembered key, its arms, measured means and winner."""
        keys = {}
        for key, t in self._keys.items():
            name = " ".join(f"{n}<2^{b}" for n, b in zip(("nodes", "queries", "tokens", "sharing"), key))
            keys[name] = {
                "winner": t.winner, "arms": list(t.arms),
                "estimate_us": {a: round(t.estimates[a] * 1e6, 3) for a in t.arms},
                "measured_us_per_layer": {a: round(float(np.mean(s)) * 1e6, 3)
                                          for a, s in t.samples.items()},
                "samples": {a: len(s) for a, s in t.samples.items()}}
        return {"decisions": self.decisions, "trial_plans": self.trial_plans,
                "measured_steps": self.measured_steps, "keys": keys}
