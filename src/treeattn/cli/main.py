"""Command line: ``treeattn demo`` (what the project is for, on the CPU in under a minute),
``treeattn run`` (tree decoding of a workload), ``treeattn attention`` (every strategy on one
decoding tree), ``treeattn serve`` and ``treeattn bench kernels|e2e|serve``.

Bad arguments end in a one-line ``treeattn <cmd>: error: ...`` and exit status 2 before any work.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from treeattn import STRATEGIES, DecodingTree, KVPoolOutOfMemory, TreeAttention, reference_attention
from treeattn.bench import kernels
from treeattn.cli.args import (CliParser, add_log_level, device_arg, error, heads_arg, nonnegative_int,
                               positive_int, tree_spec_arg)
from treeattn.cli.demo import add_demo_parser
from treeattn.cli.engine import add_bench_e2e_parser, add_bench_workloads_parser, add_run_parser
from treeattn.cli import calibrate
from treeattn.cli.serve import add_bench_serve_parser, add_serve_parser
from treeattn.engine.workloads import TOT_TEMPLATES
from treeattn.tree import tree_from_spec, tree_from_tot_template

log = logging.getLogger(__name__)

BUILTIN_TREE = "1,4,16_2048,256,64"  # a shared prompt, 4 thoughts, 4 continuations each

#: Exceptions by which the library rejects bad input: reported in one line (exit 2), no traceback.
INPUT_ERRORS = (ValueError, TypeError, FileNotFoundError, KVPoolOutOfMemory)


def version() -> str:
    """The installed distribution's version, else the source tree's ``treeattn.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("treeattn")
    except PackageNotFoundError:
        import treeattn

        return treeattn.__version__


def _attention_tree(args) -> tuple[DecodingTree, str]:
    """The tree of ``attention``: ``--tree``, else ``--template`` (default 'sorting', or the
    built-in tree with a warning when the templates are not installed)."""
    if args.tree:
        return tree_from_spec(args.tree), f"kernel-suite tree {args.tree}"
    try:
        tree = tree_from_tot_template(args.template or "sorting", args.index)
    except FileNotFoundError:
        if args.template:
            raise
        log.warning("the Tree-of-Thoughts templates are not installed (set TREEATTN_SHARED to the "
                    "repository's shared/ folder); using the built-in tree %s", BUILTIN_TREE)
        return tree_from_spec(BUILTIN_TREE), f"built-in tree {BUILTIN_TREE}"
    return tree, f"Tree-of-Thoughts template '{args.template or 'sorting'}' #{args.index}"


def _template_arg(text: str) -> str:
    """A ToT template name or a template file."""
    from pathlib import Path

    if text in TOT_TEMPLATES or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"unknown template {text!r}; expected one of "
                                     f"{', '.join(TOT_TEMPLATES)} or a template JSON file")


