"""``treeattn demo``: what prefix-aware tree attention is for, on the CPU in under a minute.

A small random-weight Llama replays a Tree-of-Thoughts template once per strategy: many thoughts
decode in parallel over one shared prompt. The demo prints the generated tree, the KV bytes each
strategy's attention read against ``sequence`` (Flash-Decoding, which reads the shared prompt once
per thought), why ``auto`` picked its plan, and a one-line summary. Output fits 80 columns.
"""
from __future__ import annotations

import argparse
import dataclasses
import textwrap

import numpy as np
import torch

from treeattn import STRATEGIES, DecodingTree, TreeAttention
from treeattn.cli.args import add_log_level, device_arg, positive_float, strategies_arg
from treeattn.engine.config import PRESETS
from treeattn.engine.engine import TreeEngine
from treeattn.engine.model import TreeModel
from treeattn.engine.workloads import TOT_TEMPLATES, WorkloadSpec, build_workload

__all__ = ["add_demo_parser", "demo_command", "render_tree"]

WIDTH = 80
#: the heads auto's choice is explained for: Llama-3-8B's, in fp16 as on a GPU
LLAMA3_HEADS = {"num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": torch.float16}
#: the demo's model: 2 small layers with Llama-3-8B's attention heads, so the planners face the
#: head shapes they meet in practice while the CPU stays quick
DEMO_MODEL = dataclasses.replace(PRESETS["small"], num_heads=32, num_kv_heads=8, head_dim=128)


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``demo``: a Tree-of-Thoughts decode with a small random model on the CPU."""
    p = subparsers.add_parser("demo", help="what tree attention is for: a Tree-of-Thoughts decode on the CPU",
                              description="Replay a Tree-of-Thoughts template with a small random-weight "
                                          "Llama once per strategy: the generated tree, the KV bytes each "
                                          "strategy read against the sequence baseline, and why auto picked "
                                          "its plan.")
    p.add_argument("--template", default="keyword", choices=TOT_TEMPLATES,
                   help=f"DeFT Tree-of-Thoughts template: {' | '.join(TOT_TEMPLATES)} (default: keyword)")
    p.add_argument("--scale", type=positive_float, default=0.05,
                   help="multiply the template's thought lengths (default: 0.05)")
    p.add_argument("--strategies", type=strategies_arg, default="auto",
                   help="comma-separated strategies to decode with (default: auto); sequence, the "
                        "baseline, always runs too")
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt")
    add_log_level(p)
    p.set_defaults(func=demo_command)
    return p


def render_tree(parents, label, *, width: int = WIDTH, max_children: int = 2) -> list[str]:
    """Lines drawing a tree with box characters, at most ``max_children`` children of a node
    (those with the most nodes below them first; the rest summarised in one line), each line cut
    to ``width`` columns.

    Parameters
    ----------
    parents : int array ``[N]``
        Parent of every node, -1 for the root(s).
    label : callable
        ``label(node) -> str``, the text of a node's line.
    """
    parents = np.asarray(parents)
    children = [np.flatnonzero(parents == n).tolist() for n in range(parents.size)]

    def cut(text: str) -> str:
        return text if len(text) <= width else text[:width - 3] + "..."

    lines = []

    def walk(node: int, lead: str, branch: str) -> None:
        lines.append(cut(lead + branch + label(node)))
        lead += "" if not branch else ("    " if branch.startswith("└") else "│   ")
        kids = sorted(children[node], key=lambda k: -_count(children, k))
        shown = kids[:max_children]
        for i, kid in enumerate(shown):
            last = i == len(shown) - 1 and len(kids) == len(shown)
            walk(kid, lead, "└── " if last else "├── ")
        if len(kids) > len(shown):
            rest = kids[len(shown):]
            below = sum(_count(children, k) for k in rest)
            lines.append(cut(f"{lead}└── ... {len(rest)} more thought{'s' if len(rest) > 1 else ''} here"
                             + (f" ({below} with those below them)" if below > len(rest) else "")))

    for root in np.flatnonzero(parents < 0).tolist():
        walk(root, "", "")
    return lines


def _count(children, node: int) -> int:
    return 1 + sum(_count(children, k) for k in children[node])


def _table(header: tuple, rows: list, *, indent: int = 2) -> list[str]:
    """Left-aligned first column, right-aligned others, two spaces apart."""
    cols = list(zip(header, *rows))
    widths = [max(len(str(c)) for c in col) for col in cols]
    out = []
    for row in [header, *rows]:
        cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out.append(" " * indent + "  ".join(cells))
    return out


def _decode(model, strategy: str, args) -> dict:
    """One replay of the template with ``strategy``: the thoughts and the KV bytes attention read."""
    spec = WorkloadSpec(f"tot-{args.template}", vocab_size=model.config.vocab_size, seed=args.seed,
                        scale=args.scale)
    controller, total = build_workload(spec)
    engine = TreeEngine(model, strategy=strategy, page_size=16, kv_tokens=16384)
    result = engine.run(controller)
    engine.reset()
    engine.pool.check()
    # StepStats.kv_bytes is one layer's KV read of the step (every layer reads the same)
    kv = sum(s.kv_bytes for s in engine.stats) * model.config.num_layers
    return {"controller": controller, "steps": len(engine.stats), "kv_bytes": kv,
            "thoughts": {t["template_node"]: t["tokens"] for t in result["thoughts"]},
            "chosen": sorted({s.strategy for s in engine.stats}),
            "leaked": engine.pool.num_free_pages != engine.pool.num_pages}


def _explain_auto(tree: DecodingTree) -> list[str]:
    """Every strategy planned for the final tree with Llama-3-8B's heads, and why auto chose."""
    plans = {s: TreeAttention().plan(tree, **LLAMA3_HEADS, strategy=s) for s in STRATEGIES}
    base = plans["sequence"].io.kv
    auto = plans.pop("auto")
    estimate = dict(auto.candidates)
    rows = [(s, f"{p.num_items:,}", f"{p.io.kv / 1e6:,.1f}", f"{p.io.kv / base:.2f}x",
             f"{estimate[s] * 1e6:.1f}" if s in estimate else "-")
            for s, p in sorted(plans.items(), key=lambda kv: estimate.get(kv[0], np.inf))]
    pick = auto.strategy
    fewest = min(plans, key=lambda s: plans[s].io.kv)
    lines = ["Every strategy planned for the whole tree in fp16, with the cost model's",
             "estimate of its time on a GPU (auto takes the fastest estimate):", ""]
    lines += _table(("strategy", "work items", "KV MB read", "vs sequence", "est. GPU us"), rows)
    more = plans[pick].io.kv / plans[fewest].io.kv
    if more > 1.005:
        why = (f"auto picked {pick}, the lowest estimated time, though it reads {more:.2f}x the KV bytes "
               f"of {fewest}: time is not bytes alone. The cost model also counts how evenly the work "
               f"items fill the GPU's SMs, the launches and the merge of partial results, so a plan "
               f"that reads a little more can finish first.")
    else:
        why = (f"auto picked {pick}, the lowest estimated time: it reads the fewest KV bytes and, "
               f"among the plans that do, spreads its work items best over the GPU's SMs with the "
               f"fewest launches and merges.")
    return lines + [""] + textwrap.wrap(why, WIDTH)


