"""Non-attention part of one decode layer (``post_attention`` + the next ``pre_attention``, as one
CUDA-graph segment of :mod:`treeattn.engine.graphs`): fused Triton kernels vs the PyTorch ops.

One layer of random weights of the ``llama3-8b`` preset (hidden 4096, 32/8 heads, head dim 128,
intermediate 14336; bf16) and a dummy attention output. For each token count ``n`` and mode
(``fused`` / ``unfused``), the segment

    h1 = post_attention(0, h0, o);  q = pre_attention(0, h1, positions, slots, caches)

(writing into static buffers, ``h0`` never changes so every replay does the same work) is captured
in a CUDA graph and timed with ``triton.testing.do_bench`` (median, L2 flushed between runs); the
eager time, the number of kernels of one eager run (torch.profiler) and, as a floor, a graph of the
segment's four GEMMs alone are measured too. The roofline is the layer's weight bytes over the
measured device-to-device copy bandwidth (and over the nominal ``--peak-tbs``). The fused and
unfused outputs are compared (relative L2 of ``h1`` and ``q``, and of the cached K/V).

On one H200 (a minute)::

    python benchmarks/bench_layers.py --out benchmarks/results/layers_h200.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F

try:
    import treeattn  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from treeattn.bench.timing import capture_graph, copy_bandwidth, provenance
from treeattn.engine.config import ModelConfig
from treeattn.engine.model import TreeModel

DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b", help="random-weights preset (one layer of it is used)")
    ap.add_argument("--tokens", default="1,16,64,256", help="comma-separated token counts per step")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="nominal HBM bandwidth, TB/s (H200: 4.8)")
    ap.add_argument("--rep", type=int, default=200, help="do_bench's target time per measurement, ms")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def count_kernels(fn) -> int | None:
    """GPU kernels launched by one eager ``fn()`` (None when the profiler cannot tell)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as e:  # noqa: BLE001 - the count is informative only
        print(f"(kernel count unavailable: {type(e).__name__}: {e})", file=sys.stderr)
        return None


def weight_bytes(model: TreeModel) -> int:
    w = model.weights.layers[0]
    tensors = (getattr(w, f.name) for f in dataclasses.fields(w))
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def median_us(fn, rep: int) -> float:
    import triton

    return triton.testing.do_bench(fn, rep=rep, return_mode="median") * 1e3


def measure(model: TreeModel, n: int, num_slots: int, gen: torch.Generator, rep: int) -> dict:
    """Times, kernel counts and fused-vs-unfused differences of one ``n``-token segment."""
    c, w, dev, dt = model.config, model.weights.layers[0], model.device, model.dtype
    h0 = torch.randn(n, c.hidden_size, device=dev, dtype=dt, generator=gen)
    o = torch.randn(n, c.num_heads, c.head_dim, device=dev, dtype=dt, generator=gen)
    pos = torch.randint(0, model.cos.shape[0], (n,), device=dev, generator=gen)
    slots = torch.randperm(num_slots, device=dev, generator=gen)[:n]
    x = torch.randn(n, c.hidden_size, device=dev, dtype=dt, generator=gen)
    a = torch.randn(n, c.intermediate_size, device=dev, dtype=dt, generator=gen)

    def gemms():                              # the segment's four projections alone: the floor
        F.linear(x, w.qkv, w.qkv_bias)
        F.linear(o.view(n, c.q_size), w.o, w.o_bias)
        F.linear(x, w.gate_up, w.gate_up_bias)
        F.linear(a, w.down, w.down_bias)

    row = {"gemm_only_graph_us": median_us(capture_graph(gemms).replay, rep)}
    outs = {}
    for mode in ("unfused", "fused"):
        model.fused = mode == "fused"
        caches = [(torch.zeros(num_slots, c.num_kv_heads, c.head_dim, device=dev, dtype=dt),
                   torch.zeros(num_slots, c.num_kv_heads, c.head_dim, device=dev, dtype=dt))]
        h1 = torch.empty_like(h0)
        q = torch.empty(n, c.num_heads, c.head_dim, device=dev, dtype=dt)

        def segment(caches=caches, h1=h1, q=q):   # as graphs.py's middle segments (h0 stays)
            model.post_attention(0, h0, o, out=h1)
            model.pre_attention(0, h1, pos, slots, caches, q_out=q)

        graph = capture_graph(segment)
        row[f"{mode}_graph_us"] = median_us(graph.replay, rep)
        with torch.no_grad():
            row[f"{mode}_eager_us"] = median_us(segment, rep)
        row[f"{mode}_kernels"] = count_kernels(segment)
        graph.replay()
        torch.cuda.synchronize()
        outs[mode] = (h1.clone(), q.clone(), caches[0][0][slots].clone(), caches[0][1][slots].clone())
    for name, f, u in zip("hqkv", outs["fused"], outs["unfused"]):
        row[f"rel_l2_{name}"] = rel_l2(f, u)
    return row


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_layers.py needs a CUDA GPU")
    dev, dt = torch.device(DEVICE), DTYPES[args.dtype]
    config = dataclasses.replace(ModelConfig.preset(args.model), num_layers=1, vocab_size=256)
    model = TreeModel.random(config, device=dev, dtype=dt)
    c = config
    tokens = [int(t) for t in args.tokens.split(",")]
    max_n = max(tokens)
    model.ensure_positions(8192)
    num_slots = 4 * max_n + 16
    wbytes = weight_bytes(model)
    bw = copy_bandwidth()
    roof_us, roof_peak_us = wbytes / bw * 1e6, wbytes / (args.peak_tbs * 1e12) * 1e6
    print(f"{args.model} layer, {args.dtype}: {wbytes / 1e6:.1f} MB of weights; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s -> roofline {roof_us:.1f} us "
          f"({roof_peak_us:.1f} us at {args.peak_tbs} TB/s)")

    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for n in tokens:
        row = {"tokens": n, "roofline_us": roof_us, "roofline_peak_us": roof_peak_us}
        row.update(measure(model, n, num_slots, gen, args.rep))
        row["speedup"] = row["unfused_graph_us"] / row["fused_graph_us"]
        rows.append(row)

    head = (f"{'n':>4} {'unfused us':>11} {'fused us':>9} {'speedup':>8} {'gemms us':>9} {'roofline':>9} "
            f"{'kernels u/f':>12} {'eager u/f us':>16} {'rel L2 h/q':>16}")
    print(head)
    for r in rows:
        print(f"{r['tokens']:>4} {r['unfused_graph_us']:>11.1f} {r['fused_graph_us']:>9.1f} "
              f"{r['speedup']:>7.2f}x {r['gemm_only_graph_us']:>9.1f} {r['roofline_us']:>9.1f} "
              f"{str(r['unfused_kernels']) + '/' + str(r['fused_kernels']):>12} "
              f"{r['unfused_eager_us']:>7.0f}/{r['fused_eager_us']:<8.0f} "
              f"{r['rel_l2_h']:>7.1e}/{r['rel_l2_q']:<8.1e}")
    result = {"benchmark": "bench_layers", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "provenance": provenance(), "args": vars(args),
              "shapes": {"hidden": c.hidden_size, "heads": c.num_heads, "kv_heads": c.num_kv_heads,
                         "head_dim": c.head_dim, "intermediate": c.intermediate_size},
              "weight_bytes": wbytes, "copy_bandwidth_Bps": bw, "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