def attention(args) -> int:
    """``treeattn attention``: plan and run every strategy on one tree; KV bytes and error against
    the float64 reference. Exit 1 when a strategy's error is above the dtype's tolerance."""
    from rich.console import Console
    from rich.table import Table

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    hq, hkv = args.heads
    d = args.head_dim
    tree, what = _attention_tree(args)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q = torch.randn(tree.num_queries, hq, d, generator=gen, device=device).to(dtype)
    k = torch.randn(tree.num_tokens, 1, hkv, d, generator=gen, device=device).to(dtype)
    v = torch.randn(tree.num_tokens, 1, hkv, d, generator=gen, device=device).to(dtype)
    # plan every strategy before running any, so a head shape the planners reject fails first
    plans = {}
    for s in ("sequence",) + tuple(x for x in STRATEGIES if x != "sequence"):  # the baseline first
        w = TreeAttention(device=device)
        plans[s] = (w, w.plan(tree, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, strategy=s))
    ref, _ = reference_attention(q, k, v, tree, dtype=torch.float64 if device.type == "cpu" else torch.float32)
    console = Console(width=max(100, Console().width))
    console.print(f"[bold]{what}[/bold]: {tree.num_nodes} nodes, {tree.num_tokens:,} KV tokens, "
                  f"{tree.num_queries} queries; heads {hq}/{hkv}, head_dim {d}, {str(dtype)[6:]} on {device}")
    timed = device.type == "cuda"   # the CPU runs PyTorch's reference backend: its times say nothing
    table = Table("strategy", "work items", "KV MB loaded", "vs sequence", "total IO MB", "max abs error",
                  *(["run ms"] if timed else []))
    worst = 0.0
    base = plans["sequence"][1].io.kv
    for s, (w, plan) in plans.items():
        out = w.run(q, k, v, plan)  # warm-up (compiles on GPU)
        if timed:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = w.run(q, k, v, plan)
        if timed:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        err = (out.double() - ref.double()).abs().max().item()
        worst = max(worst, err)
        name = s if s != "auto" else f"auto -> {plan.strategy}"
        table.add_row(name, f"{plan.num_items:,}", f"{plan.io.kv / 1e6:,.2f}", f"{plan.io.kv / base:.3f}x",
                      f"{plan.io.total / 1e6:,.2f}", f"{err:.1e}", *([f"{ms:.2f}"] if timed else []))
    console.print(table)
    console.print("(vs sequence: KV bytes relative to Q-guided Flash-Decoding, which reads each "
                  "shared token once per query)")
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    return 0 if worst <= tol * max(1.0, ref.abs().max().item()) else 1


def _add_attention_parser(sub) -> None:
    p = sub.add_parser("attention", help="every strategy on one decoding tree: KV bytes and error",
                       description="Plan and run every attention strategy on one decoding tree with random "
                                   "inputs: work items, KV bytes read (against the sequence baseline) and the "
                                   "error against a float64 reference.")
    p.add_argument("--template", type=_template_arg, default=None,
                   help=f"Tree-of-Thoughts template: {' | '.join(TOT_TEMPLATES)} or a template JSON file "
                        "(default: sorting)")
    p.add_argument("--index", type=nonnegative_int, default=0, help="which tree of the template file")
    p.add_argument("--tree", type=tree_spec_arg, default=None,
                   help="a kernel-suite spec instead of a template, e.g. 1,16,64_1024,256,32")
    p.add_argument("--heads", type=heads_arg, default=(32, 8), metavar="Q/KV",
                   help="query/KV heads, query a multiple of KV (default: 32/8)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="channels per head (default: 128)")
    p.add_argument("--device", type=device_arg, default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random queries, keys and values")
    add_log_level(p)
    p.set_defaults(func=attention)


def build_parser() -> argparse.ArgumentParser:
    """The ``treeattn`` parser with every sub-command."""
    parser = CliParser(prog="treeattn", description="Prefix-aware tree attention and tree decoding.")
    parser.add_argument("--version", action="version", version=f"treeattn {version()}")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                        help="least severe log messages shown on stderr (default: info)")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    add_demo_parser(sub)
    add_run_parser(sub)
    add_serve_parser(sub)
    _add_attention_parser(sub)
    calibrate.add_parser(sub)
    bench_p = sub.add_parser("bench", help="benchmarks: kernels and e2e (CUDA), serve (HTTP client)",
                             description="Benchmarks: the kernel suite and end-to-end decoding (CUDA), "
                                         "and request traffic sent to a running server.")
    add_log_level(bench_p)
    bench = bench_p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    kernels.add_parser(bench)
    add_bench_e2e_parser(bench)
    add_bench_workloads_parser(bench)
    add_bench_serve_parser(bench)
    return parser


def main(argv=None) -> int:
    """Run the ``treeattn`` command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    # the one logging set-up of the process; library modules log through their own loggers
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", force=True)
    prog = " ".join(["treeattn", args.cmd] + ([args.bench] if args.cmd == "bench" else []))
    try:
        return args.func(args)
    except INPUT_ERRORS as e:
        log.debug("%s failed", prog, exc_info=True)
        return error(prog, e)


if __name__ == "__main__":
    sys.exit(main())
