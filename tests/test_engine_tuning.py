"""Measured ``auto`` in the engine (:mod:`treeattn.engine.tuning`): the planner tries auto's
near-best strategies, times them with an injected clock and keeps the fastest."""
import numpy as np
import pytest
import torch

from treeattn import DecodingTree, HeadConfig, make_plan
from treeattn.engine import Sampler, SamplingController, TreeEngine, TreeModel
from treeattn.engine.controller import periodic_branching
from treeattn.engine.planning import StepPlanner
from treeattn.engine.tuning import HostTimer, StrategyTuner
from treeattn.plan import PLANNERS
from treeattn.tree import tree_from_medusa

HEADS = HeadConfig(32, 8, 128, torch.bfloat16)
LAYERS = 4


def near_best(tree) -> list:
    """The tuner's arms for ``tree`` at its defaults: ``auto``'s choice, then the other strategies
    estimated within 15% of the best (distinct estimates), three at most."""
    plan = make_plan(tree, HEADS, strategy="auto")
    est = dict(plan.candidates)
    best = plan.candidates[0][1]
    arms = [plan.strategy]
    for name, seconds in plan.candidates:
        if len(arms) < 3 and seconds <= best * 1.15 and all(est[a] != seconds for a in arms):
            arms.append(name)
    return arms


#: trees by how many of auto's candidates the cost model rates near the best (which ones depends
#: on its fitted constants)
THREE_ARMS = DecodingTree.from_parents([-1] + [0] * 16, [1000] + [60] * 16)
A, B, C = near_best(THREE_ARMS)
_OTHERS = [tree_from_medusa(32, context_len=90), DecodingTree.from_parents([-1] + [0] * 8, [3000] + [100] * 8),
           tree_from_medusa(32, context_len=2800), tree_from_medusa(64, context_len=1000)]
ONE_ARM = next(t for t in _OTHERS if len(near_best(t)) == 1)
ONE = near_best(ONE_ARM)[0]
SOME_ARMS = next(t for t in _OTHERS if len(near_best(t)) > 1)

pytestmark = pytest.mark.usefixtures("one_thread")


class FakeClock:
    """A device clock the test advances; ``ready=False`` holds its timings back (not completed)."""

    def __init__(self):
        self.now, self.ready = 0.0, True

    def mark(self):
        return self.now

    def elapsed(self, start, end):
        return end - start if self.ready else None


def run_step(planner, plan, clock, us):
    """What the engine does for one step: attention of every layer, ``us[strategy]`` each, with
    the tuner's probe around it."""
    probe = planner.probe(plan, LAYERS)
    for layer in range(LAYERS):
        if probe is not None:
            probe("attn_begin", layer)
        clock.now += us[plan.strategy] * 1e-6
        if probe is not None:
            probe("attn_end", layer)


def tuned_planner(clock, **kw):
    return StepPlanner(HEADS, strategy="auto", device="cpu", tuner=StrategyTuner(timer=clock, **kw))


def test_auto_plans_carry_the_ranked_candidates():
    plan = make_plan(THREE_ARMS, HEADS, strategy="auto")
    names = [n for n, _ in plan.candidates]
    est = [s for _, s in plan.candidates]
    assert sorted(names) == sorted(PLANNERS) and est == sorted(est)
    assert plan.strategy == names[0] == A
    assert make_plan(THREE_ARMS, HEADS, strategy="sequence").candidates == ()


def test_tuner_tries_the_near_best_arms_then_keeps_the_measured_fastest():
    clock, us = FakeClock(), {A: 20.0, B: 30.0, C: 10.0}
    planner = tuned_planner(clock)
    used = []
    for i in range(9):
        plan = planner.plan(THREE_ARMS)
        used.append(plan.strategy)
        if i == 0:
            assert plan.requested_strategy == "auto" and "measuring auto's near-best" in plan.reason
        run_step(planner, plan, clock, us)
    # serpentine turns (auto's pick first), two measured plans each, then the fastest
    assert used == [A, B, C, C, B, A] + [C] * 3
    assert planner.last_reason.startswith(f"measured: {C} 10.0us/layer, {A} 20.0us/layer, {B} 30.0us/layer")
    assert f"measured: {C}" in plan.explain()
    t = planner.tuner
    assert t.trial_plans == 6 and t.decisions == 1 and planner.probe(plan, LAYERS) is None
    summary = next(iter(t.summary()["keys"].values()))
    assert summary["winner"] == C and summary["samples"] == {a: 2 for a in us}
    assert summary["measured_us_per_layer"] == pytest.approx(us)


