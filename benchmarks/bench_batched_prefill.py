"""Batched prefill: ``R`` prompts behind a cached system prompt, prefilled one forward pass each
(as the server did for the requests it admitted together) against one
:meth:`~treeattn.engine.TreeEngine.batched_prefill` pass. Reports the wall ms of both (median of
``--repeats``, device synchronised) and the largest difference of the last-token logits. Writes
JSON with device and versions.

H200, Llama-3-8B's shape in bf16 (the ``agents`` traffic: a 2123-token system prompt, ~300-token
user messages, 1 to 16 admitted together)::

    python benchmarks/bench_batched_prefill.py --preset llama3-8b --dtype bfloat16 --system-len 2123 \\
        --prompt-len 300 --batches 1,2,4,8,16 --out /tmp/batched_prefill_h200.json

CPU logic check: ``python benchmarks/bench_batched_prefill.py --device cpu --preset tiny``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time

import numpy as np
import torch

try:
    import treeattn  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from treeattn.bench.timing import provenance
from treeattn.engine import TreeEngine, TreeModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b", help="random-weights preset (default: llama3-8b)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--system-len", type=int, default=2123, help="tokens of the cached system prompt")
    ap.add_argument("--prompt-len", type=int, default=300, help="new tokens of each prompt")
    ap.add_argument("--batches", default="1,2,4,8,16", help="prompts prefilled together, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the result here (JSON)")
    return ap.parse_args(argv)


def _run(eng, system, prompts, batched: bool) -> tuple[float, torch.Tensor]:
    """Wall ms of prefilling ``prompts`` below ``system`` (separately or batched) and their logits;
    the prompts' nodes are pruned afterwards."""
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with eng.batched_prefill() if batched else contextlib.nullcontext():
        nodes = [eng.prefill_chain(system, [p])[-1] for p in prompts]
    logits = eng.logits_for(nodes)
    sync()
    ms = (time.perf_counter() - t0) * 1e3
    logits = logits.clone()
    for n in nodes:
        eng.tree.prune(n, cascade=False)
    return ms, logits


def main(argv=None) -> int:
    args = parse_args(argv)
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    model = TreeModel.random(args.preset, device=dev, dtype=dtype)
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    eng = TreeEngine(model, kv_tokens=args.system_len + max(batches) * args.prompt_len + 4096,
                     precompile=False)
    system = eng.prefill_chain(None, [rng.integers(0, vocab, args.system_len)])[-1]
    rows = []
    for r in batches:
        prompts = [rng.integers(0, vocab, args.prompt_len) for _ in range(r)]
        times, diff = {False: [], True: []}, 0.0
        for rep in range(args.repeats + 1):           # (the first round warms up)
            logits = {}
            for batched in (False, True):
                ms, logits[batched] = _run(eng, system, prompts, batched)
                if rep:
                    times[batched].append(ms)
            diff = max(diff, (logits[True] - logits[False]).abs().max().item())
        row = {"prompts": r, "separate_ms": float(np.median(times[False])),
               "batched_ms": float(np.median(times[True])), "max_logit_diff": diff}
        rows.append(row)
        print(f"{r:3d} prompts: separate {row['separate_ms']:8.2f} ms, batched {row['batched_ms']:8.2f} ms, "
              f"max logit diff {diff:.3g}")
    if args.out:
        # (provenance names the CUDA device; a CPU run records its processor)
        info = provenance() if dev.type == "cuda" else {"device": platform.processor(), "torch": torch.__version__,
                                                        "python": platform.python_version()}
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "env": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
