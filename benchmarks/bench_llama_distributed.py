"""Llama-3.1-8B decode with the KV cache sequence-sharded over GPUs: Tree Attention vs Ring
Attention vs one GPU (the Tree Attention paper's Table 1 setting, on as many GPUs as torchrun gives).

Random weights of the ``llama3-8b`` preset (bf16; RoPE table extended past 128K when a context
needs it). One prompt of the longest context is prefilled on every rank (causal flash attention
through ``torch.nn.functional.scaled_dot_product_attention``, the MLP in row chunks); the KV of its
first ``C`` tokens is exactly the prefill of a ``C``-token prompt, so every shorter context reuses
it (contexts run longest first: decoding at ``C`` overwrites positions ``C ...`` only). For each
context ``C`` and method, rank ``r`` keeps the contiguous slice ``[r C / p, (r + 1) C / p)`` of the
sequence and the last rank also holds the decoded tokens; ``--steps`` greedy decode steps follow,
each one eager model forward whose 32 attention calls are :class:`treeattn.distributed.ShardedAttention`
(``tree``: local treeattn kernels + two all-reduces; ``ring``: KV shards passed around the ring),
and ``single`` is rank 0 alone with the whole KV. Plans for all steps are made before timing (host
side, as the engine's decode windows do); a step's latency is CUDA-event time of its forward.

2 x H200 (a few minutes; the 256K prefill takes about a minute)::

    torchrun --nproc-per-node 2 benchmarks/bench_llama_distributed.py \\
        --out benchmarks/results/distributed_llama_h200x2.json

CPU logic check (gloo, tiny model, fp32, torch backend)::

    python benchmarks/bench_llama_distributed.py --cpu-smoke --out /tmp/llama_dist.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import treeattn  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from bench_distributed import NCCL_ENV, launch  # the sibling script (same folder)
from treeattn import TreeAttention
from treeattn.distributed import ShardedAttention, plan_sequence_shard, run_local
from treeattn.engine.config import ModelConfig
from treeattn.engine.model import TreeModel

K = 1024


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b", help="random-weights preset")
    ap.add_argument("--contexts", default="32K,64K,128K,256K", help="context lengths (K suffix allowed)")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per context and method")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps before them")
    ap.add_argument("--methods", default="tree,ring,single")
    ap.add_argument("--chunk", type=int, default=16 * K, help="prefill rows per MLP chunk")
    ap.add_argument("--world-size", type=int, default=2, help="processes to spawn without torchrun")
    ap.add_argument("--cpu-smoke", action="store_true", help="gloo, tiny model, fp32, small contexts")
    ap.add_argument("--out", default=None, help="JSON path (rank 0 writes it after every context)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.model, args.steps, args.warmup = "tiny", 3, 1
        if "--contexts" not in (argv if argv is not None else sys.argv):
            args.contexts = "100,257"
    args.context_list = sorted({int(float(c[:-1]) * K) if c[-1:] in "kK" else int(c)
                                for c in args.contexts.split(",") if c}, reverse=True)
    args.method_list = [m for m in args.methods.split(",") if m]
    return args


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of ``q [L, Hq, D]`` over ``k, v [L, Hkv, D]`` (GQA) -> ``[L, Hq, D]``."""
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    try:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    except (RuntimeError, TypeError):  # a backend without GQA: expand the KV heads
        g = q.shape[1] // k.shape[1]
        o = F.scaled_dot_product_attention(qt, kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1),
                                           is_causal=True)
    return o[0].transpose(0, 1)


@torch.no_grad()
def prefill(model: TreeModel, tokens: torch.Tensor, caches, chunk: int) -> torch.Tensor:
    """Causal prefill of ``tokens`` into slots ``0 .. L - 1`` of ``caches``; returns the final
    hidden states ``[L, hidden]`` (before the last norm)."""
    n = tokens.shape[0]
    pos = torch.arange(n, device=tokens.device)
    h = model.embed(tokens)
    c = model.config
    q = torch.empty(n, c.num_heads, c.head_dim, device=h.device, dtype=h.dtype)
    for layer in range(c.num_layers):
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            q[a:b] = model.pre_attention(layer, h[a:b], pos[a:b], pos[a:b], caches)[0]
        kc, vc = caches[layer]
        o = causal_attention(q, kc[:n], vc[:n])
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            h[a:b] = model.post_attention(layer, h[a:b], o[a:b])
        del o
    return h


def shard(n: int, rank: int, world: int) -> tuple[int, int]:
    """Contiguous slice ``[lo, hi)`` of ``n`` prompt tokens held by ``rank``."""
    return rank * n // world, (rank + 1) * n // world


