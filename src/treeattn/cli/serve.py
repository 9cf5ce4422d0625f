"""Command line of the server: ``treeattn serve`` and ``treeattn bench serve``.

The main CLI registers them with :func:`add_serve_parser` (top-level sub-parsers) and
:func:`add_bench_serve_parser` (the ``bench`` sub-command's sub-parsers); handlers return an exit
code.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from treeattn import STRATEGIES
from treeattn.bench.serve import TRAFFICS
from treeattn.cli.args import (add_log_level, existing_file, nonnegative_int, positive_float, positive_int,
                               prepare_output)
from treeattn.cli.engine import add_grid_args, add_model_args, init_ranks, load_model

__all__ = ["add_serve_parser", "add_bench_serve_parser", "serve_command", "bench_serve_command", "int_range_arg",
           "traffic_options"]

log = logging.getLogger(__name__)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``serve``: an OpenAI-compatible completions server with continuous batching."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, prefix cache)",
                              description="Serve a model through an OpenAI-compatible completions API with "
                                          "continuous batching and a prefix cache.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (default: 8000)")
    p.add_argument("--max-queue", type=positive_int, default=256, help="waiting requests before 429")
    p.add_argument("--max-batch", type=positive_int, default=64, help="sequences decoded per step")
    p.add_argument("--strategy", default="auto", choices=STRATEGIES,
                   help="attention strategy of every decode step (default: auto)")
    p.add_argument("--prefix-block", type=positive_int, default=64,
                   help="prefix-cache granularity in tokens (a multiple of --page-size; 512 for PAT's trace)")
    p.add_argument("--prefill-chunk", type=nonnegative_int, default=2048, metavar="TOKENS",
                   help="while requests are decoding, prefill at most this many prompt tokens between two "
                        "decode steps (rounded down to --prefix-block, at least one block); longer prompts "
                        "are prefilled in chunks so running requests keep getting tokens (0: whole prompts "
                        "at once; default: 2048)")
    p.add_argument("--no-overlap", action="store_true",
                   help="read each step's sampled tokens before enqueueing the next decode step (the host's "
                        "per-step work then leaves the GPU idle); for measuring what the overlap gains")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + max_tokens (default: the model's and the KV pool's limit)")
    p.add_argument("--served-model-name", default=None, help="default: the model directory or preset name")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $TREEATTN_API_KEY; none: open)")
    p.add_argument("--shutdown-grace", type=positive_float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, seconds running requests get to finish before they are cancelled")
    p.add_argument("--chat-template", metavar="FILE", type=existing_file, default=None,
                   help="Jinja chat template (default: the model directory's tokenizer_config.json)")
    add_grid_args(p)
    p.set_defaults(func=serve_command)
    return p


def add_bench_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``serve`` (``treeattn bench serve``): request traffic sent to a running server."""
    p = subparsers.add_parser("serve", help="send request traffic to a running server: TTFT, TPOT, throughput",
                              description="Send one traffic (PAT's conversation trace, n-sampling requests or "
                                          "agents behind a shared system prompt) at a Poisson request rate to a "
                                          "running treeattn or OpenAI-compatible server; TTFT, TPOT (per choice "
                                          "stream), latency and throughput.")
    p.add_argument("--traffic", default="pat-trace", choices=TRAFFICS,
                   help="pat-trace: PAT's conversation trace (default); sampling: n choices (temperature 1) "
                        "of a 2-4K-token prompt of its own; agents: PAT's three-level system prompt and a "
                        "short user message")
    p.add_argument("--rate", type=float, required=True,
                   help="requests per second, Poisson arrivals (pat-trace: <= 0 replays the trace's timestamps)")
    p.add_argument("--duration", type=positive_float, default=None,
                   help="send requests arriving in this many seconds (sampling, agents: this or --max-requests)")
    p.add_argument("--max-requests", type=positive_int, default=None,
                   help="send at most this many requests (pat-trace: trace records)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: http://127.0.0.1:8000)")
    g = p.add_argument_group("pat-trace")
    g.add_argument("--trace", type=existing_file, default=None,
                   help="JSON-lines trace (default: shared/workloads/pat/conversation_trace.jsonl)")
    g.add_argument("--block-tokens", type=positive_int, default=512, help="tokens per hash id (default: 512)")
    g.add_argument("--max-input-len", type=positive_int, default=None, help="cap prompts (keeps shared blocks)")
    g.add_argument("--max-output-len", type=positive_int, default=None, help="cap output lengths")
    g.add_argument("--system-prompt", default="pat", choices=("pat", "none"),
                   help="prepend PAT's three-level system prompt (46/348/2123 tokens) to every prompt "
                        "(agents: always)")
    g = p.add_argument_group("sampling and agents (lengths MIN-MAX or one number, drawn per request)")
    g.add_argument("--n", type=int_range_arg, default=None, metavar="MIN-MAX",
                   help="sampling: choices per request (default: 8-16)")
    g.add_argument("--prompt-len", type=int_range_arg, default=None, metavar="MIN-MAX",
                   help="sampling: prompt tokens (default: 2048-4096)")
    g.add_argument("--temperature", type=positive_float, default=None,
                   help="sampling: temperature (default: 1)")
    g.add_argument("--user-len", type=int_range_arg, default=None, metavar="MIN-MAX",
                   help="agents: user-message tokens after the system prompt (default: 50-300)")
    g.add_argument("--output-len", type=int_range_arg, default=None, metavar="MIN-MAX",
                   help="output tokens per choice (default: sampling 128-512, agents 100-400)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals and the prompts' token ids")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--json", metavar="OUT", default=None,
                   help="write the summary here, with this host's device, versions and commit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_log_level(p)
    p.set_defaults(func=bench_serve_command)
    return p


