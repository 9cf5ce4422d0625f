"""Command line of the engine: ``treeattn run``, ``treeattn bench e2e`` and ``treeattn demo``.

The main CLI (:mod:`treeattn.cli.main`) registers them with :func:`add_run_parser`,
:func:`add_bench_e2e_parser` (on the ``bench`` sub-command's sub-parsers) and :func:`add_demo_parser`;
every handler returns a process exit code.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from treeattn import STRATEGIES
from treeattn.bench.e2e import BENCH_WORKLOADS, bench_e2e, plot_e2e
from treeattn.engine.engine import TreeEngine
from treeattn.engine.model import TreeModel
from treeattn.engine.workloads import WORKLOADS, WorkloadSpec, build_workload

__all__ = ["add_run_parser", "add_bench_e2e_parser", "add_demo_parser", "add_model_args", "load_model"]


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_model_args(p, default_random=None) -> None:
    src = p.add_mutually_exclusive_group(required=default_random is None)
    src.add_argument("--model", metavar="DIR", help="Hugging Face model directory (config.json + safetensors)")
    src.add_argument("--random-weights", metavar="NAME", default=default_random,
                     help="random weights of a preset shape: tiny | llama3-8b")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=65536, help="KV pool capacity in tokens")
    p.add_argument("--window", type=int, default=16, help="decode steps planned at once (1: every step)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the decode forward eagerly")
    p.add_argument("--no-pdl", action="store_true",
                   help="plain attention launches instead of programmatic dependent ones (on by default on "
                        "Hopper and later GPUs)")
    p.add_argument("--compile-workers", type=int, default=None, metavar="N",
                   help="bench e2e, serve: processes that compile every attention-kernel variant up front "
                        "on a GPU (default: one a CPU core, up to 16; 0: this process)")
    p.add_argument("--no-fused-layers", action="store_true",
                   help="PyTorch ops instead of the fused Triton norm / RoPE / SwiGLU kernels on CUDA")


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``run``: decode one workload and write per-step stats and results as JSON."""
    p = subparsers.add_parser("run", help="tree decoding of a workload on a Llama-family model")
    add_model_args(p)
    p.add_argument("--workload", required=True, choices=WORKLOADS)
    p.add_argument("--strategy", default="auto", choices=STRATEGIES)
    p.add_argument("--steps", type=int, default=None, help="at most this many decode steps")
    p.add_argument("--max-new-tokens", type=int, default=16, help="beam / sample: tokens to generate")
    p.add_argument("--prompt-ids", action="append", default=[],
                   help="a prompt as comma-separated token ids (repeat, or separate prompts with ';')")
    p.add_argument("--prompt", action="append", default=[], help="a prompt as text (needs tokenizer.json)")
    p.add_argument("--prompt-len", type=int, default=None, help="pad / draw prompts to this length")
    p.add_argument("--branches", type=int, default=20, help="fewshot: branches b")
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="sample: samples per prompt")
    p.add_argument("--branch-every", type=int, default=0, help="sample: split every leaf each K steps")
    p.add_argument("--branch-factor", type=int, default=2)
    p.add_argument("--max-leaves", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--template-index", type=int, default=None, help="tot-*: entry of the template file")
    p.add_argument("--record", type=int, default=0, help="speculative-*: record of the Medusa file")
    p.add_argument("--scale", type=float, default=1.0, help="tot-*: multiply thought lengths")
    p.add_argument("--json", metavar="OUT", default=None, help="write the result and per-step stats here")
    p.add_argument("--dump-logits", action="store_true", help="sample / fewshot: last logits of every leaf")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--world-size", type=int, default=1,
                   help="ranks sharding the KV along the sequence (start with torchrun --nproc-per-node N)")
    p.set_defaults(func=run_command)
    return p


