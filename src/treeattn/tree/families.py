"""Workload-shaped decode trees: the trees tree decoding makes in one decode step, by family, for
``treeattn bench kernels --suite workloads`` and for checking ``auto`` beyond the kernel suite its
cost model was fitted on.

The families (:data:`WORKLOAD_FAMILIES`):

* ``beam`` -- beam search mid-run: a 1-8K-token prompt and ``k`` = 4/8/16 beams whose generated
  paths share their early tokens (beam search over random log-probabilities, step by step).
* ``best-of-n`` -- one prompt and ``n`` samples of ~32-512 tokens, all of one length (they decode in
  lockstep), some of them pruned (only the best ``keep`` left).
* ``rl-group`` -- RL rollout groups: ``P`` prompts of ragged lengths x ``n`` samples, the groups
  admitted together or at different steps, finished samples gone.
* ``agent`` -- agent forests: a 3-level shared system prompt (system, tool, task) under many users
  of 50-300 tokens.
* ``tot`` -- Tree-of-Thoughts mid-level: DeFT's recorded templates cut while one level's thoughts
  decode (the kept thoughts above it), and full ``a x b x c`` expansions.
* ``doc-qa`` -- long-document QA: one 16-64K-token document, 2-8 questions with their answers so far.
* ``speculative`` -- Medusa token trees being verified over one context or a batch of contexts (a
  forest), a query at every draft token.

Every tree is deterministic (its generator is seeded by its name), and its name says its shape:
``beam-k8-p4096-g128`` is 8 beams over a 4096-token prompt after 128 generated tokens. Node token
slots are contiguous by node, as :func:`~treeattn.tree.builders.tree_from_spec` lays them out
(Medusa trees keep :func:`~treeattn.tree.builders.tree_from_medusa`'s).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from treeattn.tree.builders import _merge_chains, _scaled, tree_from_medusa, tree_from_spec, tree_from_tot_template
from treeattn.tree.decoding_tree import DecodingTree

__all__ = ["WORKLOAD_FAMILIES", "WorkloadTree", "workload_names", "workload_tree", "workload_trees",
           "tree_by_name", "tree_family"]

WORKLOAD_FAMILIES = ("beam", "best-of-n", "rl-group", "agent", "tot", "doc-qa", "speculative")


@dataclass(frozen=True)
class WorkloadTree:
    """One tree of the set: its ``family`` (of :data:`WORKLOAD_FAMILIES`), ``name`` and ``tree``."""

    family: str
    name: str
    tree: DecodingTree


def _tree(parents, lengths, scale: float, query_nodes=None) -> DecodingTree:
    return DecodingTree.from_parents(np.asarray(parents, dtype=np.int64), _scaled(lengths, scale),
                                     query_nodes=query_nodes)


def _beam(rng, scale, *, k: int, prompt: int, steps: int) -> DecodingTree:
    """``k`` beams after ``steps`` generated tokens of beam search over random log-probabilities
    (each beam's ``k`` candidates: one likely token, the others exponentially less likely); the
    beams' tokens, traced back from the last step, make a token tree whose single-child chains
    become nodes. As in real beam search, the beams share all but their last few tokens."""
    units = 1 + steps * k                    # the prompt, then k tokens a step
    parent = np.full(units, -1, dtype=np.int64)
    beams = np.zeros(k, dtype=np.int64)      # the unit each beam ends at
    score = np.zeros(k)
    for t in range(steps):
        logp = -rng.exponential(1.0, (k, k))
        logp[:, 0] *= 0.1
        cand = (score[:, None] + logp).ravel()
        top = np.argsort(-cand, kind="stable")[:k]
        parent[1 + t * k + np.arange(k)] = beams[top // k]
        beams, score = 1 + t * k + np.arange(k), cand[top]
    kept = np.zeros(units, dtype=bool)       # ancestors of the last step's beams (the others were freed)
    kept[beams] = kept[0] = True
    for t in range(steps - 1, -1, -1):
        step = np.arange(1 + t * k, 1 + (t + 1) * k)
        kept[parent[step[kept[step]]]] = True
    ids = np.flatnonzero(kept)
    renum = np.cumsum(kept) - 1
    unit_parent = np.where(parent[ids] >= 0, renum[np.maximum(parent[ids], 0)], -1)
    depth = np.where(ids > 0, (ids - 1) // k + 1, 0)
    unit_len = np.where(ids > 0, 1, prompt)
    head, group = _merge_chains(unit_parent, depth, np.zeros(ids.size, dtype=bool))
    node_of = (np.cumsum(head) - 1)[group]
    heads = np.flatnonzero(head)
    parents = np.where(unit_parent[heads] >= 0, node_of[np.maximum(unit_parent[heads], 0)], -1)
    lengths = np.bincount(node_of, weights=unit_len).astype(np.int64)
    return _tree(parents, lengths, scale, query_nodes=node_of[renum[beams]])


def _best_of_n(rng, scale, *, n: int, keep: int, prompt: int, gen: int) -> DecodingTree:
    """The ``keep`` best of ``n`` samples of one prompt, ``gen`` tokens each."""
    return _tree([-1] + [0] * keep, [prompt] + [gen] * keep, scale)


def _rl_groups(rng, scale, *, prompts: int, samples: int, prompt_len: int, max_gen: int,
               staggered: bool) -> DecodingTree:
    """``prompts`` groups of ``samples`` rollouts. Prompt lengths are log-normal around
    ``prompt_len``; a group has generated the same number of tokens in all its samples (one step
    for every group, or one each when ``staggered``); a sample whose drawn length (log-normal,
    right-skewed, up to ``max_gen``) is shorter has finished and left, as has a group with none left."""
    plen = np.maximum(16, np.rint(rng.lognormal(math.log(prompt_len), 0.5, prompts))).astype(np.int64)
    step = (rng.integers(max_gen // 16, max_gen * 3 // 4, prompts) if staggered
            else np.full(prompts, rng.integers(max_gen // 8, max_gen // 2)))
    target = np.minimum(max_gen, rng.lognormal(math.log(max_gen * 0.6), 0.6, (prompts, samples)))
    alive = target >= step[:, None]
    groups = np.flatnonzero(alive.any(axis=1))
    per = alive[groups].sum(axis=1)
    parents = np.concatenate((np.full(groups.size, -1), np.repeat(np.arange(groups.size), per)))
    lengths = np.concatenate((plen[groups], np.repeat(step[groups], per)))
    return _tree(parents, lengths, scale)


def _agents(rng, scale, *, tools: int, tasks: int, users: int, system: int) -> DecodingTree:
    """A ``system`` prompt, ``tools`` tool prompts of 200-800 tokens under it, ``tasks`` task
    prompts of 100-400 under each, and about ``users`` users (Poisson) of 50-300 tokens under each task."""
    n_tasks = tools * tasks
    per_task = np.maximum(1, rng.poisson(users, n_tasks))
    parents = np.concatenate(([-1], np.zeros(tools, dtype=np.int64), 1 + np.repeat(np.arange(tools), tasks),
                              1 + tools + np.repeat(np.arange(n_tasks), per_task)))
    lengths = np.concatenate(([system], rng.integers(200, 801, tools), rng.integers(100, 401, n_tasks),
                              rng.integers(50, 301, int(per_task.sum()))))
    return _tree(parents, lengths, scale)


def _decoding_level(parents, lengths, depth, level: int, fraction: float, scale: float) -> DecodingTree:
    """The tree while the thoughts at ``level`` decode, ``fraction`` of the way to the longest
    one: those at least that long hold that many tokens and a query each, the shorter ones have
    finished and are gone, and only thoughts above with a decoding descendant are kept."""
    at = depth == level
    step = max(1, math.ceil(fraction * int(lengths[at].max())))
    kept = at & (lengths >= step)
    for d in range(level, 0, -1):
        kept[parents[kept & (depth == d)]] = True
    ids = np.flatnonzero(kept)
    renum = np.cumsum(kept) - 1
    new_parents = np.where(parents[ids] >= 0, renum[np.maximum(parents[ids], 0)], -1)
    new_lengths = np.where(at[ids], step, lengths[ids])
    return _tree(new_parents, new_lengths, scale, query_nodes=np.flatnonzero(at[ids]))


def _tot_template(rng, scale, *, template: str, index: int, level: int) -> DecodingTree:
    """DeFT's ``template`` entry ``index`` while its thoughts at ``level`` decode (halfway)."""
    full = tree_from_tot_template(template, index)
    return _decoding_level(full.parents, full.lengths, full.topology.depth, level, 0.5, scale)


def _tot_grid(rng, scale, *, branching: tuple, prompt: int) -> DecodingTree:
    """A prompt and every thought expanded, ``branching[i]`` children a thought at level ``i``
    (thoughts of 30-150 tokens), while the last level decodes (60% of the way)."""
    parents, depth, width = [-1], [0], 1
    for d, b in enumerate(branching, start=1):
        first = len(parents) - width
        parents += np.repeat(np.arange(first, first + width), b).tolist()
        depth += [d] * (width * b)
        width *= b
    lengths = np.concatenate(([prompt], rng.integers(30, 151, len(parents) - 1)))
    return _decoding_level(np.array(parents), lengths, np.array(depth), len(branching), 0.6, scale)


def _doc_qa(rng, scale, *, doc: int, questions: int) -> DecodingTree:
    """A ``doc``-token document and ``questions`` questions of 20-80 tokens, each with 1-200 tokens
    of its answer."""
    lengths = rng.integers(20, 81, questions) + rng.integers(1, 201, questions)
    return _tree([-1] + [0] * questions, np.concatenate(([doc], lengths)), scale)


def _forest(trees: list) -> DecodingTree:
    """One forest of ``trees``, each over slots ``0..num_tokens - 1`` of its own, in turn."""
    nodes = np.cumsum([0] + [t.num_nodes for t in trees])
    slots = np.cumsum([0] + [t.num_tokens for t in trees])
    return DecodingTree.from_parents(
        np.concatenate([np.where(t.parents >= 0, t.parents + n, -1) for t, n in zip(trees, nodes)]),
        np.concatenate([t.lengths for t in trees]),
        kv_indices=np.concatenate([t.kv_indices + s for t, s in zip(trees, slots)]),
        query_nodes=np.concatenate([t.query_nodes + n for t, n in zip(trees, nodes)]),
        query_prefix=np.concatenate([t.query_prefix for t in trees]))


def _medusa(rng, scale, *, tree: str, context: int, batch: int = 1) -> DecodingTree:
    """Medusa token tree ``tree`` (a ``shared/workloads/deft/speculative`` file) verified over
    ``batch`` contexts (one of ``context`` tokens, else log-normal around it); ``scale`` scales
    the contexts only (a draft token is one token)."""
    ctx = (np.array([context]) if batch == 1
           else np.rint(rng.lognormal(math.log(context), 0.4, batch)).astype(np.int64))
    trees = [tree_from_medusa(tree, context_len=int(c)) for c in _scaled(ctx, scale)]
    return trees[0] if batch == 1 else _forest(trees)


def _specs() -> tuple:
    """``(family, name, builder, params)`` of every tree of the set, in order."""
    specs = []
    for k, p, g in ((4, 1024, 64), (4, 6144, 256), (8, 2048, 32), (8, 4096, 128), (8, 8192, 64),
                    (16, 1024, 200), (16, 4096, 48), (16, 8192, 160)):
        specs.append(("beam", f"beam-k{k}-p{p}-g{g}", _beam, dict(k=k, prompt=p, steps=g)))
    for n, keep, p, g in ((16, 4, 1500, 48), (4, 4, 300, 512), (8, 8, 600, 256), (16, 16, 2000, 32),
                          (32, 12, 1200, 128), (64, 16, 800, 384), (64, 64, 400, 64)):
        specs.append(("best-of-n", f"best-of-{n}-keep{keep}-p{p}-g{g}", _best_of_n,
                      dict(n=n, keep=keep, prompt=p, gen=g)))
    for pr, n, p, g, stag in ((4, 8, 300, 512, False), (8, 16, 400, 256, True), (8, 8, 1000, 1024, True),
                              (16, 4, 200, 256, False), (16, 16, 300, 1024, True), (32, 8, 150, 384, True),
                              (2, 64, 600, 1024, False)):
        specs.append(("rl-group", f"rl-{pr}x{n}-p{p}-g{g}-{'staggered' if stag else 'sync'}", _rl_groups,
                      dict(prompts=pr, samples=n, prompt_len=p, max_gen=g, staggered=stag)))
    for tools, tasks, users, system in ((2, 2, 4, 1200), (3, 3, 6, 2000), (4, 4, 8, 3000), (2, 4, 32, 1500),
                                        (4, 6, 12, 2500), (6, 4, 16, 4000)):
        specs.append(("agent", f"agent-{tools}x{tasks}x{users}-s{system}", _agents,
                      dict(tools=tools, tasks=tasks, users=users, system=system)))
    for template, index, level in (("sorting", 1, 3), ("docmerge", 0, 2), ("keyword", 0, 4), ("set", 1, 5)):
        specs.append(("tot", f"tot-{template}{index}-level{level}", _tot_template,
                      dict(template=template, index=index, level=level)))
    for branching, p in (((5, 4, 3), 900), ((3, 3, 3, 3), 1200), ((8, 4), 600), ((4, 4, 4), 2000)):
        specs.append(("tot", f"tot-{'x'.join(map(str, branching))}-p{p}", _tot_grid,
                      dict(branching=branching, prompt=p)))
    for doc, q in ((16384, 2), (16384, 8), (32768, 4), (49152, 3), (65536, 2), (65536, 8)):
        specs.append(("doc-qa", f"doc-qa-{doc // 1024}k-q{q}", _doc_qa, dict(doc=doc, questions=q)))
    for tree, ctx, batch in (("APPS_tree_size10", 512, 1), ("tree_size32", 1024, 1), ("tree_size64", 2048, 1),
                             ("tree_size128", 4096, 1), ("tree_size256", 1024, 1), ("APPS_tree_size5", 800, 16),
                             ("tree_size32", 1500, 4), ("tree_size64", 3000, 8)):
        name = f"medusa-{tree.replace('_tree_size', '').replace('tree_size', '')}-c{ctx}" + \
            (f"-b{batch}" if batch > 1 else "")
        specs.append(("speculative", name, _medusa, dict(tree=tree, context=ctx, batch=batch)))
    return tuple(specs)


def _build(spec, scale: float) -> WorkloadTree:
    family, name, builder, params = spec
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return WorkloadTree(family, name, builder(rng, scale, **params))


def workload_names(families=None) -> list[str]:
    """Names of the set's trees (of ``families`` only, when given), in order.

    Raises
    ------
    ValueError
        For a family not in :data:`WORKLOAD_FAMILIES`.
    """
    return [s[1] for s in _selected(families)]


def workload_trees(families=None, *, scale: float = 1.0) -> list[WorkloadTree]:
    """The set's trees (of ``families`` only, when given), in order; ``scale`` multiplies every
    length (rounded, at least 1) except a draft token's. The shapes do not depend on ``scale``.

    Raises
    ------
    ValueError
        For a family not in :data:`WORKLOAD_FAMILIES` or a ``scale`` that is not positive.
    FileNotFoundError
        Where the DeFT templates (``tot``, ``speculative``) are not found (:func:`find_shared`).
    """
    return [_build(s, scale) for s in _selected(families)]


def workload_tree(name: str, *, scale: float = 1.0) -> WorkloadTree:
    """The set's tree called ``name`` (see :func:`workload_trees`); ValueError for another name."""
    for spec in _specs():
        if spec[1] == name:
            return _build(spec, scale)
    raise ValueError(f"no workload tree named {name!r}; see treeattn.tree.workload_names()")


def _selected(families) -> list:
    specs = _specs()
    if families is None:
        return list(specs)
    unknown = sorted(set(families) - set(WORKLOAD_FAMILIES))
    if unknown:
        raise ValueError(f"unknown workload families {unknown}; expected some of {WORKLOAD_FAMILIES}")
    return [s for s in specs if s[0] in families]


def tree_by_name(name: str, *, scale: float = 1.0) -> DecodingTree:
    """The tree a ``bench kernels`` row names: a workload tree's name, else a kernel-suite spec
    (:func:`~treeattn.tree.builders.tree_from_spec`)."""
    if name[:1].isdigit():
        return tree_from_spec(name, scale=scale)
    return workload_tree(name, scale=scale).tree


def tree_family(name: str) -> str:
    """The family of the tree ``name`` (:func:`tree_by_name`): a workload tree's family; a
    kernel-suite spec's shape, ``suite-forest`` (several roots), ``suite-2-level`` (a prompt and
    its leaves), ``suite-3-4-level`` or ``suite-deep`` (5 levels or more)."""
    if not name[:1].isdigit():
        for family, spec_name, _, _ in _specs():
            if spec_name == name:
                return family
        raise ValueError(f"no workload tree named {name!r}; see treeattn.tree.workload_names()")
    sizes = name.split("_")[0].split(",")
    if sizes[0] != "1":
        return "suite-forest"
    return "suite-2-level" if len(sizes) <= 2 else "suite-3-4-level" if len(sizes) <= 4 else "suite-deep"
