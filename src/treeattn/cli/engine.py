"""Command line of the engine: ``treeattn run`` and ``treeattn bench e2e``.

The main CLI (:mod:`treeattn.cli.main`) registers them with :func:`add_run_parser`,
:func:`add_bench_e2e_parser` (on the ``bench`` sub-command's sub-parsers); every handler returns a
process exit code.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from treeattn import STRATEGIES, KVPoolOutOfMemory
from treeattn.bench.e2e import BENCH_WORKLOADS, bench_e2e, plot_e2e
from treeattn.engine.engine import TreeEngine
from treeattn.engine.model import TreeModel
from treeattn.cli.args import (add_log_level, device_arg, error, existing_dir, nonnegative_int, positive_float,
                               positive_int, prepare_output, probability, strategies_arg)
from treeattn.engine.config import PRESETS, ModelConfig, load_config
from treeattn.engine.parallel import TensorParallel
from treeattn.engine.workloads import WORKLOADS, WorkloadSpec, build_workload

__all__ = ["add_run_parser", "add_bench_e2e_parser", "add_model_args", "load_model", "init_ranks", "add_grid_args"]


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_model_args(p, default_random=None) -> None:
    """The model, device and KV-pool options shared by ``run``, ``serve`` and ``bench e2e``."""
    src = p.add_mutually_exclusive_group(required=default_random is None)
    src.add_argument("--model", metavar="DIR", type=existing_dir,
                     help="Hugging Face model directory (config.json + safetensors)")
    src.add_argument("--random-weights", metavar="NAME", default=default_random, choices=sorted(PRESETS),
                     help=f"random weights of a preset shape: {' | '.join(sorted(PRESETS))}")
    p.add_argument("--device", type=device_arg, default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights, prompts and sampling")
    p.add_argument("--page-size", type=positive_int, default=16, help="KV tokens per page (default: 16)")
    p.add_argument("--kv-tokens", type=positive_int, default=65536,
                   help="KV pool capacity in tokens (default: 65536)")
    p.add_argument("--window", type=positive_int, default=16,
                   help="decode steps planned at once (1: every step; default: 16)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the decode forward eagerly")
    p.add_argument("--no-pdl", action="store_true",
                   help="plain attention launches instead of programmatic dependent ones (on by default on "
                        "Hopper and later GPUs)")
    p.add_argument("--compile-workers", type=nonnegative_int, default=None, metavar="N",
                   help="bench e2e, serve: processes that compile every attention-kernel variant up front "
                        "on a GPU (default: one a CPU core, up to 16; 0: this process)")
    p.add_argument("--no-fused-layers", action="store_true",
                   help="PyTorch ops instead of the fused Triton norm / RoPE / SwiGLU kernels on CUDA")
    add_log_level(p)


def add_grid_args(p) -> None:
    """``--tp`` / ``--sp``, shared by ``run`` and ``serve``."""
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: heads, MLP and vocabulary split over them (default: 1)")
    p.add_argument("--sp", type=positive_int, default=1,
                   help="ranks sharding the KV along the sequence, each holding --tp ranks (default: 1); "
                        "start TP x SP processes with torchrun --nproc-per-node TP*SP")


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``run``: decode one workload, print what it generated (``--json``: with per-step stats)."""
    p = subparsers.add_parser("run", help="tree decoding of a workload on a Llama-family model",
                              description="Decode one workload on a Llama-family model (a Hugging Face "
                                          "directory or random weights) and print the generated text, or "
                                          "token ids without a tokenizer, of every sequence.")
    add_model_args(p)
    p.add_argument("--workload", required=True, choices=WORKLOADS, metavar="NAME",
                   help=f"one of {', '.join(WORKLOADS)}")
    p.add_argument("--strategy", default="auto", choices=STRATEGIES,
                   help="attention strategy of every decode step (default: auto, the cost model's pick)")
    p.add_argument("--steps", type=positive_int, default=None, help="at most this many decode steps")
    p.add_argument("--max-new-tokens", type=positive_int, default=16,
                   help="beam / sample: tokens to generate (default: 16)")
    p.add_argument("--prompt-ids", action="append", default=[],
                   help="a prompt as comma-separated token ids (repeat, or separate prompts with ';')")
    p.add_argument("--prompt", action="append", default=[], help="a prompt as text (needs tokenizer.json)")
    p.add_argument("--prompt-len", type=positive_int, default=None, help="pad / draw prompts to this length")
    p.add_argument("--branches", type=positive_int, default=20, help="fewshot: branches b (default: 20)")
    p.add_argument("--beams", type=positive_int, default=4, help="beam: beams (default: 4)")
    p.add_argument("--n", type=positive_int, default=4, help="sample: samples per prompt (default: 4)")
    p.add_argument("--branch-every", type=nonnegative_int, default=0,
                   help="sample: split every leaf each K steps (0: never)")
    p.add_argument("--branch-factor", type=positive_int, default=2,
                   help="sample: children of each split (default: 2)")
    p.add_argument("--max-leaves", type=positive_int, default=64,
                   help="sample: no splits beyond this many leaves (default: 64)")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature (default: 1)")
    p.add_argument("--top-k", type=nonnegative_int, default=0, help="sample from the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass (default: 1)")
    p.add_argument("--greedy", action="store_true", help="always take the likeliest token")
    p.add_argument("--template-index", type=nonnegative_int, default=None,
                   help="tot-*: entry of the template file")
    p.add_argument("--record", type=nonnegative_int, default=0,
                   help="speculative-*: record of the Medusa file")
    p.add_argument("--scale", type=positive_float, default=1.0, help="tot-*: multiply thought lengths")
    p.add_argument("--json", metavar="OUT", default=None, help="write the result and per-step stats here")
    p.add_argument("--dump-logits", action="store_true", help="sample / fewshot: last logits of every leaf")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_grid_args(p)
    p.set_defaults(func=run_command)
    return p