def add_bench_e2e_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``e2e`` (``treeattn bench e2e``): DeFT Table 5 / Fig. 4 on one GPU."""
    p = subparsers.add_parser("e2e", help="end-to-end decode latency of every workload, per strategy")
    add_model_args(p, default_random="llama3-8b")
    p.add_argument("--workloads", default=",".join(BENCH_WORKLOADS),
                   help=f"comma-separated, from {', '.join(BENCH_WORKLOADS)} (or any run workload)")
    p.add_argument("--strategies", default="auto,sequence", help="compared with the last one")
    p.add_argument("--steps", type=_steps_arg, default=None,
                   help="timed decode steps per workload and strategy, or 'all' (default): every step "
                        "of the workload, cut into --windows consecutive windows")
    p.add_argument("--windows", type=int, default=10,
                   help="places in each workload the timed steps sit (with --steps all: the windows that tile it)")
    p.add_argument("--breakdown-steps", type=int, default=2,
                   help="isolated steps per window for the breakdown")
    p.add_argument("--warmup-steps", type=int, default=1,
                   help="untimed steps before each window")
    p.add_argument("--json", metavar="OUT", default=None)
    p.add_argument("--png", metavar="OUT", default=None)
    p.set_defaults(func=bench_command)
    return p


def _steps_arg(text: str) -> int | None:
    """``--steps`` of ``bench e2e``: a positive count, or ``all`` (None)."""
    if text == "all":
        return None
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"--steps must be a positive count or 'all', got {text}")
    return n


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``demo``: a small Tree-of-Thoughts decode with a tiny random model on the CPU."""
    p = subparsers.add_parser("demo", help="end-to-end Tree-of-Thoughts decoding with a tiny random model")
    p.add_argument("--template", default="sorting", help="ToT template: sorting | docmerge | keyword | set")
    p.add_argument("--scale", type=float, default=0.02, help="multiply thought lengths")
    p.add_argument("--strategies", default="auto,flatten,sequence")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=demo_command)
    return p


# ---------------------------------------------------------------------- helpers
def load_model(args) -> TreeModel:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    fused = False if getattr(args, "no_fused_layers", False) else None
    if args.model:
        return TreeModel.from_pretrained(args.model, device=device, dtype=dtype, fused=fused)
    return TreeModel.random(args.random_weights, device=device, dtype=dtype, seed=args.seed, fused=fused)


def _engine_kw(args) -> dict:
    return {"page_size": args.page_size, "kv_tokens": args.kv_tokens, "window": args.window,
            "cuda_graphs": False if args.no_cuda_graphs else None,
            "pdl": False if args.no_pdl else None, "compile_workers": args.compile_workers}


def _init_ranks(args) -> tuple[int, int]:
    """``(rank, world)`` for ``--world-size`` (initialises torch.distributed under torchrun)."""
    n = getattr(args, "world_size", 1)
    if n < 1:
        raise ValueError(f"--world-size must be >= 1, got {n}")
    if n > 1 and args.workload.startswith("speculative"):
        raise ValueError("--world-size > 1 does not support the speculative workloads")
    from treeattn.engine.sharded import init_distributed
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_distributed(n, device)


def _prompts(args, model) -> list:
    prompts = []
    for group in args.prompt_ids:
        for part in filter(None, (s.strip() for s in group.split(";"))):
            try:
                ids = [int(t) for t in part.split(",") if t.strip()]
            except ValueError:
                raise ValueError(f"--prompt-ids {part!r}: expected comma-separated integers") from None
            bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
            if bad or not ids:
                raise ValueError(f"--prompt-ids {part!r}: ids must be in [0, {model.config.vocab_size})")
            prompts.append(ids)
    if args.prompt:
        if model.tokenizer is None:
            raise ValueError("--prompt needs a model directory with tokenizer.json; use --prompt-ids")
        prompts += [model.tokenizer.encode(text).ids for text in args.prompt]
    return prompts


def _jsonable(result: dict, dump_logits: bool, tokenizer) -> dict:
    out = dict(result)
    if "leaves" in out:
        leaves = []
        for leaf in out["leaves"]:
            rec = {k: v for k, v in leaf.items() if k != "logits"}
            if dump_logits and leaf.get("logits") is not None:
                rec["last_logits"] = leaf["logits"].float().cpu().tolist()
            if tokenizer is not None:
                rec["text"] = tokenizer.decode(leaf["tokens"])
            leaves.append(rec)
        out["leaves"] = leaves
    if tokenizer is not None and "sequences" in out:
        out["texts"] = [tokenizer.decode(s) for s in out["sequences"]]
    return out


