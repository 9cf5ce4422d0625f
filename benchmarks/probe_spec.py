"""Where does speculative verification's attention go? Medusa token trees as the engine plans them.

`bench e2e` reads 29-61 us of attention a layer on speculative-32..256 (whole workloads,
e6d3118) where the engine's cost model rates its plans at 19-41 us (averaged over each
workload's steps). Four parts:

* ``kernels``: Medusa trees of 32-256 drafts over contexts of 300-2500 tokens (the context one
  run of slots, the drafts in scratch slots after it, as the engine lays them out), 32/8 heads,
  head_dim 128. Every strategy's plan, ``auto``'s (the engine's cost model: launches one after
  another with PDL) and ``auto``'s plan made ``--patch`` tokens earlier and patched by the lazy
  update (what the engine runs between decisions), each timed under CUDA-graph replay with PDL
  (``do_bench``, median, L2 flushed) and rated by the cost model.
* ``splits``: ``paths``' 128-row tiles with each tile's context lead cut into ``--chunks`` KV
  chunks, as planned and with TMA wide tiles where a launch's units are all runs of slots.
* ``launches``: the ``--strategies`` plans (default ``flatten,paths``: the model rates ``flatten``
  1.22-1.62x below its time on every Medusa tree) with their attention launches and their merge
  timed apart, against the cost model's attention and merge.
* ``e2e``: `bench e2e`'s measurement of the speculative workloads with ``auto`` at the engine's
  ``auto_refresh`` (a decision and a lazily patched plan reused for up to that many steps) and
  at 1 (a fresh ``auto`` plan every step).

Usage::

    python benchmarks/probe_spec.py [--parts kernels,splits,launches,e2e] [--sizes 32,64,128,256]
                                    [--contexts 300,800,1500,2500] [--strategies flatten,paths] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import torch

from treeattn import CostModel, DecodingTree, HeadConfig, TreeAttention
from treeattn.bench.timing import copy_bandwidth, graph_us, provenance, roofline_us
from treeattn.engine.planning import StepPlanner
from treeattn.plan import STRATEGIES, make_plan
from treeattn.plan.update import update_plan
from treeattn.workloads import tree_from_medusa

HQ, HKV, D = 32, 8, 128


def spec_tree(size: int, ctx: int, scratch: int) -> DecodingTree:
    """A Medusa tree of ``size`` drafts over a ``ctx``-token context in slots ``0..ctx-1``, the
    drafts in slots from ``scratch`` on (the engine's scratch slots keep their place as the context
    grows)."""
    base = tree_from_medusa(size, context_len=ctx)
    kv = base.kv_indices.copy()
    kv[ctx:] = scratch + kv[ctx:] - ctx
    return DecodingTree.from_parents(base.parents, base.lengths, kv_indices=kv, query_nodes=base.query_nodes,
                                     query_prefix=base.query_prefix)


def plan_estimate(plan, tree: DecodingTree, cost: CostModel, heads: HeadConfig) -> float:
    """The cost model's seconds for a built plan (its work units as launched)."""
    return plan_breakdown(plan, tree, cost, heads)["total"]