def add_bench_e2e_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``e2e`` (``treeattn bench e2e``): DeFT Table 5 / Fig. 4 on one GPU."""
    p = subparsers.add_parser("e2e", help="end-to-end decode latency of every workload, per strategy",
                              description="End-to-end decode latency of tree-decoding workloads, per "
                                          "strategy (DeFT Table 5 / Fig. 4).")
    add_model_args(p, default_random="llama3-8b")
    p.add_argument("--workloads", type=_workloads_arg, default=",".join(BENCH_WORKLOADS),
                   help=f"comma-separated, from {', '.join(BENCH_WORKLOADS)} (or any run workload)")
    p.add_argument("--strategies", type=strategies_arg, default="auto,sequence",
                   help="comma-separated strategies, compared with the last one (default: auto,sequence)")
    p.add_argument("--steps", type=_steps_arg, default=None,
                   help="timed decode steps per workload and strategy, or 'all' (default): every step "
                        "of the workload, cut into --windows consecutive windows")
    p.add_argument("--windows", type=positive_int, default=10,
                   help="places in each workload the timed steps sit (with --steps all: the windows that tile it)")
    p.add_argument("--breakdown-steps", type=nonnegative_int, default=2,
                   help="isolated steps per window for the breakdown")
    p.add_argument("--warmup-steps", type=nonnegative_int, default=1,
                   help="untimed steps before each window")
    p.add_argument("--json", metavar="OUT", default=None, help="write the results here (JSON)")
    p.add_argument("--png", metavar="OUT", default=None, help="plot the speedups here")
    p.set_defaults(func=bench_command)
    return p


def _workloads_arg(text: str) -> list[str]:
    """``--workloads`` of ``bench e2e``: comma-separated names of :data:`BENCH_WORKLOADS` or
    :data:`WORKLOADS`."""
    names = [w.strip() for w in text.split(",") if w.strip()]
    known = dict.fromkeys(BENCH_WORKLOADS + WORKLOADS)
    bad = [w for w in names if w not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown workloads {', '.join(bad) or '(none given)'}; "
                                         f"expected a comma-separated list from {', '.join(known)}")
    return names


def _steps_arg(text: str) -> int | None:
    """``--steps`` of ``bench e2e``: a positive count, or ``all`` (None)."""
    if text == "all":
        return None
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"--steps must be a positive count or 'all', got {text}")
    return n


# ---------------------------------------------------------------------- helpers
def load_model(args, tp=None) -> TreeModel:
    """The model of ``--model`` / ``--random-weights``; ``tp``: this rank's tensor-parallel share."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    fused = False if getattr(args, "no_fused_layers", False) else None
    if args.model:
        return TreeModel.from_pretrained(args.model, device=device, dtype=dtype, fused=fused, tp=tp)
    return TreeModel.random(args.random_weights, device=device, dtype=dtype, seed=args.seed, fused=fused, tp=tp)