def int_range_arg(text: str) -> tuple[int, int]:
    """``MIN-MAX`` (or one number) of positive integers, MIN <= MAX."""
    parts = text.split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN-MAX positive integers with MIN <= MAX (or one number), "
                                         f"got {text!r}")
    return lo, hi


def _port(text: str) -> int:
    port = nonnegative_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [0, 65535], got {text!r}")
    return port


def serve_command(args) -> int:
    """``treeattn serve``; with ``--tp`` / ``--sp`` under torchrun every rank runs it, rank 0
    serving HTTP and the others following its scheduler (:mod:`treeattn.serve.parallel`)."""
    import torch.distributed as dist

    if args.prefix_block % args.page_size:
        log.warning("--prefix-block %d is not a multiple of --page-size %d: cached blocks will "
                    "copy partly filled pages", args.prefix_block, args.page_size)
    grid = init_ranks(args, "serve")
    try:
        return _serve(args, grid)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(args, grid) -> int:
    from treeattn.serve.scheduler import Scheduler
    from treeattn.serve.server import run_server

    model = load_model(args, tp=grid.tp)
    # graph_tokens: every batch's CUDA graphs at creation (a capture mid-serving stalls every request)
    kw = dict(strategy=args.strategy, page_size=args.page_size, kv_tokens=args.kv_tokens, window=args.window,
              cuda_graphs=False if args.no_cuda_graphs else None, keep_reserved=True,
              compile_workers=args.compile_workers, graph_tokens=args.max_batch)
    if grid.sp_group is not None:
        from treeattn.engine.sharded import ShardedTreeEngine
        engine = ShardedTreeEngine(model, group=grid.sp_group, **kw)
    else:
        from treeattn.engine import TreeEngine
        engine = TreeEngine(model, **kw)
    limit = min(model.config.max_position_embeddings, args.kv_tokens)
    max_len = min(args.max_model_len, limit) if args.max_model_len else limit
    name = args.served_model_name or args.model or args.random_weights
    engine.precompile_kernels()   # (a no-op where the engine compiled at creation, as on a GPU)
    if engine.compiled_launches:
        log.info("compiled the attention kernels in %.1f s", engine.compile_s)
    options = dict(max_queue=args.max_queue, max_batch=args.max_batch, block_tokens=args.prefix_block,
                   prefill_chunk=args.prefill_chunk, overlap=not args.no_overlap)
    if grid.world > 1:
        from treeattn.serve.parallel import ReplicatedScheduler, control_group
        scheduler = ReplicatedScheduler(engine, group=control_group(), agree_pages=grid.sp_group is not None,
                                        **options)
        if grid.rank != 0:
            return scheduler.follow(grace=args.shutdown_grace)
    else:
        scheduler = Scheduler(engine, **options)
    log.info("serving %s on http://%s:%d (max_model_len %d, %d KV pages%s)", name, args.host, args.port,
             max_len, engine.pool.num_pages, f" per rank, --tp {args.tp} --sp {args.sp}" if grid.world > 1 else "")
    chat = _chat_template(args, model)
    api_key = args.api_key or os.environ.get("TREEATTN_API_KEY") or None
    log.info("chat template: %s; API key %s", "yes" if chat is not None else "none (no /v1/chat/completions)",
             "required" if api_key else "not required")
    run_server(scheduler, host=args.host, port=args.port, model_name=name, tokenizer=model.tokenizer,
               max_model_len=max_len, log_level=getattr(args, "log_level", "info"), chat_template=chat,
               api_key=api_key, shutdown_grace=args.shutdown_grace)
    return 1 if getattr(scheduler, "error", None) is not None else 0


