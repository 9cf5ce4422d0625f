"""Fit the constants of ``CostModel.estimate`` (src/treeattn/plan/cost.py) to measured latencies.

For every case of results/h200_kernels.json (32 kernel-suite trees x heads 32/32, 32/8, 64/8; fp16,
head_dim 128) and every strategy, rebuild on the CPU the work items the planners made (default
``CostModel()``: its item-shaping constants decide the plans that were measured), turn them into
the cost model's features (per attention launch: tile shape, programs, KV tiles, longest program;
per plan: partial rows, longest merge chain, tree mask) and fit the model's constants to the
CUDA-graph latencies (``graph_us``):

1. least squares on log(predicted / measured) over all 96 x 6 (case, strategy) latencies;
2. then the same plus the selection regret of a soft minimum over the strategies (what ``auto``
   pays for a wrong choice), by coordinate search in log space (no scipy needed).

``--probe`` adds the ``paths`` variants that results/h200_probe_paths.json timed on the same cases
(``benchmarks/probe_paths.py``) as further candidates of each case.

Reports, per case, the measured best, ``auto``'s choice before (recorded in the results) and
after (the ``CostModel()`` defaults now in cost.py), the in-sample and the leave-one-tree-out
cross-validated hit rates (auto within 5% of the fastest) and worst regret.

    PYTHONPATH=src:benchmarks python benchmarks/fit_cost_model.py [--results PATH] [--probe PATH] [--no-cv]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from treeattn.plan import PLANNERS, CostModel, HeadConfig, build_plan
from treeattn.plan.auto import _kernels, estimate_items
from treeattn.plan.launches import launches_by_group
from treeattn.workloads import tree_from_spec

HERE = Path(__file__).resolve().parent
#: the strategies the kernel suite's results time (``paths`` comes from the probe)
STRATEGIES = tuple(s for s in PLANNERS if s != "paths")
HEAD_DIM = 128
#: fitted constants of CostModel, in this order
PARAMS = ("program_bandwidth", "program_flops", "program_overhead_s", "sm_bandwidth", "sm_flops",
          "sm_flops_small", "mask_cost", "overlap_exponent", "launch_overhead_s", "merge_step_s", "fixed_overhead_s")
#: a physically plausible start: ~10 GB/s and ~1 TFLOP/s per lone program, ~100 GB/s and
#: ~2 TFLOP/s per full SM, a few microseconds per launch, half a microsecond per merge step
START = {"program_bandwidth": 10e9, "program_flops": 1e12, "program_overhead_s": 1e-6,
         "sm_bandwidth": 100e9, "sm_flops": 2e12, "sm_flops_small": 2e12, "mask_cost": 0.2,
         "overlap_exponent": 4.0,
         "launch_overhead_s": 3e-6, "merge_step_s": 0.5e-6, "fixed_overhead_s": 5e-6}
HIT = 1.05  # "within 5% of the fastest strategy"
SOFTMIN_T = 0.02  # temperature (in log time) of the soft choice in the selection loss
SELECTION_WEIGHT = 10.0


# ----------------------------------------------------------------------------- features
def candidates(r: dict, probe: dict | None, tree, heads: HeadConfig, cm: CostModel) -> list:
    """``(name, items, measured seconds)`` of one case: every suite strategy, then the probe's
    ``paths`` variants of the case."""
    out = [(s, PLANNERS[s](tree, heads, cm)[0], r["graph_us"][s] * 1e-6) for s in STRATEGIES]
    got = (probe or {}).get((r["tree"], r["hq"], r["hkv"]))
    if got:
        from probe_paths import variants
        out += [(n, items, got["us"][n] * 1e-6) for n, items in variants(tree, heads, cm).items()]
    return out


def extract(rows: list[dict], probe: dict | None = None, check: bool = True) -> dict:
    """Features of every (case, candidate); ``check`` compares them with the lowered Plan."""
    cm = CostModel()
    trees: dict = {}
    launches, plans, names = [], [], []
    for ci, r in enumerate(rows):
        tree = trees.setdefault(r["tree"], tree_from_spec(r["tree"]))
        heads = HeadConfig(r["hq"], r["hkv"], HEAD_DIM)
        for s, items, measured in candidates(r, probe, tree, heads, cm):
            length, nq = items.item_len, items.item_queries
            used = (length > 0) & (nq > 0)
            # the inputs plan_auto gives the model (merge chain, mask, unique KV); the mask per
            # launch: per item when the planner knows (leaf packing, paths), else the plan's
            q_used = items.q_indices[np.repeat(used, nq)]
            mrm = int(np.bincount(q_used, minlength=tree.num_queries).max())
            masked = int((length[used] * nq[used]).sum()) > int(tree.visible_tokens.sum())
            item_masked = items.masked[used] if items.masked is not None else np.full(int(used.sum()), masked)
            lead = items.mask_lead[used] if items.mask_lead is not None else None
            f = np.array(launches_by_group(length[used], nq[used], 0, 1, item_masked, heads, lead)[0],
                         dtype=np.float64).reshape(-1, 7)
            masked = masked or bool(item_masked.any())
            # the launch order the plan runs (decided by the default constants, like the plans)
            tall_first = cm.tall_first([cm.program_s(int(a), int(b), int(t), heads, tall_first=True)
                                        for a, b, t in f[:, [0, 1, 4]]])
            if check:
                plan = build_plan(tree, items, heads, strategy=s if s in PLANNERS else "paths")
                got = sorted((int(a), int(b), int(p)) for a, b, p in f[:, :3])
                want = sorted((ln.block_m, ln.block_n, (ln.work_end - ln.work_start) * heads.num_kv_heads)
                              for ln in plan.host.gather_launches)
                # (the builder gives a KV chunk of a path tile whose rows see nothing of it a
                # shorter query tile than the model counts)
                assert got == want or s not in PLANNERS, (r["tree"], s, got, want)
                assert plan.has_mask == masked, (r["tree"], s)
                # (a KV chunk of a path tile may hold nothing some of its queries see: the plan drops
                # those rows, the model counts them)
                assert plan.num_rows <= int(nq[used].sum()), (r["tree"], s)
                assert int(np.diff(plan.merge_indptr.numpy()).max()) <= mrm, (r["tree"], s)
                assert plan.tall_first == tall_first, (r["tree"], s)
            pid = len(plans)
            launches.extend((pid,) + tuple(x) for x in f)
            plans.append((ci, len(names), r["hq"], r["hkv"], int(nq[used].sum()), tree.num_queries,
                          int(tree.node_extent.sum()), int(masked), mrm, measured, int(tall_first)))
            names.append(s)
    L = np.array(launches, dtype=np.float64)
    P = np.array(plans, dtype=np.float64)
    case = P[:, 0].astype(np.int64)
    slot = np.arange(case.size) - np.searchsorted(case, case)  # position within its case
    return {"launch": L, "plan": P, "n_cases": len(rows), "case": case, "slot": slot, "names": names,
            "width": int(slot.max()) + 1}


def by_case(values: np.ndarray, feat: dict, fill: float = np.inf) -> np.ndarray:
    """[cases, width] matrix of per-candidate ``values`` (``fill`` where a case has fewer)."""
    out = np.full((feat["n_cases"], feat["width"]), fill)
    out[feat["case"], feat["slot"]] = values
    return out


# ----------------------------------------------------------------------------- model
def predict(x: np.ndarray, feat: dict) -> np.ndarray:
    """Seconds of every (case, strategy): CostModel.breakdown, vectorized over plans."""
    c = dict(zip(PARAMS, x))
    L, P = feat["launch"], feat["plan"]
    pid = L[:, 0].astype(np.int64)
    block_m, block_n, programs, work, longest, launch_masked, masked_work = L[:, 1:].T
    hq, hkv, rows, nqueries, kv_tokens, masked, mrm = (P[:, i] for i in range(2, 9))
    cm = CostModel()
    d, eb = HEAD_DIM, 2
    tok_bytes = d * 2 * eb
    mask = 1.0 + c["mask_cost"] * launch_masked
    flops = np.where(block_m >= 64, c["sm_flops"], c["sm_flops_small"])
    tile_sm_s = block_n * tok_bytes / c["sm_bandwidth"] + 4.0 * block_m * block_n * d / flops
    sm_time = (programs * c["program_overhead_s"] + (work + c["mask_cost"] * masked_work) * tile_sm_s) / cm.num_sms
    longest_s = longest * (block_n * tok_bytes / c["program_bandwidth"]
                           + 4.0 * block_m * block_n * d / c["program_flops"]) * mask
    p = c["overlap_exponent"]
    n = P.shape[0]
    serial = np.bincount(pid, (sm_time ** p + longest_s ** p) ** (1.0 / p), minlength=n)
    # tallest launch first: SM times add up, softly no less than the longest program
    longest_plan = np.zeros(n)
    np.maximum.at(longest_plan, pid, longest_s)
    tall = (np.bincount(pid, sm_time, minlength=n) ** p + longest_plan ** p) ** (1.0 / p)
    attn = np.where(P[:, 10] > 0, tall, serial) + np.bincount(pid, minlength=n) * c["launch_overhead_s"]
    # every query with a single row: the kernel writes the output, no partials and no merge
    direct = (mrm <= 1) & (rows == nqueries)
    partial = np.where(direct, 0, rows * hq * (d * eb + 4))  # fp16 partial outputs, fp32 LSEs
    attn = np.maximum(attn, (kv_tokens * hkv * tok_bytes + partial) / cm.bandwidth)
    merge = np.maximum(mrm * c["merge_step_s"], (partial + nqueries * hq * d * eb) / cm.bandwidth)
    merge = np.where(direct, 0.0, merge + c["launch_overhead_s"])
    # (not fitted: what a direct plan saves beyond the merge term, see CostModel.direct_saving_s)
    return attn + merge + c["fixed_overhead_s"] - cm.direct_saving_s * direct


def regrets(t: np.ndarray, feat: dict) -> np.ndarray:
    """Measured latency of the candidate the model picks / the fastest, per case."""
    T, M = by_case(t, feat), by_case(feat["plan"][:, 9], feat)
    return M[np.arange(T.shape[0]), T.argmin(1)] / M.min(1)


def loss(x: np.ndarray, feat: dict, cases: np.ndarray, w_sel: float) -> float:
    t = predict(x, feat)
    M_all = feat["plan"][:, 9]
    in_cases = np.isin(feat["case"], cases)
    out = float(np.mean(np.log(t[in_cases] / M_all[in_cases]) ** 2))
    if w_sel:
        T, M = by_case(t, feat)[cases], by_case(M_all, feat)[cases]
        z = -np.log(T / T.min(1, keepdims=True)) / SOFTMIN_T
        pr = np.exp(z)
        pr /= pr.sum(1, keepdims=True)
        out += w_sel * float(np.mean(np.log(np.nansum(pr * np.where(np.isinf(M), 0.0, M), 1) / M.min(1))))
    return out


def coordinate_search(x: np.ndarray, feat: dict, cases: np.ndarray, w_sel: float, iters: int = 500,
                      hold: frozenset = frozenset()) -> np.ndarray:
    """Multiplicative coordinate search (every constant is positive), adaptive step per constant;
    the constants named in ``hold`` stay as given."""
    x = x.copy()
    step = np.array([0.0 if k in hold else 0.5 for k in PARAMS])
    best = loss(x, feat, cases, w_sel)
    p_idx = PARAMS.index("overlap_exponent")
    for _ in range(iters):
        for i in np.flatnonzero(step):
            for sgn in (1.0, -1.0):
                y = x.copy()
                y[i] *= math.exp(sgn * step[i])
                if y[p_idx] < 1.0:
                    continue
                val = loss(y, feat, cases, w_sel)
                if val < best:
                    best, x = val, y
                    step[i] = min(step[i] * 1.5, 2.0)
                    break
            else:
                step[i] *= 0.6
        if step.max() < 1e-3:
            break
    return x


def fit(feat: dict, cases: np.ndarray, hold: frozenset = frozenset()) -> np.ndarray:
    """Fitted constants; those in ``hold`` keep the ``CostModel()`` defaults."""
    x = np.array([getattr(CostModel(), k) if k in hold else START[k] for k in PARAMS])
    x = coordinate_search(x, feat, cases, 0.0, hold=hold)
    return coordinate_search(x, feat, cases, SELECTION_WEIGHT, hold=hold)


def rounded(x: np.ndarray) -> np.ndarray:
    return np.array([float(f"{v:.3g}") for v in x])


def summary(reg: np.ndarray) -> str:
    return (f"within 5%: {(reg <= HIT).sum()}/{reg.size}, geomean {math.exp(np.log(reg).mean()):.3f}x, "
            f"worst {reg.max():.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(HERE / "results" / "h200_kernels.json"))
    ap.add_argument("--no-cv", action="store_true", help="skip the leave-one-tree-out cross validation")
    ap.add_argument("--hold", default="", help="comma-separated constants to keep at the CostModel() "
                    "defaults")
    ap.add_argument("--probe", help="results of benchmarks/probe_paths.py: its paths variants join each case's "
                    "candidates")
    args = ap.parse_args()
    with open(args.results) as f:
        rows = json.load(f)["rows"]
    probe = None
    if args.probe:
        with open(args.probe) as f:
            probe = {(r["tree"], r["hq"], r["hkv"]): r for r in json.load(f)["rows"]}
    t0 = time.perf_counter()
    feat = extract(rows, probe)
    print(f"features of {len(rows)} cases, {len(feat['names'])} candidates in {time.perf_counter() - t0:.1f}s "
          f"(launch shapes, rows, merge chains and masks match build_plan)")
    all_cases = np.arange(len(rows))
    hold = frozenset(filter(None, args.hold.split(",")))
    if hold - set(PARAMS):
        ap.error(f"--hold: unknown constants {sorted(hold - set(PARAMS))}")
    x = fit(feat, all_cases, hold)
    xr = rounded(x)
    meas = feat["plan"][:, 9]
    print("\nfitted constants (CostModel fields; paste into src/treeattn/plan/cost.py):")
    for k, v in zip(PARAMS, xr):
        print(f"    {k}: float = {v:.3g}")
    rms = math.sqrt(np.mean(np.log(predict(xr, feat) / meas) ** 2))
    print(f"rms log error of the latencies: {rms:.3f}")

    # the defaults now in cost.py, through estimate_items (and the vectorized copy agrees); auto's
    # pick among the measured candidates: each planner's best estimate, then the fewest kernels
    # within choice_margin of the best (sequence's unsplit variant is not timed here)
    cm = CostModel()
    x_now = np.array([getattr(cm, k) for k in PARAMS])
    if not np.allclose(x_now, xr, rtol=1e-9):
        print("NOTE: CostModel() defaults differ from this fit; 'after' uses the defaults in cost.py")
    t_now = predict(x_now, feat)
    trees: dict = {}
    picked = np.zeros(len(rows), dtype=np.int64)
    for ci, r in enumerate(rows):
        tree = trees.setdefault(r["tree"], tree_from_spec(r["tree"]))
        heads = HeadConfig(r["hq"], r["hkv"], HEAD_DIM)
        best_of: dict = {}
        for j, (s, items, _) in enumerate(candidates(r, probe, tree, heads, cm)):
            est = estimate_items(tree, items, heads, cm)
            k = np.flatnonzero((feat["case"] == ci) & (feat["slot"] == j))[0]
            assert math.isclose(est["total"], t_now[k], rel_tol=1e-9), (r["tree"], r["hq"], r["hkv"], s)
            planner = s if s in PLANNERS else "paths"
            if planner not in best_of or est["total"] < best_of[planner][0]:
                best_of[planner] = (est["total"], _kernels(est), j)
        top = min(v[0] for v in best_of.values())
        picked[ci] = min((v for v in best_of.values() if v[0] <= top * (1 + cm.choice_margin)),
                         key=lambda v: (v[1], v[0]))[2]
    M = by_case(meas, feat)
    reg_after = M[np.arange(len(rows)), picked] / M.min(1)
    after = [feat["names"][np.flatnonzero((feat["case"] == ci) & (feat["slot"] == j))[0]]
             for ci, j in enumerate(picked)]

    reg_cv = None
    if not args.no_cv:
        t0 = time.perf_counter()
        reg_cv = np.zeros(len(rows))
        pick_cv = [""] * len(rows)
        tree_of = np.array([r["tree"] for r in rows])
        for spec in dict.fromkeys(tree_of):
            held = tree_of == spec
            xf = rounded(fit(feat, np.flatnonzero(~held), hold))
            t = predict(xf, feat)
            reg_cv[held] = regrets(t, feat)[held]
            T = by_case(t, feat)
            for c in np.flatnonzero(held):
                pick_cv[c] = feat["names"][np.flatnonzero((feat["case"] == c) & (feat["slot"] == T[c].argmin()))[0]]
        print(f"leave-one-tree-out fits in {time.perf_counter() - t0:.0f}s")

    print(f"\n{'tree':44s} {'heads':6s} {'best (us)':>20s} {'before':>18s} {'after':>18s}"
          + (f" {'cv':>18s}" if reg_cv is not None else ""))
    for ci, r in enumerate(rows):
        g = dict(zip((feat["names"][k] for k in np.flatnonzero(feat["case"] == ci)), M[ci] * 1e6))
        best = min(g, key=g.get)
        b = r["auto_choice"]
        line = (f"{r['tree'][:44]:44s} {r['hq']}/{r['hkv']:<3d} {best:>18s} {g[best]:8.1f} "
                f"{b:>11s} {r['graph_us'][b] * 1e-6 / M[ci].min():5.2f}x {after[ci]:>18s} {reg_after[ci]:5.2f}x")
        if reg_cv is not None:
            line += f" {pick_cv[ci]:>18s} {reg_cv[ci]:5.2f}x"
        print(line + ("  <- miss" if reg_after[ci] > HIT else ""))
    before = np.array([r["graph_us"][r["auto_choice"]] * 1e-6 / M[ci].min() for ci, r in enumerate(rows)])
    print(f"\nbefore (recorded auto):   {summary(before)}")
    print(f"after, in-sample:         {summary(reg_after)}")
    if reg_cv is not None:
        print(f"after, leave-one-tree-out: {summary(reg_cv)}")


if __name__ == "__main__":
    main()