def _fail(cmd: str, err: Exception) -> int:
    print(f"treeattn {cmd}: error: {err}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------- commands
def run_command(args) -> int:
    """``treeattn run``."""
    from tqdm import tqdm

    try:
        rank, world = _init_ranks(args)
        model = load_model(args)
        spec = WorkloadSpec(
            args.workload, vocab_size=model.config.vocab_size, prompts=_prompts(args, model),
            prompt_len=args.prompt_len, branches=args.branches, steps=args.steps,
            max_new_tokens=args.max_new_tokens, beams=args.beams, n=args.n, seed=args.seed,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, greedy=args.greedy,
            template_index=args.template_index, record=args.record, scale=args.scale,
            eos_token_ids=model.config.eos_token_ids, branch_every=args.branch_every,
            branch_factor=args.branch_factor, max_leaves=args.max_leaves)
        controller, total = build_workload(spec)
    except (ValueError, FileNotFoundError, ImportError) as e:
        return _fail("run", e)
    steps = min(total, args.steps) if args.steps else total
    kw = dict(strategy=args.strategy, synchronize=model.device.type == "cuda", **_engine_kw(args))
    if world > 1:
        from treeattn.engine.sharded import ShardedTreeEngine
        engine = ShardedTreeEngine(model, **kw)
    else:
        engine = TreeEngine(model, **kw)
    engine.prepare_graphs(controller.query_counts())
    bar = tqdm(total=steps, disable=args.quiet or rank != 0, unit="step", file=sys.stderr)
    clock = {"t": time.perf_counter()}
    walls = []

    def on_step(step, stats):
        now = time.perf_counter()
        walls.append((now - clock["t"]) * 1e3)
        clock["t"] = now
        if stats is not None:
            bar.set_postfix(q=stats.queries, kv=stats.tree_tokens, ms=f"{walls[-1]:.1f}",
                            plan=f"{stats.plan_ms:.1f}", strat=stats.strategy, refresh=False)
        bar.update(1)

    t0 = time.perf_counter()
    try:
        result = engine.run(controller, max_steps=steps, on_step=on_step)
    except (ValueError, FileNotFoundError) as e:
        bar.close()
        return _fail("run", e)
    wall = time.perf_counter() - t0
    bar.close()
    used = {}
    for s in engine.stats:
        used[s.strategy] = used.get(s.strategy, 0) + 1
    pages_at_end = engine.pool.num_pages - engine.pool.num_free_pages
    out = {
        "workload": args.workload, "model": args.model or f"random:{args.random_weights}",
        "device": str(model.device), "dtype": str(model.dtype).replace("torch.", ""),
        "strategy": args.strategy, "steps": len(walls), "wall_s": wall,
        "mean_step_ms": float(np.mean(walls)) if walls else 0.0, "strategies_used": used,
        "kv_pages_in_use_at_end": pages_at_end,
        "per_step": [dict(s.as_dict(), wall_ms=w) for s, w in zip(engine.stats, walls)],
        **_jsonable(result, args.dump_logits, model.tokenizer),
    }
    if world > 1:
        out["world_size"] = world
    engine.reset()
    if world > 1:
        torch.distributed.destroy_process_group()
    if rank != 0:
        return 0
    print(f"{args.workload}: {out['steps']} steps in {wall:.2f} s ({out['mean_step_ms']:.2f} ms/step), "
          f"strategy {args.strategy} -> {used}, {pages_at_end} KV pages in use at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
        print(f"wrote {args.json}")
    return 0


def bench_command(args) -> int:
    """``treeattn bench e2e``."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    try:
        model = load_model(args)
    except (ValueError, FileNotFoundError) as e:
        return _fail("bench e2e", e)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        return _fail("bench e2e", ValueError(f"unknown strategies {bad}; expected from {STRATEGIES}"))
    console.print(f"model {args.model or args.random_weights} ({model.config.num_parameters() / 1e9:.2f} B "
                  f"parameters, {str(model.dtype)[6:]}) on {model.device}")

    done = {}

    def progress(name, strategy, r):
        # every finished run is on disk at once: a benchmark cut off by a time limit keeps them
        done.setdefault(name, {})[strategy] = r
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"partial": True, "runs": done}, f, indent=1)
        console.print(f"  {name:16s} {strategy:10s} {r['mean_step_ms']:8.2f} ms/step  "
                      f"gpu {r['gpu_step_ms']:7.2f} "
                      f"attn {r['breakdown_ms']['attention']:7.2f}  GPU idle {r['idle_ms']:.3f} ms/step "
                      f"(host overhead {r['host_overhead']:.1%})  "
                      f"({r['wall_s']:.1f} s)")

    try:
        result = bench_e2e(model, workloads, strategies, steps=args.steps, windows=args.windows,
                           breakdown_steps=args.breakdown_steps, warmup_steps=args.warmup_steps,
                           seed=args.seed, progress=progress, **_engine_kw(args))
    except (ValueError, FileNotFoundError) as e:
        return _fail("bench e2e", e)
    if model.device.type == "cuda":
        from treeattn.bench.timing import provenance

        result.update(provenance())
    else:
        result.update(device="cpu", torch=torch.__version__)
    result.update(model=args.model or f"random:{args.random_weights}", dtype=str(model.dtype)[6:],
                  steps="all" if args.steps is None else args.steps, windows=args.windows,
                  warmup_steps=args.warmup_steps)
    table = Table("workload", *(f"{s} ms" for s in strategies), "speedup", "DeFT", "met", "gpu speedup",
                  "host overhead")
    for name, w in result["workloads"].items():
        runs = w["strategies"]
        table.add_row(name, *(f"{runs[s]['mean_step_ms']:.2f}" for s in strategies), f"{w['speedup']:.2f}x",
                      f"{w['deft_speedup']}x" if w["deft_speedup"] else "-",
                      {True: "yes", False: "NO", None: "-"}[w["target_met"]], f"{w['gpu_speedup']:.2f}x",
                      " / ".join(f"{runs[s]['host_overhead']:.1%}" for s in strategies))
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        console.print(f"wrote {args.json}")
    if args.png:
        plot_e2e(result, args.png)
        console.print(f"wrote {args.png}")
    return 0


def demo_command(args) -> int:
    """``treeattn demo``: a Tree-of-Thoughts replay with a tiny random Llama, one run per strategy;
    every strategy must produce the same thoughts and free every KV page."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)     # the tiny model's matmuls only lose from splitting across threads
    model = TreeModel.random("small", device=device, dtype=torch.float32, seed=args.seed, std=0.1)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    table = Table("strategy", "steps", "thoughts", "tokens", "KV kB read / layer / step", "ms/step", "plan ms",
                  "chosen", "KV pages peak", "pages freed")
    thoughts, what = {}, ""
    for strategy in strategies:
        spec = WorkloadSpec(f"tot-{args.template}", vocab_size=model.config.vocab_size, seed=args.seed,
                            greedy=True, scale=args.scale)
        try:
            controller, total = build_workload(spec)
        except (ValueError, FileNotFoundError) as e:
            return _fail("demo", e)
        what = f"tot-{args.template}: {total} decode steps, prompt {len(controller.prompt)} tokens"
        engine = TreeEngine(model, strategy=strategy, page_size=16, kv_tokens=16384)
        peak = [0]

        def on_step(step, stats, engine=engine, peak=peak):
            peak[0] = max(peak[0], engine.pool.num_pages - engine.pool.num_free_pages)

        t0 = time.perf_counter()
        result = engine.run(controller, on_step=on_step)
        ms = (time.perf_counter() - t0) * 1e3 / max(1, len(engine.stats))
        engine.reset()
        engine.pool.check()
        freed = engine.pool.num_free_pages == engine.pool.num_pages
        thoughts[strategy] = [t["tokens"] for t in result["thoughts"]]
        chosen = sorted({s.strategy for s in engine.stats})
        table.add_row(strategy, str(len(engine.stats)), str(len(result["thoughts"])),
                      str(sum(len(t) for t in thoughts[strategy])),
                      f"{np.mean([s.kv_bytes for s in engine.stats]) / 1e3:.1f}", f"{ms:.1f}",
                      f"{np.mean([s.plan_ms for s in engine.stats]):.2f}", ",".join(chosen), str(peak[0]),
                      "yes" if freed else "NO")
        if not freed:
            return _fail("demo", RuntimeError(f"{strategy}: KV pages leaked"))
    console.print(f"[bold]Tree-of-Thoughts decode[/bold] with a small random Llama (2 layers, 8/2 heads of "
                  f"64) on {device}: {what}")
    console.print(table)
    same = all(v == thoughts[strategies[0]] for v in thoughts.values())
    console.print("every strategy generated the same thoughts (greedy)" if same else
                  "[red]strategies disagree on the generated thoughts[/red]")
    return 0 if same else 1