def _engine_kw(args) -> dict:
    return {"page_size": args.page_size, "kv_tokens": args.kv_tokens, "window": args.window,
            "cuda_graphs": False if args.no_cuda_graphs else None,
            "pdl": False if args.no_pdl else None, "compile_workers": args.compile_workers}


def init_ranks(args, command: str = "run"):
    """This process's :class:`~treeattn.engine.parallel.Grid` for ``--tp`` / ``--sp`` of
    ``treeattn <command>`` (initialises torch.distributed under torchrun); ValueError first when
    the model does not split over ``--tp`` ranks or the processes are not ``--tp x --sp``."""
    from treeattn.engine.parallel import init_grid

    if args.tp > 1:
        cfg = load_config(args.model) if args.model else ModelConfig.preset(args.random_weights)
        TensorParallel(0, args.tp).check(cfg)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_grid(args.tp, args.sp, device, command=command)


def _prompt_ids(args) -> list:
    """The ``--prompt-ids`` prompts as lists of ints (their range is checked against the model)."""
    prompts = []
    for group in args.prompt_ids:
        for part in filter(None, (s.strip() for s in group.split(";"))):
            try:
                ids = [int(t) for t in part.split(",") if t.strip()]
            except ValueError:
                raise ValueError(f"--prompt-ids {part!r}: expected comma-separated integers") from None
            if not ids:
                raise ValueError(f"--prompt-ids {part!r}: expected comma-separated integers")
            prompts.append(ids)
    return prompts


def _prompts(args, model) -> list:
    prompts = _prompt_ids(args)
    for ids in prompts:
        if not all(0 <= t < model.config.vocab_size for t in ids):
            raise ValueError(f"--prompt-ids {','.join(map(str, ids))}: ids must be in "
                             f"[0, {model.config.vocab_size})")
    if args.prompt:
        if model.tokenizer is None:
            raise ValueError("--prompt needs a model directory with tokenizer.json; use --prompt-ids")
        prompts += [model.tokenizer.encode(text).ids for text in args.prompt]
    return prompts


def _tokens_needed(args, prompt_lens: list) -> tuple[int, int, str]:
    """``(KV tokens, longest sequence, what)``: a lower bound of what ``beam``, ``sample`` and
    ``fewshot`` hold in the KV pool at their end (every prompt plus every leaf's new tokens), and
    their longest sequence; (0, 0, "") for the replayed workloads, whose files fix their size."""
    def plen(default: int) -> list:
        if args.workload == "sample":     # sample decodes its prompts as given
            return prompt_lens or [args.prompt_len or default]
        # beam and fewshot decode the first prompt, cut or repeated to --prompt-len
        return [args.prompt_len or (prompt_lens[0] if prompt_lens else default)]

    if args.workload == "beam":
        p, new = plen(16)[0], args.max_new_tokens
        return p + args.beams * new, p + new, f"a {p}-token prompt + {args.beams} beams x {new} new tokens"
    if args.workload == "sample":
        ps, new = plen(16), args.max_new_tokens
        return (sum(ps) + len(ps) * args.n * new, max(ps) + new,
                f"{len(ps)} prompt(s) of {sum(ps)} tokens + {len(ps) * args.n} samples x {new} new tokens")
    if args.workload == "fewshot":
        p, new = plen(4000)[0], args.steps or 400
        return p + args.branches * new, p + new, f"a {p}-token prompt + {args.branches} branches x {new} steps"
    return 0, 0, ""


def check_run_args(args) -> None:
    """What ``run`` can check before loading the model: prompt ids parse, and the KV pool holds
    the workload. Raises ValueError naming the options at fault."""
    lens = [len(p) for p in _prompt_ids(args)]
    if args.prompt and args.workload in ("beam", "sample", "fewshot"):
        lens += [1] * len(args.prompt)    # (their token counts are known once the tokenizer is loaded)
    need, _, what = _tokens_needed(args, lens)
    if need > args.kv_tokens:
        raise ValueError(f"{what} need at least {need:,} KV tokens, more than --kv-tokens {args.kv_tokens:,}; "
                         f"raise --kv-tokens or lower --max-new-tokens / the number of sequences")


def _check_positions(args, model, prompts: list) -> None:
    """The longest sequence must fit the model's positions (checked once the model is loaded)."""
    _, longest, what = _tokens_needed(args, [len(p) for p in prompts])
    limit = model.config.max_position_embeddings
    if longest > limit:
        raise ValueError(f"{what}: sequences of {longest:,} tokens exceed the model's "
                         f"max_position_embeddings ({limit:,})")


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


