"""Leave-one-family-out cross-validation of ``auto``'s choice, on measured latencies.

``treeattn bench kernels`` with every strategy times each strategy's plan of every tree under
CUDA-graph replay. For each family of trees (:func:`~treeattn.tree.families.tree_family`) held
out, the profile's fitted constants (:data:`~treeattn.plan.select.profiles.FITTED_CONSTANTS`) are
refitted (:func:`~treeattn.plan.select.profiles.fit_constants`) to the latencies of every
strategy on the other families' trees, and ``auto``'s rule
(:func:`~treeattn.plan.select.auto.plan_auto`: the best estimate, or the fewest kernels within
``choice_margin`` of it) picks among the plans that were timed for each held-out tree. Its
regret is the chosen plan's measured time over the fastest plan's. The same choices under the
profile as it is are reported beside (for the kernel suite's families these are not held out:
the built-in constants were fitted on the suite).

The candidates are the plans each strategy made under the run's profile (those timed), rated
under the refitted one: a planner that weighs variants (``paths``) might pick another variant
under the refitted constants, and that plan was not timed.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from treeattn.plan import PLANNERS
from treeattn.plan.format import HeadConfig
from treeattn.plan.select.auto import plan_auto
from treeattn.plan.select.cost import CostModel
from treeattn.plan.select.estimate import estimate_many
from treeattn.plan.select.profiles import BUILTIN_PROFILES, FITTED_CONSTANTS, H200, fit_constants
from treeattn.tree import DecodingTree
from treeattn.tree.families import tree_by_name, tree_family

__all__ = ["TimedCase", "timed_cases", "run_cost", "choose", "cross_validate", "HIT", "OBJECTIVES"]

#: a choice within this ratio of the fastest plan counts as a hit
HIT = 1.05


@dataclass(frozen=True, eq=False)
class TimedCase:
    """One row of a ``bench kernels`` result: the tree ``name`` of ``family`` at ``heads``, the
    ``measured`` graph-replay seconds of every strategy, the ``(items, note)`` each strategy
    planned (``planned``, under ``cost``: those timed) and the strategy ``auto`` chose in the run."""

    name: str
    family: str
    heads: HeadConfig
    tree: DecodingTree
    measured: dict
    planned: dict
    cost: CostModel
    run_choice: str | None


def run_cost(result: dict) -> CostModel:
    """The cost model a ``bench kernels`` run planned with: its launch mode (``streams``,
    ``pdl``, ``tma``; those of an H200 run where absent) and the built-in profile of its
    ``device`` (the H200's for another device)."""
    pdl = bool(result.get("pdl", True))
    profile = next((p for p in BUILTIN_PROFILES if p.name == result.get("device")), H200)
    return CostModel(profile=profile, tma=bool(result.get("tma", True)), pdl=pdl,
                     side_streams=int(result.get("streams", 0)) > 0 or pdl)


def timed_cases(results: list) -> list[TimedCase]:
    """The :class:`TimedCase` of every row of ``results`` (parsed ``bench kernels`` JSON objects).

    Raises
    ------
    ValueError
        For a result without rows, or a row without the graph-replay time of every strategy of
        :data:`~treeattn.plan.PLANNERS` (run ``bench kernels`` without ``--strategies``).
    """
    cases = []
    for result in results:
        rows = result.get("rows") if isinstance(result, dict) else None
        if not rows:
            raise ValueError("a bench kernels result holds 'rows'; this one has none")
        cost = run_cost(result)
        dtype = getattr(torch, str(result.get("dtype", "float16")))
        for row in rows:
            missing = [s for s in PLANNERS if s not in row.get("graph_us", {})]
            if missing:
                raise ValueError(f"{row.get('tree')} {row.get('hq')}/{row.get('hkv')}: no graph_us for {missing}; "
                                 f"cross-validation needs every strategy timed")
            tree = tree_by_name(row["tree"])
            heads = HeadConfig(int(row["hq"]), int(row["hkv"]), int(result.get("head_dim", 128)), dtype)
            cases.append(TimedCase(row["tree"], row.get("family") or tree_family(row["tree"]), heads, tree,
                                   {s: row["graph_us"][s] * 1e-6 for s in PLANNERS},
                                   {s: PLANNERS[s](tree, heads, cost) for s in PLANNERS}, cost,
                                   row.get("auto_choice")))
    return cases


def choose(case: TimedCase, profile=None) -> str:
    """The strategy ``auto``'s rule picks among ``case``'s timed plans under ``profile`` (default:
    the run's)."""
    cost = case.cost if profile is None else dataclasses.replace(case.cost, profile=profile)
    fixed = {s: (lambda tree, heads, c, v=v: v) for s, v in case.planned.items()}
    return plan_auto(case.tree, case.heads, cost, fixed)[0]


def _predict(cases: list, profile) -> np.ndarray:
    """The cost model's seconds for every case's every timed plan under ``profile``, case by case
    in :data:`PLANNERS` order."""
    costs = {}
    out = []
    for c in cases:
        cost = costs.get(id(c.cost))
        if cost is None:
            cost = costs[id(c.cost)] = dataclasses.replace(c.cost, profile=profile)
        est = estimate_many(c.tree, [c.planned[s][0] for s in PLANNERS], c.heads, cost)
        out.extend(e["total"] for e in est)
    return np.array(out)


def _score(picks: list) -> dict:
    """Hits, worst and geometric-mean regret of ``(case, choice)`` pairs, and each pick."""
    ratios = [c.measured[s] / min(c.measured.values()) for c, s in picks]
    worst = int(np.argmax(ratios))
    wc, ws = picks[worst]
    return {"cases": len(picks), "within_5pct": sum(r <= HIT for r in ratios),
            "share_within_5pct": sum(r <= HIT for r in ratios) / len(ratios), "worst": ratios[worst],
            "worst_case": f"{wc.name} {wc.heads.num_qo_heads}/{wc.heads.num_kv_heads} {ws}",
            "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
            "choices": [[c.name, f"{c.heads.num_qo_heads}/{c.heads.num_kv_heads}", s, r]
                        for (c, s), r in zip(picks, ratios)]}


#: what a refit minimises over the training trees: the squared log error of every strategy's
#: estimate against its measured time, or the log regret of ``auto``'s choices
OBJECTIVES = ("latency", "regret")


def _loss(cases: list, objective: str):
    """``loss(profile)`` of ``objective`` over ``cases``."""
    if objective == "latency":
        measured = np.log([t for c in cases for t in (c.measured[s] for s in PLANNERS)])
        return lambda p: float(np.sum((np.log(_predict(cases, p)) - measured) ** 2))
    return lambda p: sum(math.log(c.measured[choose(c, p)] / min(c.measured.values())) for c in cases)


def cross_validate(cases: list, *, objective: str = "regret", names=FITTED_CONSTANTS, **fit_kw) -> dict:
    """Leave each family of ``cases`` out in turn, refit ``names`` on the others (minimising
    ``objective``, one of :data:`OBJECTIVES`) and score ``auto``'s choices on it (see the module).

    Returns ``{"objective", "constants", "families": {family: {"cases", "as_is", "refit",
    "fit"}}, "all": {"as_is", "refit"}, "run_choices_differ"}``: ``as_is`` and ``refit`` score
    the choices under the run's profile and the refitted one (hits within 5%, worst and geomean
    regret, each choice), ``fit`` is :func:`fit_constants`'s report (``fit_kw`` its options), and
    ``run_choices_differ`` lists the cases whose choice under the run's profile is not the one the
    run recorded (plans changed since that run: its timings are of other plans).

    Raises
    ------
    ValueError
        For an unknown objective, cases of fewer than two families, or cases planned under
        different profiles.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; expected one of {OBJECTIVES}")
    families = list(dict.fromkeys(c.family for c in cases))
    if len(families) < 2:
        raise ValueError(f"cross-validation needs cases of two families or more, got {families}")
    base = cases[0].cost.profile
    if any(c.cost.profile != base for c in cases):
        raise ValueError("the results were planned under different device profiles; cross-validate one device")
    as_is = {id(c): choose(c) for c in cases}
    report = {"objective": objective, "constants": list(names), "families": {}, "all": {}}
    pooled_as_is, pooled_refit = [], []
    for family in families:
        train = [c for c in cases if c.family != family]
        held = [c for c in cases if c.family == family]
        profile, fit = fit_constants(base, _loss(train, objective), names, **fit_kw)
        picks_as_is = [(c, as_is[id(c)]) for c in held]
        picks_refit = [(c, choose(c, profile)) for c in held]
        pooled_as_is += picks_as_is
        pooled_refit += picks_refit
        report["families"][family] = {"cases": len(held), "as_is": _score(picks_as_is),
                                      "refit": _score(picks_refit), "fit": fit}
    report["all"] = {"as_is": _score(pooled_as_is), "refit": _score(pooled_refit)}
    report["run_choices_differ"] = [[c.name, f"{c.heads.num_qo_heads}/{c.heads.num_kv_heads}", c.run_choice,
                                     as_is[id(c)]] for c in cases
                                    if c.run_choice is not None and c.run_choice != as_is[id(c)]]
    return report
