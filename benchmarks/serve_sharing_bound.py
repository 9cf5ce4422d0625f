"""Upper bound of what prefix-aware decode attention can save on PAT's conversation trace, and the
prefill each request costs, computed from the trace alone (no model runs).

Prompts are built as the serving sweep sends them (:func:`treeattn.serve.bench.build_requests`:
one block of ``--block-tokens`` random ids per hash id after PAT's three-level system prompt,
outputs capped at ``--max-output-len``, prompt plus output cut to ``--max-model-len``). A decode
batch of ``B`` requests is modelled as ``B`` consecutive arrivals (every window of them), each at a
random point of its decode (``k`` of its outputs written, uniform in ``[1, output - 1]``):

* ``visible``: the sum of the requests' contexts (prompt + ``k``), what attention without prefix
  sharing reads per layer and step;
* ``unique``: the tokens of the batch's prefix tree, what attention that reads every shared token
  once reads: at token granularity (``token``) and at the server's prefix-cache granularity
  (``--prefix-block``: the decode tree that ``treeattn serve`` builds, ``block``);
* ``io_saving = 1 - unique / visible`` (sums over the windows) and ``step_bound``, the decode step's
  time reduction if a step only streamed the weights and the KV it reads (memory-bound: a step
  reads ``weights + tokens x kv_bytes``; Llama-3-8B in bf16 by default). With prefill stalling the
  decode for a share ``rho`` of the time, TPOT is ``step / (1 - rho)`` for both strategies, so
  ``step_bound`` also bounds the TPOT reduction.

Prefill: the requests in arrival order against an unbounded prefix cache of ``--prefix-block``
blocks (the server's evicts, so its hits are fewer) give the prefilled tokens per request and, at
``--prefill-ms-per-ktok`` (0.35 s per 8K-token prefill on the H200, benchmarks/NOTES.md), the
share ``rho = rate x prefill time`` of the GPU that prefill takes at the sweep's rates.

Two request sets: the first ``--sweep-requests`` records (what bench_serve_sweep replays: 25 s of
arrivals at 3 req/s) and the first ``--requests``. Usage::

    PYTHONPATH=src python benchmarks/serve_sharing_bound.py [--requests 1000] \\
        [--out benchmarks/results/serve_sharing_bound.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from treeattn.engine.config import ModelConfig
from treeattn.serve.bench import PAT_SYSTEM_PROMPT, build_requests, load_trace
from treeattn.workloads import find_shared

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help="default: shared/workloads/pat/conversation_trace.jsonl")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--sweep-requests", type=int, default=75)
    p.add_argument("--batches", default="4,8,16,32,64")
    p.add_argument("--model", default="llama3-8b", help="preset shape (vocabulary, weights, KV bytes)")
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--prefix-block", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--prefill-ms-per-ktok", type=float, default=350 / 8)
    p.add_argument("--rates", default="0.5,1,2,3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_sharing_bound.json"))
    return p.parse_args(argv)


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def decode_batches(prompts: list, outputs: np.ndarray, batch: int, block: int,
                   rng: np.random.Generator) -> dict:
    """Visible and unique KV tokens of every window of ``batch`` consecutive requests."""
    keys = [p.astype(">u4").tobytes() for p in prompts]     # bytes order = token order
    pairs: dict = {}
    rows = []
    for start in range(len(prompts) - batch + 1):
        idx = sorted(range(start, start + batch), key=keys.__getitem__)
        shared = [pairs.setdefault((i, j), lcp(prompts[i], prompts[j])) for i, j in zip(idx, idx[1:])]
        k = rng.integers(1, np.maximum(2, outputs[start: start + batch]))
        own = sum(prompts[i].size for i in idx) + int(k.sum())
        rows.append((own, own - sum(shared), own - sum(s // block * block for s in shared)))
    if not rows:
        return {}
    visible, token, blocks = np.asarray(rows, dtype=np.float64).T
    return {"windows": len(rows), "visible": visible, "token": token, "block": blocks}


def summarize_batch(r: dict, weight_bytes: float, kv_bytes: float) -> dict:
    per_window = 1 - r["block"] / r["visible"]
    step_seq = weight_bytes + r["visible"].mean() * kv_bytes
    step_blk = weight_bytes + r["block"].mean() * kv_bytes
    return {"windows": r["windows"], "mean_visible_tokens": r["visible"].mean(),
            "mean_unique_tokens_token": r["token"].mean(), "mean_unique_tokens_block": r["block"].mean(),
            "io_saving_token": 1 - r["token"].sum() / r["visible"].sum(),
            "io_saving_block": 1 - r["block"].sum() / r["visible"].sum(),
            "io_saving_block_p10_p50_p90": np.percentile(per_window, [10, 50, 90]).tolist(),
            "kv_share_of_step_bytes": 1 - weight_bytes / step_seq, "step_bound": 1 - step_blk / step_seq}


def prefill_tokens(prompts: list, block: int) -> np.ndarray:
    """Tokens each request prefills in arrival order under an unbounded cache of ``block``-token
    blocks (matches stop one token short of the prompt, as :class:`treeattn.serve.PrefixCache`)."""
    nodes: dict = {}
    out = []
    for p in prompts:
        node, hit, matching = -1, 0, True
        for at in range(0, p.size - block + 1, block):
            key = (node, p[at: at + block].tobytes())
            if matching and key in nodes and at + block < p.size:
                hit += block
            else:
                matching = False
                nodes.setdefault(key, len(nodes))
            node = nodes[key]
        out.append(p.size - hit)
    return np.asarray(out)


def analyse(prompts: list, outputs: np.ndarray, args, cfg: ModelConfig) -> dict:
    kv_bytes = 2 * cfg.num_layers * cfg.kv_size * args.dtype_bytes
    weight_bytes = cfg.num_parameters() * args.dtype_bytes
    rng = np.random.default_rng(args.seed)
    decode = {}
    for b in (int(x) for x in args.batches.split(",")):
        r = decode_batches(prompts, outputs, b, args.prefix_block, rng)
        if r:
            decode[str(b)] = summarize_batch(r, weight_bytes, kv_bytes)
    pre = prefill_tokens(prompts, args.prefix_block)
    plen = np.asarray([p.size for p in prompts])
    prefill_s = pre.mean() * args.prefill_ms_per_ktok / 1e6
    return {"requests": len(prompts), "decode": decode,
            "prefill": {"mean_prompt_tokens": plen.mean(), "mean_prefill_tokens": pre.mean(),
                        "p50_prefill_tokens": float(np.median(pre)), "hit_rate": 1 - pre.sum() / plen.sum(),
                        "mean_output_tokens": outputs.mean(), "mean_prefill_s": prefill_s,
                        "prefill_share_by_rate": {r: float(r) * prefill_s for r in args.rates.split(",")}}}


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = ModelConfig.preset(args.model)
    path = Path(args.trace) if args.trace else find_shared() / "workloads" / "pat" / "conversation_trace.jsonl"
    trace = load_trace(path, args.requests)
    reqs = build_requests(trace, vocab_size=cfg.vocab_size, arrivals=np.zeros(len(trace)),
                          block_tokens=args.block_tokens, seed=args.seed, max_output_len=args.max_output_len,
                          max_model_len=args.max_model_len, system_prompt=PAT_SYSTEM_PROMPT)
    prompts = [np.asarray(r.prompt, dtype=np.int64) for r in reqs]
    outputs = np.asarray([r.max_tokens for r in reqs])
    del reqs
    res = {"trace": str(path), "args": vars(args), "system_prompt": PAT_SYSTEM_PROMPT,
           "sets": {f"first_{n}": analyse(prompts[:n], outputs[:n], args, cfg)
                    for n in sorted({min(args.sweep_requests, len(prompts)), len(prompts)})}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=float))
    for name, s in res["sets"].items():
        p = s["prefill"]
        print(f"\n{name}: prompt {p['mean_prompt_tokens']:.0f} tokens, prefill {p['mean_prefill_tokens']:.0f} "
              f"(hit rate {p['hit_rate']:.1%}), output {p['mean_output_tokens']:.0f}; prefill share at "
              + ", ".join(f"{r} req/s {v:.0%}" for r, v in p["prefill_share_by_rate"].items()))
        print(f"{'B':>4} {'visible':>9} {'unique(tok)':>12} {'unique(blk)':>12} {'saving tok':>11} "
              f"{'saving blk':>11} {'blk p10-p90':>12} {'KV share':>9} {'step bound':>11}")
        for b, d in s["decode"].items():
            lo, _, hi = d["io_saving_block_p10_p50_p90"]
            print(f"{b:>4} {d['mean_visible_tokens']:>9.0f} {d['mean_unique_tokens_token']:>12.0f} "
                  f"{d['mean_unique_tokens_block']:>12.0f} {d['io_saving_token']:>11.1%} "
                  f"{d['io_saving_block']:>11.1%} {lo:>5.1%}-{hi:<5.1%} {d['kv_share_of_step_bytes']:>9.1%} "
                  f"{d['step_bound']:>11.1%}")
    print(f"\nwrote {out}")
    return res


if __name__ == "__main__":
    main()
