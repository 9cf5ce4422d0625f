"""GPU check of tensor parallelism x the sequence-sharded KV (``treeattn run --tp T --sp S``).

Under torchrun with ``T * S`` ranks, the engine decodes a greedy sampling workload that branches
and a beam search on random weights split over the grid (:mod:`treeattn.engine.parallel`); rank
0 then decodes the same on one device with the whole model. With float32 weights the tokens must
be equal and the leaves' last logits within ``--tol`` (exit status 1 otherwise); with 16-bit
weights the numbers are reported only (the reductions' order differs). Also reported: each rank's
weight and KV-pool bytes and the decode ms a step of both runs. Writes JSON with device and
versions.

2 or 4 GPUs (the check: the ``small`` preset in float32, about a minute)::

    torchrun --nproc-per-node 2 benchmarks/check_tp.py --tp 2 --out /tmp/check_tp2.json
    torchrun --nproc-per-node 4 benchmarks/check_tp.py --tp 2 --sp 2 --out /tmp/check_tp2_sp2.json

Llama-3-8B's shape in bf16 (report only)::

    torchrun --nproc-per-node 4 benchmarks/check_tp.py --tp 4 --preset llama3-8b --dtype bfloat16 \\
        --std 0.02 --prompt-len 1000 --out /tmp/check_tp4_8b.json

CPU logic check (gloo)::

    torchrun --nproc-per-node 2 benchmarks/check_tp.py --tp 2 --device cpu
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

try:
    import treeattn  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from treeattn.engine import (BeamSearchController, Sampler, SamplingController, TreeEngine, TreeModel,
                             periodic_branching)
from treeattn.engine.parallel import init_grid
from treeattn.engine.sharded import ShardedTreeEngine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    ap.add_argument("--sp", type=int, default=1, help="ranks sharding the KV along the sequence")
    ap.add_argument("--preset", default="small", help="random-weights preset (default: small)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    ap.add_argument("--std", type=float, default=0.2, help="std of the random weights")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--prompt-len", type=int, default=200, help="tokens of each prompt")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps of each workload")
    ap.add_argument("--tol", type=float, default=1e-3, help="largest logit difference (float32)")
    ap.add_argument("--out", default=None, help="write the result here (JSON)")
    return ap.parse_args(argv)


def controllers(args, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(2)]
    return {
        "sample": SamplingController(prompts, n=2, sampler=Sampler(greedy=True), max_new_tokens=args.new_tokens,
                                     callbacks=periodic_branching(8, 2, 16)),
        "beam": BeamSearchController(prompts[0], num_beams=4, max_new_tokens=args.new_tokens),
    }


def drive(engine, args) -> dict:
    """Tokens, the sampling leaves' last logits and decode ms a step of each workload (its second
    run: the first compiles the kernels it needs)."""
    out = {}
    for name in ("sample", "beam"):
        engine.run(controllers(args, engine.model.config.vocab_size)[name])
        engine.reset()
        engine.stats.clear()
        t0 = time.perf_counter()
        result = engine.run(controllers(args, engine.model.config.vocab_size)[name])
        wall = time.perf_counter() - t0
        decode = [s.forward_ms + s.plan_ms + s.kv_ms for s in engine.stats if s.kind == "decode"]
        out[name] = {"tokens": result["sequences"] if name == "beam" else [leaf["tokens"] for leaf in result["leaves"]],
                     "wall_s": wall, "decode_ms": sum(decode) / max(1, len(decode))}
        if name == "sample":
            out[name]["logits"] = torch.stack([leaf["logits"].float().cpu() for leaf in result["leaves"]])
        engine.reset()
        engine.stats.clear()
    return out


def nbytes(engine) -> dict:
    w = engine.model.weights
    tensors = {id(t): t for layer in w.layers for t in vars(layer).values() if t is not None}
    tensors.update({id(t): t for t in (w.embed, w.lm_head, w.norm)})
    return {"weights": sum(t.numel() * t.element_size() for t in tensors.values()),
            "kv_pool": engine.pool.k_cache(0).untyped_storage().nbytes()}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    grid = init_grid(args.tp, args.sp, args.device)
    dtype = DTYPES[args.dtype]
    kw = dict(page_size=16, kv_tokens=4 * (args.prompt_len + 16 * args.new_tokens), synchronize=True,
              precompile=False)

    def engine(tp=None, sp_group=None):
        model = TreeModel.random(args.preset, device=args.device, dtype=dtype, seed=0, std=args.std, tp=tp)
        if sp_group is not None:
            return ShardedTreeEngine(model, group=sp_group, **kw)
        return TreeEngine(model, **kw)

    eng = engine(grid.tp, grid.sp_group)
    split = drive(eng, args)
    sizes = nbytes(eng)
    gathered = [None] * grid.world if grid.world > 1 else [sizes]
    if grid.world > 1:
        dist.all_gather_object(gathered, sizes)
    del eng
    if dist.is_initialized():
        dist.destroy_process_group()
    if grid.rank != 0:
        return 0
    if args.device == "cuda":
        torch.cuda.empty_cache()
    one = engine()
    ref = drive(one, args)
    ref_sizes = nbytes(one)
    report = {"tp": args.tp, "sp": args.sp, "preset": args.preset, "dtype": args.dtype, "std": args.std,
              "ranks": gathered, "single": ref_sizes, "workloads": {}}
    ok = True
    for name in ref:
        same = [a == b for a, b in zip(split[name]["tokens"], ref[name]["tokens"])]
        row = {"sequences": len(same), "equal_sequences": sum(same),
               "decode_ms": split[name]["decode_ms"], "single_decode_ms": ref[name]["decode_ms"]}
        if name == "sample" and len(split[name]["tokens"]) == len(ref[name]["tokens"]):
            row["max_logit_diff"] = (split[name]["logits"] - ref[name]["logits"]).abs().max().item()
        report["workloads"][name] = row
        exact = dtype == torch.float32
        if exact and (not all(same) or len(same) != len(ref[name]["tokens"])
                      or row.get("max_logit_diff", 0.0) > args.tol):
            ok = False
        diff = f", max logit diff {row['max_logit_diff']:.2e}" if "max_logit_diff" in row else ""
        print(f"{name}: {row['equal_sequences']}/{len(ref[name]['tokens'])} sequences equal{diff}; decode "
              f"{row['decode_ms']:.2f} ms/step on the grid, {row['single_decode_ms']:.2f} on one device")
    per_rank = [g["weights"] / ref_sizes["weights"] for g in gathered]
    print(f"weights per rank / whole model: {', '.join(f'{x:.3f}' for x in per_rank)}; KV pool per rank / one "
          f"device's: {gathered[0]['kv_pool'] / ref_sizes['kv_pool']:.3f}")
    report["ok"] = ok
    if args.device == "cuda":
        from treeattn.bench.timing import provenance

        report.update(provenance())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
