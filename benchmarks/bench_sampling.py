"""One decode step's sampling: the torch path of :class:`treeattn.engine.sampling.Sampler` against the
fused kernel (:func:`treeattn.launchers.gumbel_argmax`) on Llama-3's vocabulary.

For each row count, random logits ``[rows, vocab]`` and temperature 0.8, two tasks: ``sample``
(the tokens) and ``sample+logprobs`` (the tokens and their log-probabilities). The torch path is
the reference's ops on the GPU (``logits.float() * (1 / T)``, the Gumbel noise, an add and an
arg-max; ``log_softmax`` and a gather); the fused path is what ``Sampler.sample`` /
``Sampler.draw`` + ``Sampler.logprobs`` run on CUDA. GPU time: a CUDA graph of the call replayed
by ``triton.testing.do_bench`` (CUDA events, warm-up, L2 flushed before each run, median); host
time: an eager call's Python time while the GPU sleeps. Tokens must be equal and log-probabilities within 1e-5 (relative) on a few steps.

On one H200 (under a minute)::

    python benchmarks/bench_sampling.py --out benchmarks/results/sampling_h200.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

try:
    import treeattn  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from treeattn.bench.timing import graph_us, host_us, provenance
from treeattn.engine.sampling import Sampler, gumbel_noise, inverse_temperature

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="4,16,64,128,256", help="comma-separated row counts")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


def torch_path(sampler: Sampler, logits, streams, step, logprobs: bool):
    x = logits.float() * inverse_temperature(sampler.temperature)
    tokens = (x + gumbel_noise(streams, sampler._counter(step), x.shape[-1])).argmax(-1)
    if not logprobs:
        return tokens, None
    return tokens, torch.log_softmax(x, -1).gather(-1, tokens[:, None]).squeeze(-1)


def fused_path(sampler: Sampler, logits, streams, step, logprobs: bool):
    if not logprobs:
        return sampler.sample(logits, streams=streams, step=step), None
    tokens, norm = sampler.draw(logits, streams=streams, step=step)
    return tokens, sampler.logprobs(logits, tokens, norm=norm)


def main(argv=None) -> dict:
    args = parse_args(argv)
    sampler = Sampler(args.temperature, seed=1)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"{'rows':>5} {'task':>16} {'torch us':>9} {'fused us':>9} {'speedup':>8} {'host us':>8} "
          f"{'equal':>6} {'lp rel err':>10}")
    for rows in rows_list:
        gen = torch.Generator(device="cuda").manual_seed(rows)
        logits = (torch.randn(rows, args.vocab, device="cuda", generator=gen) * 3).to(DTYPES[args.dtype])
        streams = torch.randint(0, 2**32, (rows,), device="cuda", generator=gen)
        for logprobs in (False, True):
            equal, err = True, 0.0
            for step in range(5):
                t_ref, lp_ref = torch_path(sampler, logits, streams, step, logprobs)
                t, lp = fused_path(sampler, logits, streams, step, logprobs)
                equal &= torch.equal(t, t_ref)
                if logprobs:
                    err = max(err, ((lp - lp_ref).abs() / lp_ref.abs().clamp_min(1e-30)).max().item())
            calls = [functools.partial(path, sampler, logits, streams, 3, logprobs) for path in (torch_path, fused_path)]
            us_ref, us = (graph_us(call) for call in calls)
            host = host_us(calls[1])
            task = "sample+logprobs" if logprobs else "sample"
            results.append(dict(rows=rows, task=task, torch_us=us_ref, fused_us=us,
                                fused_host_us=host, tokens_equal=bool(equal), logprob_max_rel_err=err))
            print(f"{rows:>5} {task:>16} {us_ref:>9.1f} {us:>9.1f} {us_ref / us:>7.1f}x {host:>8.1f} "
                  f"{str(bool(equal)):>6} {err:>10.2e}")
    out = {"provenance": provenance(), "vocab": args.vocab, "dtype": args.dtype,
           "temperature": args.temperature, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if not all(r["tokens_equal"] and r["logprob_max_rel_err"] < 1e-5 for r in results):
        print("MISMATCH: the fused tokens or log-probabilities differ from the torch path")
        sys.exit(1)
    return out


if __name__ == "__main__":
    main()