#: ``run`` prints at most this many generated sequences (``--json`` holds all of them)
SHOWN_SEQUENCES = 16


def generated(result: dict, controller) -> list[tuple[str, list]]:
    """``[(label, new token ids)]``: what a workload generated, one entry per beam, leaf, thought
    or accepted sequence, without the prompts."""
    if "sequences" in result:          # beam search, best first
        p = len(controller.prompt)
        return [(f"beam {i} (score {score:.3f})", seq[p:])
                for i, (seq, score) in enumerate(zip(result["sequences"], result["scores"]))]
    if "leaves" in result:             # sampling: the prompt index of every leaf
        prompts = controller.prompts
        return [(f"prompt {leaf['prompt']} leaf {leaf['node']}",
                 leaf["tokens"][len(prompts[leaf["prompt"]]) if leaf["prompt"] is not None else 0:])
                for leaf in result["leaves"]]
    if "thoughts" in result:
        return [(f"thought {t['template_node']}", t["tokens"]) for t in result["thoughts"]]
    if "tokens" in result:             # speculative decoding's accepted sequence
        return [(f"accepted ({result['accepted']} tokens)", result["tokens"][len(controller.prompt):])]
    return []


def print_generated(result: dict, controller, tokenizer) -> None:
    """Print every generated sequence: its text with a tokenizer, else its token ids."""
    seqs = generated(result, controller)
    for label, ids in seqs[:SHOWN_SEQUENCES]:
        body = repr(tokenizer.decode(ids)) if tokenizer is not None else " ".join(map(str, ids))
        print(f"{label}: {body}")
    if len(seqs) > SHOWN_SEQUENCES:
        print(f"... and {len(seqs) - SHOWN_SEQUENCES} more (all of them with --json)")


# ---------------------------------------------------------------------- commands
def run_command(args) -> int:
    """``treeattn run``."""
    from tqdm import tqdm

    try:
        check_run_args(args)
        prepare_output(args.json, "--json")
        if args.sp > 1 and args.workload.startswith("speculative"):
            raise ValueError("--sp > 1 does not support the speculative workloads")
        grid = init_ranks(args)
        model = load_model(args, tp=grid.tp)
        prompts = _prompts(args, model)
        _check_positions(args, model, prompts)
        spec = WorkloadSpec(
            args.workload, vocab_size=model.config.vocab_size, prompts=prompts,
            prompt_len=args.prompt_len, branches=args.branches, steps=args.steps,
            max_new_tokens=args.max_new_tokens, beams=args.beams, n=args.n, seed=args.seed,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, greedy=args.greedy,
            template_index=args.template_index, record=args.record, scale=args.scale,
            eos_token_ids=model.config.eos_token_ids, branch_every=args.branch_every,
            branch_factor=args.branch_factor, max_leaves=args.max_leaves)
        controller, total = build_workload(spec)
    except (ValueError, FileNotFoundError, ImportError) as e:
        return error("treeattn run", e)
    steps = min(total, args.steps) if args.steps else total
    kw = dict(strategy=args.strategy, synchronize=model.device.type == "cuda", **_engine_kw(args))
    if grid.sp_group is not None:
        from treeattn.engine.sharded import ShardedTreeEngine
        engine = ShardedTreeEngine(model, group=grid.sp_group, **kw)
    else:
        engine = TreeEngine(model, **kw)
    engine.prepare_graphs(controller.query_counts())
    bar = tqdm(total=steps, disable=args.quiet or grid.rank != 0, unit="step", file=sys.stderr)
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
    except (ValueError, FileNotFoundError, KVPoolOutOfMemory) as e:
        bar.close()
        return error("treeattn run", e)
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
    if grid.world > 1:
        out.update(world_size=grid.world, tp=args.tp, sp=args.sp)
    engine.reset()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if grid.rank != 0:
        return 0
    print_generated(result, controller, model.tokenizer)
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
        prepare_output(args.json, "--json")
        prepare_output(args.png, "--png")
        model = load_model(args)
    except (ValueError, FileNotFoundError) as e:
        return error("treeattn bench e2e", e)
    workloads, strategies = args.workloads, tuple(args.strategies)
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
    except (ValueError, FileNotFoundError, KVPoolOutOfMemory) as e:
        return error("treeattn bench e2e", e)
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