def _chat_template(args, model):
    """``--chat-template`` or the model directory's template (None without one or a tokenizer)."""
    from treeattn.serve.chat import ChatTemplate

    if model.tokenizer is None:
        return None
    if args.chat_template:
        return ChatTemplate(Path(args.chat_template).read_text())
    return ChatTemplate.from_pretrained(args.model) if args.model else None


def _fmt(s: dict) -> str:
    def ms(d):
        return "n/a" if d["mean_ms"] is None else f"mean {d['mean_ms']:9.1f} ms   P99 {d['p99_ms']:9.1f} ms"
    return "\n".join([
        (f"requests   {s['completed']}/{s['requests']} completed, {s['failed']} failed "
         f"({s['rejected_429']} rejected with 429) in {s['duration_s']:.1f} s"),
        (f"throughput {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s "
         f"({s['choices']} choice streams, {s['output_tokens']} tokens)"),
        f"TTFT       {ms(s['ttft'])}", f"TPOT       {ms(s['tpot'])}", f"latency    {ms(s['latency'])}",
    ] + _fmt_server(s.get("server") or {}) + [f"error: {e}" for e in s["errors"]])


def _fmt_server(d: dict) -> list:
    """The server's own numbers over the run, where it reported them."""
    out = []
    if "mean_batch" in d:
        out.append(f"server     mean batch {d['mean_batch']:.1f} sequences, {d.get('preemptions', 0)} preemptions")
    if "kv_io_saving" in d:
        saved = d.get("kv_read_saved_bytes")
        out.append(f"KV reads   {d['kv_io_saving']:.1%} shared (1 - unique / visible tokens)"
                   + (f", {saved / 1e9:.2f} GB not read" if saved is not None else ""))
    if "prefix_hit_rate" in d:
        out.append(f"prefix     {d['prefix_hit_rate']:.1%} of prompt tokens found in the cache")
    if "decode_step_wall" in d:
        out.append(f"step wall  {_fmt_step(d['decode_step_wall'])}  (decode steps)")
        ratio = d.get("decode_wall_over_gpu")
        out.append(f"step GPU   {_fmt_step(d['decode_step_gpu'])}"
                   + (f"  wall / GPU {ratio:.2f}" if ratio is not None else "  (no GPU time on this device)"))
    return out


def _fmt_step(s: dict) -> str:
    if s["mean_ms"] is None:
        return "n/a"
    return f"mean {s['mean_ms']:.2f} ms   p50 {s['p50_ms']:.2f} ms   P99 {s['p99_ms']:.2f} ms"


def traffic_options(args) -> dict:
    """The ``--n`` ... ``--output-len`` options given, as keyword arguments of the traffic's builder."""
    names = ("n", "prompt_len", "temperature", "user_len", "output_len")
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def bench_serve_command(args) -> int:
    from treeattn.bench.serve import PAT_SYSTEM_PROMPT, bench_serve, check_traffic, provenance
    from treeattn.tree import find_shared

    prepare_output(args.json, "--json")
    logging.getLogger("httpx").setLevel(logging.WARNING)    # a line per request would bury the summary
    trace = args.trace
    if args.traffic == "pat-trace" and trace is None:
        trace = find_shared() / "workloads" / "pat" / "conversation_trace.jsonl"
    system = PAT_SYSTEM_PROMPT if args.system_prompt == "pat" else None
    options = traffic_options(args)
    # bad combinations fail here, before the server is asked anything
    check_traffic(args.traffic, rate=args.rate, duration=args.duration, max_requests=args.max_requests,
                  trace_path=trace, max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                  system_prompt=system, options=options)
    summary = bench_serve(trace, url=args.url, rate=args.rate, traffic=args.traffic, duration=args.duration,
                          max_requests=args.max_requests, block_tokens=args.block_tokens, seed=args.seed,
                          max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                          timeout=args.timeout, progress=not args.no_progress, system_prompt=system,
                          options=options)
    print(_fmt(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**provenance(), **summary}, f, indent=2)
    return 0 if summary["failed"] == 0 else 1
