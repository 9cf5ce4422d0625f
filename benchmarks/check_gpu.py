"""GPU correctness check: every strategy with the Triton backend on the full kernel suite.

For each suite tree (fp16, head_dim 128, heads 32/32, 32/8, 64/8, forests included) it runs every
strategy, compares with an fp32 dense reference (relative L2 <= 1e-2, no NaN), checks that a CUDA
graph replay of ``run()`` gives identical output, and reports each strategy's latency
(``triton.testing.do_bench``, median, L2 flushed). Writes JSON with device and versions.

    python benchmarks/check_gpu.py --out benchmarks/results/h200_check_gpu.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import os
import sys
import time

import torch
import triton

from treeattn import STRATEGIES, TreeAttention
from treeattn.bench.kernels import HEAD_DIM, case_inputs
from treeattn.bench.timing import capture, graph_us, provenance
from treeattn.reference import visibility_mask
from treeattn.tree import suite_trees, tree_from_spec


def reference_fp32(q, k, v, tree, scale):
    """Dense masked attention in fp32, one KV head at a time (memory-bounded)."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    mask = torch.as_tensor(visibility_mask(tree), device=q.device)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for h in range(hkv):
        qh = q[:, h * g:(h + 1) * g].float()  # [Q, g, D]
        s = torch.einsum("qgd,td->gqt", qh, k[:, h].float()) * scale
        s.masked_fill_(~mask[None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[:, h * g:(h + 1) * g] = torch.einsum("gqt,td->qgd", p, v[:, h].float())
        del s, p
    return out


def checked_error(out, ref, what: str, *, tol: float = 1e-2) -> float:
    """Relative L2 error of ``out`` against the fp32 ``ref``; a probe stops (naming ``what``)
    where it is not finite or above ``tol`` (16-bit outputs)."""
    err = float((out.float() - ref).norm() / ref.norm())
    if not math.isfinite(err) or err > tol:
        raise SystemExit(f"{what}: relative L2 {err}")
    return err


def case_with_reference(tree, hq: int, hkv: int) -> tuple:
    """``(q, k, v, out, ref)``: :func:`~treeattn.bench.kernels.case_inputs` of a suite-like case
    and the fp32 reference of its output (the caches read in the tree's slot order)."""
    q, k, v, out = case_inputs(tree, hq, hkv)
    slots = torch.tensor(tree.kv_indices, device=k.device, dtype=torch.long)  # (a copy: the tree's arrays are read-only)
    return q, k, v, out, reference_fp32(q, k[slots, 0], v[slots, 0], tree, HEAD_DIM ** -0.5)


def checked_runs(run, plans: dict, ref, what: str) -> dict:
    """``{name: relative L2}`` of ``run(plan, out)`` for each of ``plans`` against ``ref``, each
    into a fresh output (:func:`checked_error`: a probe stops on a wrong one)."""
    errors = {}
    for name, p in plans.items():
        o = torch.empty(ref.shape, dtype=torch.float16, device=ref.device)
        run(p, o)
        torch.cuda.synchronize()
        errors[name] = checked_error(o, ref, f"{what} {name}")
    return errors


def speedups(ratios: list) -> str:
    """``"geomean xG [min, max]"`` of the probes' speedup ratios."""
    return f"geomean x{statistics.geometric_mean(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"


def alternating_graph_us(run, plans: dict, rounds: int) -> dict:
    """``{name: [us, ...]}``: each of ``plans`` timed by :func:`~treeattn.bench.timing.graph_us`
    of ``run(plan)``, once a round over ``rounds`` rounds, so that drift hits them all alike."""
    us = {name: [] for name in plans}
    for _ in range(rounds):
        for name, p in plans.items():
            us[name].append(graph_us(lambda: run(p)))
    return us


def patched_ab(tree, spec: str, hq: int, hkv: int, patches: dict, rounds: int, module) -> dict:
    """One case of an in-process A/B of code variants: ``auto``'s plan of ``tree`` made once for
    each of ``patches`` (``{variant: {attribute of module: value}}``, one plan and launch cache
    each), every run of a variant's plan with its attributes set on ``module`` (restored
    after). Every output is checked against the fp32 reference (:func:`checked_runs`) and
    timed by :func:`alternating_graph_us`. Returns the row: ``tree``, ``hq``, ``hkv``,
    ``tree_tokens``, ``strategy`` (the first variant's plan's), ``err`` and ``us`` per variant."""
    saved = {attr: getattr(module, attr) for change in patches.values() for attr in change}
    q, k, v, out, ref = case_with_reference(tree, hq, hkv)
    w = TreeAttention(device="cuda")
    plans = {name: (change, w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM))
             for name, change in patches.items()}

    def run(variant, o=out):
        for attr, value in {**saved, **variant[0]}.items():
            setattr(module, attr, value)
        w.run(q, k, v, variant[1], out=o)

    try:
        return {"tree": spec, "hq": hq, "hkv": hkv, "tree_tokens": tree.num_tokens,
                "strategy": next(iter(plans.values()))[1].strategy,
                "err": checked_runs(run, plans, ref, f"{spec} {hq}/{hkv}"),
                "us": alternating_graph_us(run, plans, rounds)}
    finally:
        for attr, value in saved.items():
            setattr(module, attr, value)


def ab_parser(doc: str) -> argparse.ArgumentParser:
    """The command line of an :func:`ab_suite` probe: ``--trees``, ``--heads``, ``--rounds``,
    ``--out`` (``doc``: its description)."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--trees", nargs="*", default=None, help="suite specs (default: the whole suite)")
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    return ap


def ab_suite(args, patches: dict, module, *, base: str, extra: dict | None = None) -> dict:
    """:func:`patched_ab` over ``args.trees`` (default: the whole suite) x ``args.heads`` with
    ``args.rounds`` rounds: each row gains ``speedup`` (every other variant's over ``base``, best
    rounds), is printed as it comes and, with ``args.out``, written after every case (a probe cut
    short keeps what it measured); then each variant's speedups over all, by head config and over
    the >= 100K-token trees are printed. Returns the results (provenance, ``extra``, ``rows``)."""
    res = {**provenance(), **(extra or {}), "rows": []}
    others = [name for name in patches if name != base]
    for spec in args.trees or suite_trees("all"):
        tree = tree_from_spec(spec)
        for hq, hkv in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
            row = patched_ab(tree, spec, hq, hkv, patches, args.rounds, module)
            row["speedup"] = {name: min(row["us"][base]) / min(row["us"][name]) for name in others}
            res["rows"].append(row)
            print(f"{spec[:40]:40s} {hq}/{hkv} {row['strategy']:8s} {base} {min(row['us'][base]):8.1f} "
                  + " ".join(f"{name} {min(row['us'][name]):8.1f} x{row['speedup'][name]:.3f}" for name in others),
                  flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
    rows = res["rows"]
    for name in others:
        print(f"{name} over {base}: {len(rows)} plans, {speedups([r['speedup'][name] for r in rows])}")
        for hq, hkv in sorted({(r["hq"], r["hkv"]) for r in rows}):
            some = [r["speedup"][name] for r in rows if (r["hq"], r["hkv"]) == (hq, hkv)]
            print(f"  {hq}/{hkv}: {len(some)} plans, {speedups(some)}")
        big = [r["speedup"][name] for r in rows if r["tree_tokens"] >= 100_000]
        if big:
            print(f"  >= 100K tokens: {len(big)} plans, {speedups(big)}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="all", choices=["fasttree", "pat", "all"])
    ap.add_argument("--heads", default="32/32,32/8,64/8")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--streams", type=int, default=None, help="TreeAttention(streams=) (default: its own)")
    ap.add_argument("--pdl", default="auto", choices=["auto", "on", "off"], help="TreeAttention(pdl=None/True/False)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    strategies = args.strategies.split(",")
    d, dtype = 128, torch.float16
    pdl = {"auto": None, "on": True, "off": False}[args.pdl]
    mode = TreeAttention(device=dev, streams=args.streams, pdl=pdl)
    rows, failures = [], []
    t_start = time.time()
    for spec in suite_trees(args.suite):
        tree = tree_from_spec(spec)
        for hq, hkv in heads:
            nt, nq = tree.num_tokens, tree.num_queries
            q = torch.randn(nq, hq, d, device=dev, dtype=dtype)
            k = torch.randn(nt, hkv, d, device=dev, dtype=dtype)
            v = torch.randn(nt, hkv, d, device=dev, dtype=dtype)
            ref = reference_fp32(q, k, v, tree, d ** -0.5)
            kc, vc = k.unsqueeze(1), v.unsqueeze(1)
            row = {"tree": spec, "hq": hq, "hkv": hkv, "requests": nq, "tree_tokens": nt,
                   "err": {}, "us": {}, "graph_us": {}, "work": {}}
            for s in strategies:
                w = TreeAttention(device=dev, streams=args.streams, pdl=pdl)
                plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, strategy=s)
                out = torch.full_like(q, float("nan"))
                w.run(q, kc, vc, plan, out=out)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                ok = bool(torch.isfinite(out).all()) and err <= 1e-2
                # CUDA graph: capture run() and replay into a poisoned buffer
                g_out = torch.full_like(q, float("nan"))
                graph = capture(w, plan, q, kc, vc, g_out)
                g_out.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                graph_same = bool(torch.equal(g_out, out))
                ok = ok and graph_same
                name = s if s != "auto" else f"auto({plan.strategy})"
                row["err"][s] = err
                row["work"][s] = plan.num_work
                row.setdefault("merge_last", {})[s] = plan.merge_last
                if not ok:
                    failures.append(f"{spec} {hq}/{hkv} {name}: err={err:.2e} graph_same={graph_same}")
                if not args.no_bench:
                    row["us"][s] = triton.testing.do_bench(
                        lambda: w.run(q, kc, vc, plan, out=out), return_mode="median") * 1e3
                    row["graph_us"][s] = triton.testing.do_bench(graph.replay, return_mode="median") * 1e3
                del graph
            rows.append(row)
            us = " ".join(f"{s}={row['us'].get(s, float('nan')):.1f}" for s in strategies)
            print(f"{spec:48s} {hq}/{hkv} maxerr={max(row['err'].values()):.1e} us: {us}", flush=True)
            torch.cuda.empty_cache()
    result = {
        **provenance(), "streams": mode.num_streams, "pdl": mode.pdl, "dtype": "float16", "head_dim": d, "tolerance": 1e-2, "seconds": round(time.time() - t_start, 1),
        "failures": failures, "rows": rows,
    }
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{len(rows)} cases x {len(strategies)} strategies, {len(failures)} failures, "
          f"{result['seconds']} s")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