def test_measured_winner_is_remembered_per_shape():
    clock = FakeClock()
    us = dict.fromkeys(PLANNERS, 50.0) | {A: 20.0, B: 30.0, C: 10.0}
    planner = tuned_planner(clock, samples=1)
    planner.auto_refresh = 2
    for _ in range(4):
        run_step(planner, planner.plan(THREE_ARMS), clock, us)
    assert planner.tuner.decisions == 1
    other = planner.plan(ONE_ARM)       # another shape in between, then back: no new trial
    assert other.strategy == ONE
    for _ in range(5):                  # and none after auto_refresh plans either
        plan = planner.plan(THREE_ARMS)
        assert plan.strategy == C and plan.reason.startswith("measured")
        run_step(planner, plan, clock, us)
    assert planner.tuner.trial_plans == 3
    small = tuned_planner(clock, samples=1, memo_size=1)    # a one-key memo forgets the first
    for tree in (THREE_ARMS, THREE_ARMS, SOME_ARMS):
        run_step(small, small.plan(tree), clock, us)
    assert small.plan(THREE_ARMS).requested_strategy == "auto"


def test_timings_are_read_only_once_completed():
    clock, us = FakeClock(), {A: 20.0, B: 30.0, C: 10.0}
    clock.ready = False
    planner = tuned_planner(clock, max_arms=2)
    used = []
    for _ in range(8):
        plan = planner.plan(THREE_ARMS)
        used.append(plan.strategy)
        run_step(planner, plan, clock, us)
    assert used == [A, B, B, A] * 2   # still trying
    assert planner.tuner.decisions == 0
    clock.ready = True
    assert planner.plan(THREE_ARMS).strategy == A
    assert planner.tuner.summary()["keys"].popitem()[1]["samples"] == {A: 2, B: 2}


def test_no_trial_with_a_single_near_best_candidate():
    clock = FakeClock()
    planner = tuned_planner(clock)
    for _ in range(3):
        plan = planner.plan(ONE_ARM)
        assert plan.strategy == ONE and "measur" not in plan.reason
        assert planner.probe(plan, LAYERS) is None
    assert planner.tuner.trial_plans == 0 and planner.tuner.summary()["keys"] == {}


def test_without_a_tuner_plans_are_unchanged():
    """tune off (the CPU default): the same plans as a planner without a tuner, reused likewise."""
    eng = TreeEngine(TreeModel.random("tiny"), kv_tokens=256)
    assert eng.planner.tuner is None
    assert TreeEngine(TreeModel.random("tiny"), kv_tokens=256, strategy="sequence", tune=True).planner.tuner is None
    plain = StepPlanner(HEADS, strategy="auto", device="cpu")
    # THREE_ARMS with its tokens in other slots: the same shape key, but no lazy update applies
    moved = DecodingTree.from_parents(THREE_ARMS.parents, THREE_ARMS.lengths,
                                      kv_indices=THREE_ARMS.kv_indices + 5000)
    got, patched = [], []
    for t in (THREE_ARMS, moved, ONE_ARM, THREE_ARMS):
        got.append(plain.plan(t))
        patched.append(plain.last_patched)
    assert patched == [False] * 4
    assert [p.requested_strategy for p in got] == ["auto", A, "auto", "auto"]
    assert [p.strategy for p in got] == [A, A, ONE, A]
    # the same tree again gets the last plan back (a lazy update that appends nothing)
    assert plain.plan(THREE_ARMS).strategy == A and plain.last_patched
    assert got[0].reason == make_plan(THREE_ARMS, HEADS).reason
    assert plain.probe(got[0], LAYERS) is None

def test_engine_times_trial_steps_and_keeps_the_fastest_arm():
    """The engine's attention events reach the tuner's probe: with a clock that charges each
    strategy a fixed time per layer, every decided shape keeps its cheapest arm. Trial plans end
    their decode windows after the tuner's ``window`` steps."""
    eng = TreeEngine(TreeModel.random("tiny"), kv_tokens=4096, page_size=4, window=8, tune=True)
    clock = FakeClock()
    us = {"sequence": 10.0, "node": 40.0, "node_chunk": 20.0, "flatten": 30.0, "pack": 25.0, "greedy": 35.0,
          "paths": 15.0}
    eng.planner.tuner = StrategyTuner(timer=clock, margin=10.0, samples=1, window=2)
    run = eng.attention.run

    def timed(q, k, v, plan, **kw):
        clock.now += us[plan.strategy] * 1e-6
        return run(q, k, v, plan, **kw)

    eng.attention.run = timed
    eng.run(SamplingController([list(range(3, 40))], n=2, sampler=Sampler(seed=0), max_new_tokens=40,
                               callbacks=periodic_branching(4, 2, 8)))
    summary = eng.planner.tuner.summary()
    decided = [k for k in summary["keys"].values() if k["winner"] is not None]
    assert decided and 0 < summary["measured_steps"] <= 2 * summary["trial_plans"]
    for k in decided:
        assert k["winner"] == min(k["arms"], key=us.get)
        assert k["measured_us_per_layer"] == pytest.approx({a: us[a] for a in k["arms"]})
    assert len({s.strategy for s in eng.stats if s.kind == "decode"}) > 1


def test_host_timer_measures_seconds():
    t = HostTimer()
    a = t.mark()
    assert 0.0 <= t.elapsed(a, t.mark()) < 1.0 and np.isfinite(t.elapsed(a, a))