def demo_command(args) -> int:
    """``treeattn demo``; exit 1 when the strategies disagree or a KV page leaked."""
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)     # the small model's matmuls only lose from splitting across threads
    strategies = list(dict.fromkeys([*args.strategies, "sequence"]))
    model = TreeModel.random(DEMO_MODEL, device=device, dtype=torch.float32, seed=args.seed, std=0.1)
    runs = {s: _decode(model, s, args) for s in strategies}
    first = runs[strategies[0]]
    ctl = first["controller"]
    tree = DecodingTree.from_parents(ctl.parents, ctl.lengths)
    c = model.config
    out = ["treeattn demo: Tree-of-Thoughts decoding with prefix-aware tree attention", "",
           *textwrap.wrap(
               f"A random-weight Llama ({c.num_layers} layers, {c.num_heads} query / {c.num_kv_heads} KV "
               f"heads of {c.head_dim}, float32 on {device}) replays DeFT's '{args.template}' template: "
               f"a {len(ctl.prompt):,}-token prompt, then {tree.num_nodes - 1} thoughts decoded "
               f"level by level, every thought of a level in parallel ({first['steps']} steps, "
               f"sampled with seed {args.seed}). Every thought attends to the whole prompt.", WIDTH), ""]

    def label(node: int) -> str:
        if ctl.parents[node] < 0:
            return f"prompt ({len(ctl.prompt):,} tokens, shared by every thought)"
        toks = first["thoughts"].get(node, [])
        return f"t{node} ({len(toks)}): " + " ".join(map(str, toks))

    out += ["The generated tree (token ids: random weights make no words):", ""]
    out += ["  " + line for line in render_tree(ctl.parents, label, width=WIDTH - 2)]
    base = runs["sequence"]["kv_bytes"]
    rows = [(s, f"{r['kv_bytes'] / 1e6:,.1f}", f"{r['kv_bytes'] / base:.2f}x",
             "-" if s == strategies[0] else ("yes" if r["thoughts"] == first["thoughts"] else "NO"),
             ",".join(r["chosen"]) if s == "auto" else "")
            for s, r in runs.items()]
    out += ["", "KV bytes attention read over the whole decode (all layers):", ""]
    out += _table(("strategy", "KV MB read", "vs sequence", "same thoughts", "plans used"), rows)
    out += [""] + textwrap.wrap(
        "sequence (Flash-Decoding) reads the shared prompt's KV once per thought at every step; the "
        "tree strategies read it once per step for all thoughts together. (No CPU times: the CPU runs "
        "PyTorch's reference attention, whose times say nothing about the GPU kernels.)", WIDTH)
    out += [""] + _explain_auto(tree)
    same = all(r["thoughts"] == first["thoughts"] for r in runs.values())
    leaked = [s for s, r in runs.items() if r["leaked"]]
    best = min((s for s in runs if s != "sequence"), key=lambda s: runs[s]["kv_bytes"], default="sequence")
    summary = (f"Summary: {best} read {runs[best]['kv_bytes'] / base:.2f}x the KV bytes of sequence; "
               + ("every strategy generated the same thoughts" if same else "the strategies DISAGREE")
               + ("; every KV page was freed." if not leaked else f"; KV pages LEAKED with {', '.join(leaked)}."))
    out += [""] + textwrap.wrap(summary, WIDTH)
    print("\n".join(out))
    return 0 if same and not leaked else 1
