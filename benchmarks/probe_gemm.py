"""What bounds the rest of an end-to-end decode step: Llama-3-8B's GEMMs at decode token counts.

``bench e2e`` splits a step into attention, KV management and the rest; the rest (4.7-7.5 ms a
step on the H200 at f7722e4) is the same for every strategy, so it caps each workload's speedup
over ``sequence`` (benchmarks/NOTES.md, session 34). This times ``F.linear`` (cuBLAS) on the
model's weight shapes (bf16) at the token counts of the workloads, each against the HBM time of its
weights at the copy bandwidth, and sums a step (32 layers of q/k/v, o, gate/up, down; the LM head).
``do_bench`` flushes L2 and times each GEMM alone; ``--graph`` also times a whole step's GEMMs
back to back as one CUDA-graph replay (every layer its own weights, as in the model).

    python benchmarks/probe_gemm.py [--tokens 1,8,32,64,128,256] [--out FILE]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from treeattn.bench.timing import copy_bandwidth, provenance
from treeattn.engine.config import ModelConfig


def step_graph_ms(layers: list, lm_head: torch.Tensor, m: int) -> float:
    """Median ms of one CUDA-graph replay of a step's GEMMs for ``m`` tokens: each layer's q/k/v,
    o, gate/up and down (``layers``: their weights) on activations of the right widths, then the LM
    head, back to back (L2 not flushed between them, as in a decode step)."""
    import triton

    from treeattn.bench.timing import capture_graph

    x = torch.randn(m, lm_head.shape[1], device="cuda", dtype=torch.bfloat16)
    wide = torch.randn(m, layers[0][3].shape[1], device="cuda", dtype=torch.bfloat16)

    def step():
        for qkv, o, gate_up, down in layers:
            F.linear(x, qkv)
            F.linear(x, o)
            F.linear(x, gate_up)
            F.linear(wide, down)
        F.linear(x, lm_head)

    graph = capture_graph(step)
    return triton.testing.do_bench(graph.replay, return_mode="median")


def main() -> None:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,32,64,128,256")
    ap.add_argument("--graph", action="store_true", help="also time a step's GEMMs as one graph replay")
    ap.add_argument("--out")
    args = ap.parse_args()
    c = ModelConfig.preset("llama3-8b")
    shapes = {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o": (c.hidden_size, c.q_size),
              "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
              "lm_head": (c.vocab_size, c.hidden_size)}
    bw = copy_bandwidth()
    res = {**provenance(), "copy_bandwidth_TBps": bw / 1e12, "shapes": shapes, "rows": []}
    weights = {n: torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02 for n, s in shapes.items()}
    per_layer = ("qkv", "o", "gate_up", "down")
    layers = [[torch.randn_like(weights[n]) for n in per_layer] for _ in range(c.num_layers)] if args.graph else []
    for m in (int(t) for t in args.tokens.split(",")):
        row = {"tokens": m, "us": {}, "roofline_us": {}}
        for n, wt in weights.items():
            x = torch.randn(m, wt.shape[1], device="cuda", dtype=torch.bfloat16)
            row["us"][n] = triton.testing.do_bench(lambda: F.linear(x, wt), return_mode="median") * 1e3
            row["roofline_us"][n] = (wt.numel() + x.numel() + m * wt.shape[0]) * 2 / bw * 1e6
        row["step_ms"] = (c.num_layers * sum(row["us"][n] for n in per_layer) + row["us"]["lm_head"]) / 1e3
        row["step_roofline_ms"] = (c.num_layers * sum(row["roofline_us"][n] for n in per_layer)
                                   + row["roofline_us"]["lm_head"]) / 1e3
        if args.graph:
            row["graph_step_ms"] = step_graph_ms(layers, weights["lm_head"], m)
        res["rows"].append(row)
        print(f"tokens {m}: GEMMs {row['step_ms']:.3f} ms a step, at the copy bandwidth "
              f"{row['step_roofline_ms']:.3f} ({row['step_roofline_ms'] / row['step_ms']:.1%}); "
              + (f"as one graph {row['graph_step_ms']:.3f} ms; " if args.graph else "")
              + " ".join(f"{n} {row['us'][n]:.1f}/{row['roofline_us'][n]:.1f}" for n in shapes), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