def decode_run(model, caches, first_token: int, context: int, method: str, args, rank: int, world: int,
               device, backend: str) -> dict:
    """``warmup + steps`` greedy decode steps after a ``context``-token prompt."""
    c = model.config
    steps = args.warmup + args.steps
    lo, hi = shard(context, rank, world)
    last = rank == world - 1
    if method == "single":
        wrapper = TreeAttention(device=device, backend=backend)
        plans = [plan_sequence_shard(wrapper, context + s + 1, num_queries=1, num_qo_heads=c.num_heads,
                                     num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=model.dtype)
                 for s in range(steps)]
    else:
        sa = ShardedAttention(method, device=device, backend=backend)
        plans = [sa.plan((hi - lo) + (s + 1 if last else 0), num_queries=1, num_qo_heads=c.num_heads,
                         num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=model.dtype)
                 for s in range(steps)]
    token = torch.tensor([first_token], device=device)
    tokens, times = [], []
    for s in range(steps):
        pos = torch.tensor([context + s], device=device)
        end = (context + s + 1) if (last or method == "single") else hi
        start = 0 if method == "single" else lo
        views = [(kc[start:end], vc[start:end]) for kc, vc in caches]

        def attend(layer, q, plan=plans[s], views=views):
            kc, vc = views[layer]
            if method == "single":
                return run_local(wrapper, q, kc.unsqueeze(1), vc.unsqueeze(1), plan)[0]
            return sa.run(q, kc, vc, plan)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
        t0 = time.perf_counter()
        if ev:
            ev[0].record()
        logits = model.decode(token, pos, pos, caches, attend)
        if ev:
            ev[1].record()
        token = logits.argmax(-1)
        tokens.append(int(token.item()))  # syncs
        ms = ev[0].elapsed_time(ev[1]) if ev else (time.perf_counter() - t0) * 1e3
        if s >= args.warmup:
            times.append(ms)
    return {"step_ms": times, "mean_step_ms": statistics.fmean(times), "median_step_ms": statistics.median(times),
            "tokens": tokens}


def worker(args) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.cpu_smoke:
        device, dtype, backend = torch.device("cpu"), torch.float32, "torch"
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    else:
        device, dtype, backend = torch.device("cuda", local_rank), torch.bfloat16, "auto"
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=900))
    top = max(args.context_list)
    n_slots = top + args.warmup + args.steps + 1
    config = ModelConfig.preset(args.model)
    if n_slots > config.max_position_embeddings:
        config = dataclasses.replace(config, max_position_embeddings=n_slots)
    t0 = time.perf_counter()
    model = TreeModel.random(config, device=device, dtype=dtype, seed=0)
    model.ensure_positions(n_slots)
    caches = [(torch.empty(n_slots, config.num_kv_heads, config.head_dim, device=device, dtype=dtype),
               torch.empty(n_slots, config.num_kv_heads, config.head_dim, device=device, dtype=dtype))
              for _ in range(config.num_layers)]
    gen = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (top,), generator=gen).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t1 = time.perf_counter()
    h = prefill(model, prompt, caches, args.chunk)
    sync()
    prefill_s = time.perf_counter() - t1
    first = {ctx: int(model.logits(h[ctx - 1: ctx]).argmax(-1)) for ctx in args.context_list}
    del h
    doc = {"meta": {"script": "benchmarks/bench_llama_distributed.py", "model": args.model,
                    "weights": "random (seed 0)", "dtype": str(dtype).replace("torch.", ""),
                    "world_size": world, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "commit": os.environ.get("TREEATTN_COMMIT", "unknown"),
                    "prefill": {"tokens": top, "seconds": prefill_s, "note": "one prompt of the longest "
                                "context prefilled on every rank; shorter contexts are its prefixes"},
                    "setup_s": t1 - t0, "steps": args.steps, "warmup_steps": args.warmup, "env": NCCL_ENV},
           "cases": []}
    if rank == 0:
        print(f"prefill of {top} tokens: {prefill_s:.1f} s", flush=True)
    try:
        for ctx in args.context_list:  # longest first (see the module doc)
            row = {"context": ctx, "methods": {}}
            for method in args.method_list:
                if method == "single":
                    if rank == 0:
                        row["methods"]["single"] = decode_run(model, caches, first[ctx], ctx, method, args,
                                                              rank, world, device, backend)
                    dist.barrier()
                    continue
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                res = decode_run(model, caches, first[ctx], ctx, method, args, rank, world, device, backend)
                got = [None] * world
                dist.all_gather_object(got, res["mean_step_ms"])
                res["mean_step_ms_per_rank"] = got
                res["mean_step_ms"] = max(got)
                if device.type == "cuda":
                    res["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                row["methods"][method] = res
            if rank == 0:
                m = row["methods"]
                if "tree" in m and "ring" in m:
                    row["speedup_tree_vs_ring"] = m["ring"]["mean_step_ms"] / m["tree"]["mean_step_ms"]
                if "tree" in m and "single" in m:
                    row["speedup_tree_vs_single"] = m["single"]["mean_step_ms"] / m["tree"]["mean_step_ms"]
                toks = {k: v["tokens"] for k, v in m.items()}
                row["tokens_equal"] = len({tuple(t) for t in toks.values()}) == 1
                doc["cases"].append(row)
                print(f"context {ctx:>7}: mean decode step ms "
                      f"{ {k: round(v['mean_step_ms'], 2) for k, v in m.items()} }  tree/ring "
                      f"{row.get('speedup_tree_vs_ring', float('nan')):.2f}x  tokens equal "
                      f"{row['tokens_equal']}", flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(doc, f, indent=1)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    args = parse_args(argv)
    launch(worker, args, args.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
