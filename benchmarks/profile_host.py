"""Host cost of ``TreeAttention.run`` on a GPU: where the eager-minus-graph latency goes.

For a few kernel-suite cases and strategies it reports the launches per run, the host time to
issue one ``run()`` while the GPU is kept busy (so only the host is measured), the do_bench eager
and graph-replay latencies, and a cProfile of many runs (top functions by own time). Writes JSON.

    TREEATTN_SHARED=<shared> python benchmarks/profile_host.py --out host.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

try:
    import treeattn  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from treeattn import TreeAttention
from treeattn.bench.timing import capture
from treeattn.workloads import tree_from_spec

CASES = ["1,2,64_8,256,32", "1,256_256,32", "8,16,32,256_512,512,256,32",
         "1,2,4,8,16,32,64,128,1024_16,16,16,16,16,16,16,16,16"]


def host_us(fn, n: int = 50) -> float:
    """Microseconds of host time per call of ``fn`` while the GPU is blocked by a long sleep."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time: the calls below only queue
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


def direct_launch_experiment(hq, hkv, d, dtype) -> dict:
    """Host cost of one partial-attention launch through ``kernel[grid](...)`` against calling
    the compiled kernel's launcher directly (same arguments), and whether the outputs agree."""
    import inspect

    from triton.compiler.compiler import CompiledKernel  # noqa: F401  (the object kernel[grid] returns)

    from treeattn.kernels.attention import LOG2E, _tree_partial_attention_kernel as kern

    tree = tree_from_spec(CASES[0])
    k = torch.randn(tree.num_tokens, 1, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(tree.num_queries, hq, d, device="cuda", dtype=dtype)
    w = TreeAttention(device="cuda")
    plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, strategy="node")
    rows = plan.num_rows
    o1 = torch.empty(rows, hq, d, device="cuda", dtype=torch.float32)
    l1 = torch.empty(rows, hq, device="cuda", dtype=torch.float32)
    o2, l2 = torch.empty_like(o1), torch.empty_like(l1)
    launch = plan.launches[0]
    grid = (launch.work_end - launch.work_start, hkv)

    def args_for(o, lse):
        mask = (plan.kv_indices,) * 5
        return dict(zip(inspect.signature(kern.fn).parameters, (
            q, k, v, o, lse, plan.kv_indices, plan.work_kv_start, plan.work_kv_end, plan.work_row_indptr,
            plan.row_q_indices, *mask, launch.work_start, d ** -0.5 * LOG2E.value,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), o.stride(0), o.stride(1), lse.stride(0),
            hq // hkv, d, d, launch.block_m, launch.block_n, 1, False, "tf32", False)))
    opts = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    a1 = args_for(o1, l1)
    ck = kern[grid](**a1, **opts)

    def jit():
        kern[grid](**a1, **opts)
    a2 = list(args_for(o2, l2).values())
    stream = torch.cuda.current_stream().cuda_stream

    def direct():
        ck.run(grid[0], grid[1], 1, stream, ck.function, ck.packed_metadata, None, None, None, *a2)
    res = {"type": type(ck).__name__}
    try:
        direct()
        torch.cuda.synchronize()
        res["outputs_equal"] = bool(torch.equal(o1, o2) or torch.allclose(o1, o2))
        res["jit_us"] = host_us(jit, 200)
        res["direct_us"] = host_us(direct, 200)
    except Exception as e:  # the launcher's signature differs between Triton versions
        res["error"] = f"{type(e).__name__}: {e}"
    return res


def main(argv=None) -> int:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--strategies", default="sequence,node,flatten,greedy")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    d, dtype = 128, torch.float16
    rows = []
    for spec in CASES:
        tree = tree_from_spec(spec)
        k = torch.randn(tree.num_tokens, 1, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        q = torch.randn(tree.num_queries, hq, d, device="cuda", dtype=dtype)
        out = torch.empty_like(q)
        for strategy in args.strategies.split(","):
            w = TreeAttention(device="cuda")
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, strategy=strategy)

            def run(w=w, plan=plan):
                w.run(q, k, v, plan, out=out)
            run()
            h = host_us(run)
            eager = triton.testing.do_bench(run, return_mode="median") * 1e3
            graph = capture(w, plan, q, k, v, out)
            replay = triton.testing.do_bench(graph.replay, return_mode="median") * 1e3
            prof = cProfile.Profile()
            torch.cuda._sleep(2_000_000_000)
            prof.enable()
            for _ in range(50):
                run()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
            row = {"tree": spec, "strategy": strategy, "launches": len(plan.launches) + 1,
                   "host_us_per_run": h, "eager_us": eager, "graph_us": replay,
                   "profile": s.getvalue().splitlines()[-24:]}
            rows.append(row)
            print(f"{spec[:30]:30s} {strategy:9s} launches {row['launches']:2d} host {h:7.1f} us "
                  f"eager {eager:7.1f} graph {replay:7.1f}", flush=True)
    print("\n".join(rows[-1]["profile"]))
    direct = direct_launch_experiment(hq, hkv, d, dtype)
    print(direct, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "triton": triton.__version__, "rows": rows,
                       "direct_launch": direct}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
