"""Host cost of capturing one decode step's attention launches in a CUDA graph (what the engine's
AttentionGraph does once per step) against launching them eagerly, with and without side streams,
and of a whole step's captures and replays behind a busy GPU.

    TREEATTN_SHARED=<shared> python benchmarks/attention_graph_cost.py
"""
from __future__ import annotations

import time

import torch

from treeattn import TreeAttention
from treeattn.engine.graphs import AttentionGraph
from treeattn.workloads import tree_from_spec

CASES = [("1,20_4000,200", "greedy"), ("1,20_4000,200", "sequence"), ("1,50_4000,200", "pack")]


def ms(fn, n=20):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return host


def main():
    dev = torch.device("cuda")
    hq, hkv, d = 32, 8, 128
    for spec, strategy in CASES:
        tree = tree_from_spec(spec)
        k = torch.randn(2 * 2, tree.num_tokens, 1, hkv, d, device=dev, dtype=torch.bfloat16)
        stride = k[2].data_ptr() // 2 - k[0].data_ptr() // 2
        q = torch.randn(tree.num_queries, hq, d, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        for streams in (3, 0):
            w = TreeAttention(device=dev, streams=streams)
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                          strategy=strategy)
            ag = AttentionGraph(k[0], k[1], stride)
            eager = ms(lambda: w.run(q, k[0], k[1], plan, out=out))
            g = ag.capture(w, q, out, plan)
            cap = ms(lambda: ag.capture(w, q, out, plan))
            rep = ms(lambda: (ag.counter.zero_(), g.replay()))  # the counter picks the layer
            # does capturing wait for the GPU? queue ~50 ms of sleep first
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)
            t0 = time.perf_counter()
            kept = ag.capture(w, q, out, plan)  # kept: its destruction is timed below
            busy = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            # does destroying a graph wait for its queued replays? queue one behind ~50 ms of sleep
            doomed, kept = kept, None
            torch.cuda._sleep(100_000_000)
            doomed.replay()
            t0 = time.perf_counter()
            del doomed
            destroy = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            # the engine's pattern: one capture per step and one replay per layer, behind a busy
            # GPU (the counter goes back to layer 0 every second replay: the caches hold two)
            g = None
            torch.cuda._sleep(100_000_000)
            t0 = time.perf_counter()
            for _ in range(8):
                g = ag.capture(w, q, out, plan)
                for i in range(32):
                    if i % 2 == 0:
                        ag.counter.zero_()
                    g.replay()
            step = (time.perf_counter() - t0) / 8 * 1e3
            torch.cuda.synchronize()
            print(f"{spec:16s} {strategy:8s} launches={len(plan.launches)} merge={plan.merge_q_indices.numel() > 0} "
                  f"streams={streams}: eager run {eager:.3f} ms, capture {cap:.3f} ms ({busy:.3f} ms behind a "
                  f"busy GPU), replay {rep:.3f} ms, destroy with a queued replay {destroy:.3f} ms, "
                  f"engine step (capture + 32 replays, previous graph dropped) {step:.3f} ms")


if __name__ == "__main__":
    main()