# ---------------------------------------------------------------------- bench workloads
def add_bench_workloads_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``workloads`` (``treeattn bench workloads``): the workloads users run, end to end."""
    from treeattn.bench.workloads import DEFAULT_WORKLOADS

    p = subparsers.add_parser(
        "workloads", help="beam search, n-sampling, RL rollouts, best-of-N: wall vs GPU vs floor, "
                          "auto vs sequence vs transformers (CUDA)",
        description="Per workload and strategy: wall and isolated GPU ms a decode step, host syncs in "
                    "the loop, the step's floor (weights + unique KV + logits at the measured copy "
                    "bandwidth), and transformers' generate on the same shapes.")
    add_model_args(p, default_random="llama3-8b")
    p.add_argument("--workloads", type=_bench_workloads_arg, default=",".join(DEFAULT_WORKLOADS),
                   help="comma-separated: beam-K, sample-N, group-PxN, rollout-PxN, best-of-N or a run "
                        f"workload (default: {','.join(DEFAULT_WORKLOADS)})")
    p.add_argument("--prompt-len", type=positive_int, default=None,
                   help="prompt tokens (default: 2000 for beam search, 1500 otherwise)")
    p.add_argument("--new-tokens", type=positive_int, default=None,
                   help="decode steps of each workload (default: 64; 128 for rollouts and best-of-N)")
    p.add_argument("--strategies", type=strategies_arg, default="auto,sequence",
                   help="comma-separated strategies (default: auto,sequence)")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers' generate")
    p.add_argument("--out", metavar="JSON", default=None, help="write the results here")
    p.add_argument("--plot", metavar="PNG", default=None, help="plot ms/step here")
    p.set_defaults(func=bench_workloads_command, kv_tokens=1 << 17)
    return p


def _bench_workloads_arg(text: str) -> list[str]:
    from treeattn.bench.workloads import parse_workload

    names = [w.strip() for w in text.split(",") if w.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no workloads given")
    for n in names:
        try:
            parse_workload(n)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def bench_workloads_command(args) -> int:
    """``treeattn bench workloads``."""
    from tqdm import tqdm

    from treeattn.bench.workloads import bench_workloads, parse_workload, plot_workloads

    name = "treeattn bench workloads"
    if not torch.cuda.is_available() or (args.device and not args.device.startswith("cuda")):
        return error(name, ValueError("needs a CUDA GPU"))
    try:
        prepare_output(args.out, "--out")
        prepare_output(args.plot, "--plot")
        workloads = [parse_workload(w, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
                     for w in args.workloads]
        model = load_model(args)
    except (ValueError, FileNotFoundError) as e:
        return error(name, e)
    bar = tqdm(total=len(workloads) * len(args.strategies), unit="run")

    def progress(msg):
        bar.set_description(msg)
        if " / " in msg and not msg.endswith("transformers"):
            bar.update(1)

    result = bench_workloads(model, workloads, tuple(args.strategies), kv_tokens=args.kv_tokens,
                             page_size=args.page_size, transformers_baseline=not args.no_transformers,
                             progress=progress)
    bar.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot_workloads(result, args.plot)
    print(f"{'workload':14s} {'strategy':10s} {'wall':>7s} {'GPU':>7s} {'floor':>7s} {'wall/GPU':>8s} "
          f"{'GPU/floor':>9s} {'syncs':>5s}")
    for wname, rows in result["workloads"].items():
        for s in args.strategies:
            r = rows[s]
            print(f"{wname:14s} {s:10s} {r['wall_ms']:7.2f} {r['gpu_ms']:7.2f} {r['floor_ms']:7.2f} "
                  f"{r['wall_over_gpu']:8.2f} {r['gpu_over_floor']:9.2f} {r['syncs']:5d}")
        if "transformers" in rows:
            print(f"{wname:14s} {'hf':10s} {rows['transformers']['ms_per_step']:7.2f}   "
                  f"auto {rows.get('auto_over_transformers', float('nan')):.1f}x faster")
        if "auto_over_sequence" in rows:
            print(f"{'':14s} auto / sequence speedup {rows['auto_over_sequence']:.2f}x")
    for s, e in result["engines"].items():
        print(f"engine {s}: compile {e['compile_s']:.1f} s, first run {e['first_run_s']:.2f} s, "
              f"second {e['second_run_s']:.2f} s")
    return 0
