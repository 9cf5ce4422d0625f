"""Command line: ``treeattn demo`` (end-to-end tree decoding), ``treeattn run``, ``treeattn attention``
(every strategy on one decoding tree), ``treeattn serve`` and ``treeattn bench kernels|e2e|serve``."""
from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from treeattn import STRATEGIES, DecodingTree, TreeAttention, reference_attention
from treeattn.bench import kernels
from treeattn.cli import calibrate
from treeattn.cli.engine import add_bench_e2e_parser, add_demo_parser, add_run_parser
from treeattn.cli.serve import add_bench_serve_parser, add_serve_parser
from treeattn.tree import tree_from_spec, tree_from_tot_template

log = logging.getLogger("treeattn")

BUILTIN_TREE = "1,4,16_2048,256,64"  # a shared prompt, 4 thoughts, 4 continuations each


def _demo_tree(args) -> tuple[DecodingTree, str]:
    if args.tree:
        return tree_from_spec(args.tree), f"kernel-suite tree {args.tree}"
    try:
        tree = tree_from_tot_template(args.template, args.index)
        return tree, f"Tree-of-Thoughts template '{args.template}' #{args.index}"
    except FileNotFoundError:
        log.warning("ToT templates not found (set TREEATTN_SHARED); using the built-in tree")
        return tree_from_spec(BUILTIN_TREE), f"built-in tree {BUILTIN_TREE}"


def attention(args) -> int:
    from rich.console import Console
    from rich.table import Table

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    hq, hkv = (int(x) for x in args.heads.split("/"))
    d = args.head_dim
    tree, what = _demo_tree(args)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q = torch.randn(tree.num_queries, hq, d, generator=gen, device=device).to(dtype)
    k = torch.randn(tree.num_tokens, 1, hkv, d, generator=gen, device=device).to(dtype)
    v = torch.randn(tree.num_tokens, 1, hkv, d, generator=gen, device=device).to(dtype)
    ref, _ = reference_attention(q, k, v, tree, dtype=torch.float64 if device.type == "cpu" else torch.float32)
    console = Console(width=max(100, Console().width))
    console.print(f"[bold]{what}[/bold]: {tree.num_nodes} nodes, {tree.num_tokens:,} KV tokens, "
                  f"{tree.num_queries} queries; heads {hq}/{hkv}, head_dim {d}, {str(dtype)[6:]} on {device}")
    table = Table("strategy", "work items", "KV MB loaded", "vs sequence", "total IO MB",
                  "max abs error", "run ms")
    base = None
    worst = 0.0
    # the baseline first, so every row can be compared with it
    for s in ("sequence",) + tuple(x for x in STRATEGIES if x != "sequence"):
        w = TreeAttention(device=device)
        plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, strategy=s)
        out = w.run(q, k, v, plan)  # warm-up (compiles on GPU)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = w.run(q, k, v, plan)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        err = (out.double() - ref.double()).abs().max().item()
        worst = max(worst, err)
        base = plan.io.kv if s == "sequence" else base
        name = s if s != "auto" else f"auto -> {plan.strategy}"
        table.add_row(name, f"{plan.num_items:,}", f"{plan.io.kv / 1e6:,.2f}", f"{plan.io.kv / base:.3f}x",
                      f"{plan.io.total / 1e6:,.2f}", f"{err:.1e}", f"{ms:.2f}")
    console.print(table)
    console.print("(vs sequence: KV bytes relative to Q-guided Flash-Decoding, which reads each "
                  "shared token once per query)")
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    return 0 if worst <= tol * max(1.0, ref.abs().max().item()) else 1


def _demo(decode):
    """``treeattn demo``: every attention strategy on the ToT template's tree (KV bytes vs the
    sequence baseline, error vs the reference), then an end-to-end decode of that template."""
    def run(args) -> int:
        table = argparse.Namespace(tree=None, template=args.template, index=0, heads="32/8",
                                   head_dim=128, device=args.device, seed=args.seed)
        return attention(table) or decode(args)
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="treeattn", description="Prefix-aware tree attention.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = add_demo_parser(sub)
    demo.set_defaults(func=_demo(demo.get_default("func")))
    add_run_parser(sub)
    add_serve_parser(sub)
    p = sub.add_parser("attention", help="every strategy on one decoding tree: KV bytes and error")
    p.add_argument("--template", default="sorting", help="ToT template: sorting|docmerge|keyword|set")
    p.add_argument("--index", type=int, default=0, help="which tree of the template file")
    p.add_argument("--tree", default=None, help="a kernel-suite spec instead, e.g. 1,16,64_1024,256,32")
    p.add_argument("--heads", default="32/8", help="query/KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=attention)
    bench = sub.add_parser("bench", help="benchmarks: kernels and e2e (CUDA), serve (HTTP client)").add_subparsers(dest="bench", required=True)
    kernels.add_parser(bench)
    add_bench_e2e_parser(bench)
    add_bench_serve_parser(bench)
    calibrate.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