def plan_breakdown(plan, tree: DecodingTree, cost: CostModel, heads: HeadConfig) -> dict:
    """The cost model's :meth:`~treeattn.plan.cost.CostModel.total` breakdown (seconds) of a built
    plan, its work units as launched."""
    h = plan.host
    length = (h.work_kv_end - h.work_kv_start).astype(np.int64)
    mask_from = np.maximum(np.asarray(h.work_mask_start, dtype=np.int64), h.work_kv_start)
    launches = []
    for ln in plan.launches:
        sl = slice(ln.work_start, ln.work_end)
        tiles = -(-length[sl] // ln.block_n)
        masked_tiles = -(-(h.work_kv_end[sl] - mask_from[sl]) // ln.block_n)
        launches.append((ln.block_m, ln.block_n, tiles.size * HKV, int(tiles.sum()) * HKV, int(tiles.max()),
                         bool(ln.masked), int(masked_tiles.sum()) * HKV if ln.masked else 0))
    merge_max = int(np.diff(plan.merge_indptr.numpy()).max()) if plan.merge_indptr.numel() > 1 else 0
    return cost.total(int(tree.node_extent.sum()), int(plan.num_rows), merge_max, tree.num_queries,
                      plan.has_mask, True, launches, heads)


def _time_plan(plan, mover: StepPlanner, q, k, v) -> tuple[float, torch.Tensor]:
    """``(us, out)``: ``plan`` (a host plan, moved to the GPU as the engine moves it) timed under
    CUDA-graph replay with PDL, and its output."""
    ws = torch.empty(max(plan.workspace_bytes() // 4, 1), dtype=torch.float32, device="cuda")
    w = TreeAttention(ws, streams=0, pdl=True)
    dplan, out = mover._to_device(plan), torch.empty_like(q)
    us = graph_us(lambda: w.run(q, k, v, dplan, out=out), rep=50)
    torch.cuda.synchronize()
    return us, out


def _check(out: torch.Tensor, ref: torch.Tensor | None, what: str) -> torch.Tensor:
    """The reference output (``out`` when none yet); exits when ``out`` is not finite or is off it."""
    if ref is None:
        return out.float().clone()
    diff = (out.float() - ref).abs().max().item()
    if not math.isfinite(diff) or diff > 5e-3:
        raise SystemExit(f"{what}: max diff {diff}")
    return ref


def _medusa_setup(args) -> tuple:
    """``(cost, heads, contexts, scratch, mover, k, v)`` of the Medusa-tree parts: the engine's cost
    model (launches one after another, with PDL), 32/8 fp16 heads, ``--contexts``, the first
    scratch slot (after the longest context), the engine's plan mover (its pinned host-to-device
    copy) and random K/V caches holding every slot."""
    cost = TreeAttention(device="cuda", streams=0, pdl=True).cost
    heads = HeadConfig(HQ, HKV, D, torch.float16)
    contexts = [int(c) for c in args.contexts.split(",")]
    scratch = max(contexts) + 64
    mover = StepPlanner(heads, strategy="auto", device="cuda")
    k = torch.randn(scratch + 512, 1, HKV, D, device="cuda", dtype=torch.float16)
    return cost, heads, contexts, scratch, mover, k, torch.randn_like(k)


def kernels(args, res: dict) -> None:
    bw = copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    cost, heads, contexts, scratch, mover, k, v = _medusa_setup(args)
    for size in (int(s) for s in args.sizes.split(",")):
        for ctx in contexts:
            tree = spec_tree(size, ctx, scratch)
            q = torch.randn(tree.num_queries, HQ, D, device="cuda", dtype=torch.float16)
            plans = {s: make_plan(tree, heads, strategy=s, cost=cost) for s in STRATEGIES}
            early = make_plan(spec_tree(size, ctx - args.patch, scratch), heads, cost=cost)
            patched = update_plan(early, tree)
            if patched is not None:
                plans["patched"] = patched
            floor_tree = DecodingTree.from_parents([-1], [ctx])
            plans["floor_1q"] = make_plan(floor_tree, heads, cost=cost)
            ref = None
            row = {"size": size, "context": ctx, "queries": tree.num_queries,
                   "roofline_us": roofline_us(tree.num_tokens, tree.num_queries, HQ, HKV, D, bw), "plans": {}}
            for name, plan in plans.items():
                us, out = _time_plan(plan, mover, q[:1] if name == "floor_1q" else q, k, v)
                if name != "floor_1q":
                    ref = _check(out, ref, f"medusa{size}@{ctx} {name}")
                longest = int((plan.host.work_kv_end - plan.host.work_kv_start).max())
                row["plans"][name] = {"strategy": plan.strategy, "us": us, "launches": len(plan.launches),
                                      "longest_unit": longest,
                                      "estimate_us": plan_estimate(plan, floor_tree if name == "floor_1q" else tree,
                                                                   cost, heads) * 1e6}
            best = min((p["us"], n) for n, p in row["plans"].items() if n in STRATEGIES[1:])
            a = row["plans"]
            print(f"medusa{size}@{ctx}: auto {a['auto']['strategy']} {a['auto']['us']:.1f} us "
                  f"(est {a['auto']['estimate_us']:.1f}), patched {a.get('patched', {}).get('us', float('nan')):.1f}, "
                  f"best {best[1]} {best[0]:.1f}, floor {a['floor_1q']['us']:.1f}; "
                  + " ".join(f"{n} {p['us']:.1f}/{p['estimate_us']:.1f}" for n, p in a.items()), flush=True)
            res["kernels"].append(row)


def _split_plans(tree: DecodingTree, heads: HeadConfig, cost: CostModel, max_len: int | None) -> dict:
    """``paths``' 128-row tiles of ``tree`` with the leads split at ``max_len`` tokens (None: whole),
    built as planned, and with the tall unmasked launches turned to contig tall tiles and to TMA
    wide tiles (split tail) where every unit of theirs is one run of slots."""
    from treeattn.plan import build_plan
    from treeattn.plan.addressing import TILE_TALL_CONTIG, TILE_TALL_TMA, unit_runs
    from treeattn.plan.leads import cut_at_leads, run_leads
    from treeattn.plan.paths import deferred_path_tiles
    from treeattn.plan.split import split_long_items
    items = deferred_path_tiles(tree, heads, 128)
    if max_len is not None:
        cut, splittable = cut_at_leads(items, run_leads(tree, items))
        items = split_long_items(cut, np.where(splittable, max_len, np.iinfo(np.int64).max))
    plan = build_plan(tree, items, heads, strategy="paths", cost=cost)
    h = plan.host
    runs = unit_runs(h.kv_slots, h.work_kv_start, h.work_kv_end)
    out = {"planned": plan}
    for name, (block_n, warps, stages), extra in (("contig", TILE_TALL_CONTIG, {}),
                                                 ("tma", TILE_TALL_TMA, {"tma": True, "split_tail": True})):
        launches = tuple(dataclasses.replace(ln, contig=True, block_n=block_n, num_warps=warps, num_stages=stages,
                                             **extra)
                         if ln.block_m >= 128 and not ln.masked and runs[ln.work_start: ln.work_end].all() else ln
                         for ln in plan.launches)
        if launches != plan.launches:
            out[name] = dataclasses.replace(plan, launches=launches)
    return out


def splits(args, res: dict) -> None:
    timer = TreeAttention(device="cuda", streams=0, pdl=True)
    cost = timer.cost
    heads = HeadConfig(HQ, HKV, D, torch.float16)
    mover = StepPlanner(heads, strategy="auto", device="cuda")
    scratch = 4096
    k = torch.randn(scratch + 512, 1, HKV, D, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    for case in args.split_cases.split(","):
        size, ctx = (int(x) for x in case.split("@"))
        tree = spec_tree(size, ctx, scratch)
        q = torch.randn(tree.num_queries, HQ, D, device="cuda", dtype=torch.float16)
        ref = None
        row = {"size": size, "context": ctx, "variants": {}}
        for chunks in (int(c) for c in args.chunks.split(",")):
            max_len = None if chunks == 1 else -(-ctx // chunks)
            for cfg, plan in _split_plans(tree, heads, cost, max_len).items():
                us, out = _time_plan(plan, mover, q, k, v)
                ref = _check(out, ref, f"medusa{size}@{ctx} chunks {chunks} {cfg}")
                row["variants"][f"{chunks}/{cfg}"] = {"us": us, "estimate_us": plan_estimate(plan, tree, cost, heads) * 1e6,
                                                      "launches": [dataclasses.asdict(ln) for ln in plan.launches]}
        print(f"medusa{size}@{ctx}: " + " ".join(f"{n} {r['us']:.1f}" for n, r in row["variants"].items()), flush=True)
        res["splits"].append(row)


def launches(args, res: dict) -> None:
    """Each ``--strategies`` plan's attention launches and its merge timed apart (CUDA-graph replay,
    no PDL between them), beside the whole plan as the engine runs it and the cost model's
    attention and merge."""
    from treeattn.ops import merge_partials, partial_attention
    cost, heads, contexts, scratch, mover, k, v = _medusa_setup(args)
    for size in (int(s) for s in args.sizes.split(",")):
        for ctx in contexts:
            tree = spec_tree(size, ctx, scratch)
            q = torch.randn(tree.num_queries, HQ, D, device="cuda", dtype=torch.float16)
            row, ref = {"size": size, "context": ctx, "plans": {}}, None
            for name in args.strategies.split(","):
                plan = make_plan(tree, heads, strategy=name, cost=cost)
                us, out = _time_plan(plan, mover, q, k, v)
                ref = _check(out, ref, f"medusa{size}@{ctx} {name}")
                w = TreeAttention(torch.empty(max(plan.workspace_bytes() // 4, 1), device="cuda"), streams=0)
                dplan = mover._to_device(plan)
                o_part, l_part = w.partial_buffers(dplan)
                attn_us = graph_us(lambda: partial_attention(q, k, v, dplan, o_part, l_part, sm_scale=D ** -0.5,
                                                             out=out), rep=50)
                merge_us = graph_us(lambda: merge_partials(o_part, l_part, dplan.merge_q_indices, dplan.merge_indptr,
                                                           dplan.merge_indices, out, None), rep=50) \
                    if plan.merge_q_indices.numel() else 0.0
                est = plan_breakdown(plan, tree, cost, heads)
                row["plans"][name] = {"strategy": plan.strategy, "us": us, "attention_us": attn_us, "merge_us": merge_us,
                                      "launches": len(plan.launches), "merged": int(plan.merge_q_indices.numel()),
                                      "estimate_us": {p: est[p] * 1e6 for p in ("attention", "merge", "total")}}
            print(f"medusa{size}@{ctx}: " + " ".join(
                f"{n} {r['us']:.1f} (attention {r['attention_us']:.1f} / est {r['estimate_us']['attention']:.1f}, "
                f"merge {r['merge_us']:.1f} / est {r['estimate_us']['merge']:.1f})" for n, r in row["plans"].items()),
                flush=True)
            res["launches"].append(row)


def e2e(args, res: dict) -> None:
    from treeattn.engine.bench import bench_workload
    from treeattn.engine.model import TreeModel
    model = TreeModel.random("llama3-8b", device=torch.device("cuda"), dtype=torch.bfloat16, seed=0)
    for size in args.sizes.split(","):
        for rep in range(args.repeats):
            for refresh in (int(r) for r in args.refresh.split(",")):
                r = bench_workload(model, f"speculative-{size}", "auto", auto_refresh=refresh)
                keep = {k: r[k] for k in ("mean_step_ms", "gpu_step_ms", "breakdown_ms", "host_ms",
                                          "host_overhead", "strategies_used")}
                res["e2e"].append({"workload": f"speculative-{size}", "auto_refresh": refresh, "repeat": rep, **keep})
                print(f"speculative-{size} auto_refresh={refresh}: step {r['mean_step_ms']:.3f} ms, gpu "
                      f"{r['gpu_step_ms']:.3f}, attention {r['breakdown_ms']['attention']:.3f} ms, plan "
                      f"{r['host_ms']['plan']:.3f} ms, host {r['host_overhead']:.1%}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="kernels,e2e")
    ap.add_argument("--sizes", default="32,64,128,256")
    ap.add_argument("--contexts", default="300,800,1500,2500")
    ap.add_argument("--patch", type=int, default=48, help="tokens the patched plan's tree lacks")
    ap.add_argument("--refresh", default="32,1", help="e2e: auto_refresh values")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--split-cases", default="256@2500,256@1500,256@800,128@2500,128@1500,64@2500,32@2500")
    ap.add_argument("--chunks", default="1,2,3,4,6,10", help="splits: KV chunks of each tile's lead")
    ap.add_argument("--strategies", default="flatten,paths", help="launches: the plans to time apart")
    ap.add_argument("--out")
    args = ap.parse_args()
    res = {**provenance(), "heads": f"{HQ}/{HKV}", "head_dim": D, "kernels": [], "splits": [], "launches": [],
           "e2e": []}
    parts = args.parts.split(",")
    if "kernels" in parts:
        kernels(args, res)
    if "splits" in parts:
        splits(args, res)
    if "launches" in parts:
        launches(args, res)
    if "e2e" in parts:
        e2e(args, res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
