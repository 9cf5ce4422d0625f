"""Built-in tree-decoding workloads (DeFT Sec. 4 / App. A.6) as branch controllers.

* ``fewshot`` -- one long prompt (~4K tokens) and ``b`` sampled branches for 400 steps.
* ``tot-<template>`` -- Tree-of-Thoughts replay of DeFT's reasoning templates (sorting, docmerge,
  keyword, set): breadth-first, every thought of a level is generated in parallel for its recorded
  length, then the level's thoughts without children are pruned and the kept ones branch.
* ``speculative-<t>`` -- Medusa token-tree verification replay: each step verifies a draft tree of
  ``t`` tokens as tree-structured queries and accepts the recorded number of tokens.
* ``beam`` -- beam search (``beam-<k>``: of width ``k``); ``sample`` -- parallel sampling (a forest
  with several prompts; ``sample-<n>``: ``n`` samples of one prompt).
* ``rollout`` -- RL group rollouts: ``P`` prompts x ``n`` samples, each ended by EOS at a length
  drawn from a capped log-normal (:func:`rollout_lengths`), pruned as they finish.
* ``best-of-n`` -- ``n`` samples of a prompt; every ``keep_every`` steps only the best fraction by
  running log-probability survive (:class:`BestOfNController`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from treeattn.engine.beam import BeamSearchController
from treeattn.engine.controller import BranchController, SamplingController, periodic_branching
from treeattn.engine.planning import upload
from treeattn.engine.sampling import Sampler
from treeattn.tree import medusa_records, tree_from_medusa, tree_from_tot_template

__all__ = ["WORKLOADS", "WorkloadSpec", "build_workload", "ToTReplayController",
           "SpeculativeReplayController", "BestOfNController", "random_prompt", "rollout_lengths"]

TOT_TEMPLATES = ("sorting", "docmerge", "keyword", "set")
SPEC_SIZES = (5, 10, 32, 64, 96, 128, 256)
#: Workload names accepted by :func:`build_workload`.
WORKLOADS = ("fewshot",) + tuple(f"tot-{t}" for t in TOT_TEMPLATES) + \
    tuple(f"speculative-{t}" for t in SPEC_SIZES) + ("beam", "beam-4", "beam-8", "beam-16",
                                                     "sample", "sample-16", "sample-64", "rollout", "best-of-n")


def random_prompt(length: int, vocab_size: int, seed: int) -> list:
    """``length`` reproducible random token ids in ``[0, vocab_size)``."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=int(length)).tolist()


def rollout_lengths(shape, max_new_tokens: int, *, median: float, sigma: float, seed: int) -> np.ndarray:
    """int64 ``shape``: output lengths of RL rollouts, log-normal around ``median`` tokens with
    log-scale spread ``sigma`` (reasoning traces are right-skewed: most short, a long tail), at least 1;
    draws past ``max_new_tokens`` hit the cap (``max_new_tokens + 1``: no EOS, the sample ends by
    length, as truncated rollouts do)."""
    if not median > 0 or not sigma >= 0:
        raise ValueError(f"rollout lengths need median > 0 and sigma >= 0, got {median}, {sigma}")
    draws = np.random.default_rng(seed).lognormal(np.log(median), sigma, size=shape)
    return np.minimum(np.maximum(1, np.rint(draws)), max_new_tokens + 1).astype(np.int64)


class ToTReplayController(BranchController):
    """Replay a Tree-of-Thoughts template, forcing its branch and prune shape.

    Parameters
    ----------
    parents, lengths : int arrays ``[N]``
        Template tree; the root's length is the prompt length, every other node's the length of
        its thought (>= 1).
    prompt : list of int
        The root's tokens.
    sampler : Sampler
        Draws the thoughts' tokens.
    """

    def __init__(self, parents, lengths, prompt, *, sampler: Sampler):
        self.parents = np.asarray(parents, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        roots = np.flatnonzero(self.parents < 0)
        if roots.size != 1:
            raise ValueError(f"a ToT template needs exactly one root (the prompt), got {roots.size}")
        self.root_t = int(roots[0])
        self.children = [np.flatnonzero(self.parents == t).tolist() for t in range(self.parents.size)]
        self.prompt, self.sampler = list(prompt), sampler

    @classmethod
    def from_template(cls, name: str, index: int | None = None, *, prompt=None, vocab_size: int,
                      scale: float = 1.0, sampler: Sampler | None = None, seed: int = 0):
        """Controller of entry ``index`` of template ``name`` (default: its first entry with more
        than one level); thought lengths are multiplied by ``scale``."""
        tree = tree_from_tot_template(name, index if index is not None else cls._default_index(name))
        lengths = tree.lengths.copy()
        root = int(np.flatnonzero(tree.parents < 0)[0])
        lengths[tree.parents >= 0] = np.maximum(1, np.rint(lengths[tree.parents >= 0] * scale))
        prompt = prompt if prompt is not None else random_prompt(lengths[root], vocab_size, seed)
        return cls(tree.parents, lengths, prompt, sampler=sampler or Sampler(seed=seed))

    @staticmethod
    def _default_index(name: str) -> int:
        for i in range(1000):
            try:
                tree = tree_from_tot_template(name, i)
            except ValueError as e:
                if "no entry" in str(e):
                    break
                continue
            if tree.topology.depth.max() >= 2:
                return i
        raise ValueError(f"ToT template {name!r} has no entry with more than one level")

    def query_counts(self) -> list:
        return list(range(1, max(len(c) for c in self.children) + 1))

    def total_steps(self) -> int:
        """Decode steps of the whole replay (a level lasts as long as its longest thought)."""
        steps, level = 0, [self.root_t]
        while True:
            level = [c for t in level for c in self.children[t]]
            if not level:
                return steps
            steps += int(self.lengths[level].max())

    def start(self, engine) -> None:
        root = engine.tree.add_root({"template": self.root_t})
        engine.prefill(root, self.prompt)
        self.left: dict[int, int] = {}
        self.level = [root]
        self.thoughts = 0
        self._next_level(engine)

    def _next_level(self, engine) -> None:
        tree, new = engine.tree, []
        for node in self.level:
            kids_t = self.children[tree.meta(node)["template"]]
            if not kids_t:
                if tree.parent(node) is not None:
                    tree.prune(node)
                continue
            kids = tree.branch(node, len(kids_t), [{"template": t} for t in kids_t])
            for kid, t in zip(kids, kids_t):
                self.left[kid] = int(self.lengths[t])
            new.extend(kids)
        self.level = new

    def step(self, engine, step: int) -> bool:
        active = [n for n in self.level if self.left[n] > 0]
        if not active:
            self._next_level(engine)
            active = list(self.level)
            if not active:
                return False
        tokens = self.sampler(engine.logits_for(active))
        engine.decode(active, tokens, horizon=min(self.left[n] for n in active))
        for n in active:
            self.left[n] -= 1
            if self.left[n] == 0:
                engine.tree.finish(n, template=engine.tree.meta(n)["template"],
                                   own_len=engine.tree.own_len(n))
                self.thoughts += 1
        return True

    def result(self, engine) -> dict:
        """``{"thoughts": [{"template_node", "tokens"}], "prompt_len"}``: every generated thought's
        own tokens."""
        tree = engine.tree
        thoughts = [{"template_node": r.info["template"],
                     "tokens": tree.result_tokens(r)[-r.info["own_len"]:]} for r in tree.results]
        return {"prompt_len": len(self.prompt), "thoughts": thoughts}


class SpeculativeReplayController(BranchController):
    """Replay Medusa speculative decoding: verify a draft token tree every step, accept the recorded
    number of tokens (the root token plus drafts along the first-child path).

    Parameters
    ----------
    draft_parents : int array ``[m]``
        Parent draft of each draft token, ``-1`` under the root token; parents first.
    accept_lengths : list of int
        Tokens accepted at each step (root token included).
    prompt : list of int
    sampler : Sampler
        Draws the root (bonus) tokens; draft tokens are uniform random.
    vocab_size : int
    """

    def __init__(self, draft_parents, accept_lengths, prompt, *, sampler: Sampler, vocab_size: int):
        self.parents = np.asarray(draft_parents, dtype=np.int64)
        self.accept = [int(a) for a in accept_lengths]
        self.prompt, self.sampler, self.vocab = list(prompt), sampler, vocab_size
        chain, at = [], -1
        while True:
            kids = np.flatnonzero(self.parents == at)
            if not kids.size:
                break
            at = int(kids[0])
            chain.append(at)
        self.chain = chain

    @classmethod
    def from_medusa(cls, size, record: int = 0, *, prompt=None, prompt_len: int | None = None,
                    vocab_size: int, sampler: Sampler | None = None, seed: int = 0):
        """Controller of Medusa tree file ``size`` (``tree_size{size}.json``) and its record ``record``;
        the prompt defaults to random ids, as many as the record's text has characters / 4."""
        tree = tree_from_medusa(size, context_len=1, compress=False)
        recs = medusa_records(size)
        if not 0 <= record < len(recs):
            raise ValueError(f"Medusa file {size}: no record {record} (it has {len(recs)})")
        rec = recs[record]
        if prompt is None:
            text = rec.get("prompt", "")
            chars = sum(len(p) for p in text) if isinstance(text, list) else len(str(text))
            prompt = random_prompt(prompt_len or max(1, chars // 4), vocab_size, seed)
        return cls(tree.parents[1:] - 1, rec["Accept_length"], prompt,
                   sampler=sampler or Sampler(seed=seed), vocab_size=vocab_size)

    def total_steps(self) -> int:
        return len(self.accept)

    def query_counts(self) -> list:
        return [1 + int(self.parents.size)]

    def start(self, engine) -> None:
        self.ctx = engine.tree.add_root()
        logits = engine.prefill(self.ctx, self.prompt)
        self.root_token = self.sampler(logits[None])
        self.gen = torch.Generator(device=engine.device).manual_seed(self.sampler.seed + 1)
        self.accepted = 0

    def step(self, engine, step: int) -> bool:
        if step >= len(self.accept):
            return False
        drafts = torch.randint(0, self.vocab, (self.parents.size,), generator=self.gen, device=engine.device)
        engine.verify(self.ctx, self.root_token, self.parents, drafts)
        path = self.chain[: max(0, self.accept[step] - 1)]
        engine.accept(self.ctx, path)
        self.accepted += 1 + len(path)
        self.root_token = self.sampler(engine.logits_of(self.ctx)[None])
        return True

    def result(self, engine) -> dict:
        """``{"tokens": [the accepted sequence incl. prompt], "accepted": n, "draft_tokens": m}``."""
        return {"tokens": engine.tree.tokens(self.ctx), "accepted": self.accepted,
                "draft_tokens": int(self.parents.size)}


class BestOfNController(SamplingController):
    """Best-of-n sampling with early pruning: every ``keep_every`` steps each prompt keeps only its
    ``keep_fraction`` best running samples (summed log-probability of their tokens so far, at least
    ``min_keep``); the survivors decode on until ``max_new_tokens`` (or EOS).

    Parameters
    ----------
    prompts, n, sampler, max_new_tokens, eos_token_ids, prune_every
        As :class:`~treeattn.engine.controller.SamplingController`.
    keep_every : int
        Steps between selections (the running scores reach the host by an asynchronous copy; the
        dropped samples are pruned when it lands, within two steps).
    keep_fraction : float in (0, 1)
    min_keep : int
        Samples per prompt that selection never goes below.
    """

    _LAG = 2    # steps a selection's pruning may wait for its scores' copy

    def __init__(self, prompts, *, n: int, keep_every: int = 8, keep_fraction: float = 0.5, min_keep: int = 1,
                 **kwargs):
        super().__init__(prompts, n=n, logprobs=True, **kwargs)
        if keep_every < 1 or not 0 < keep_fraction < 1 or min_keep < 1:
            raise ValueError(f"best-of-n needs keep_every >= 1, keep_fraction in (0, 1) and min_keep >= 1, "
                             f"got {keep_every}, {keep_fraction}, {min_keep}")
        self.keep_every, self.keep_fraction, self.min_keep = keep_every, keep_fraction, min_keep
        self.selections = 0
        self._selection = None    # (step, rows, their scores on the host, copy event) of a selection

    def _steps_to_event(self, step: int) -> int:
        return min(super()._steps_to_event(step), self.keep_every - step % self.keep_every)

    def _before_step(self, engine, step: int) -> None:
        # a selection's scores reach the host through an asynchronous copy; the rows it drops are
        # pruned once the copy has landed (at the latest ``_LAG`` steps later, or before stopping).
        # Samples are independent streams, so pruning late changes no survivor's tokens.
        if self._selection is not None:
            at, rows, host, ev = self._selection
            if ev.query() or step >= min(at + self._LAG, self.max_new_tokens):
                ev.synchronize()
                self._selection = None
                self._select(engine.tree, rows, host.tolist())
        if step == 0 or step % self.keep_every or step >= self.max_new_tokens:
            return
        tree = engine.tree
        rows = [n for n in self._rows if n in tree and not tree.is_done(n)]
        if len(rows) <= self.min_keep:
            return
        at = {n: i for i, n in enumerate(self._rows)}
        scores = self.running_logprobs().index_select(
            0, upload(np.asarray([at[n] for n in rows]), engine.device))
        if not scores.is_cuda:
            self._select(tree, rows, scores.tolist())
            return
        host = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True)
        host.copy_(scores, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._selection = (step, rows, host, ev)

    def _select(self, tree, rows: list, scores: list) -> None:
        groups: dict = {}
        for node, score in zip(rows, scores):
            groups.setdefault(_root_of(tree, node), []).append((score, node))
        for group in groups.values():
            keep = max(self.min_keep, int(np.ceil(len(group) * self.keep_fraction)))
            for _, node in sorted(group, key=lambda sn: -sn[0])[keep:]:
                if node in tree and not tree.is_done(node):
                    tree.prune(node)
        self.selections += 1

    def query_counts(self) -> list:
        return list(range(1, self.n * len(self.prompts) + 1))

    def result(self, engine) -> dict:
        if self._selection is not None:
            _, rows, host, ev = self._selection
            ev.synchronize()
            self._selection = None
            self._select(engine.tree, rows, host.tolist())
        return super().result(engine)


def _root_of(tree, node: int) -> int:
    while tree.parent(node) is not None:
        node = tree.parent(node)
    return node


@dataclass
class WorkloadSpec:
    """Everything :func:`build_workload` needs; unset prompts are random ids of ``prompt_len``.

    ``rollout`` draws ``num_prompts`` prompts (unless ``prompts`` are given) with ``n`` samples
    each, their lengths log-normal around ``length_median`` (default ``max_new_tokens / 4``) with
    spread ``length_sigma``; finished samples are pruned every ``prune_every`` steps.
    ``best-of-n`` keeps the best ``keep_fraction`` of the samples every ``keep_every`` steps, down to
    ``min_keep``.
    """

    name: str
    vocab_size: int
    prompts: list = field(default_factory=list)
    prompt_len: int | None = None
    branches: int = 20
    steps: int | None = None
    max_new_tokens: int = 16
    beams: int = 4
    n: int = 4
    seed: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    template_index: int | None = None
    record: int = 0
    scale: float = 1.0
    eos_token_ids: tuple = ()
    branch_every: int = 0
    branch_factor: int = 2
    max_leaves: int = 64
    num_prompts: int = 4
    length_median: float | None = None
    length_sigma: float = 0.6
    prune_every: int = 8
    keep_every: int = 8
    keep_fraction: float = 0.5
    min_keep: int = 1


def build_workload(spec: WorkloadSpec) -> tuple:
    """``(controller, total decode steps)`` of a named workload (:data:`WORKLOADS`).

    Raises
    ------
    ValueError
        Unknown workload name or bad parameters; FileNotFoundError for a missing workload file.
    """
    name = spec.name
    sampler = Sampler(spec.temperature, spec.top_k, spec.top_p, greedy=spec.greedy, seed=spec.seed)

    def prompt(default_len: int) -> list:
        if spec.prompts:
            p = spec.prompts[0]
            want = spec.prompt_len or len(p)
            return (p * -(-want // len(p)))[:want]
        return random_prompt(spec.prompt_len or default_len, spec.vocab_size, spec.seed)

    if name == "fewshot":
        steps = spec.steps or 400
        ctl = SamplingController([prompt(4000)], n=spec.branches, sampler=sampler, max_new_tokens=steps)
        return ctl, steps
    if name.startswith("tot-"):
        template = name[4:]
        if template not in TOT_TEMPLATES:
            raise ValueError(f"unknown ToT template {template!r}; expected one of {TOT_TEMPLATES}")
        ctl = ToTReplayController.from_template(template, spec.template_index,
                                                prompt=prompt(0) if spec.prompts or spec.prompt_len else None,
                                                vocab_size=spec.vocab_size, scale=spec.scale,
                                                sampler=sampler, seed=spec.seed)
        return ctl, ctl.total_steps()
    if name.startswith("speculative-"):
        size = name.split("-", 1)[1]
        if not size.isdigit():
            raise ValueError(f"speculative workloads are speculative-<tree size>, got {name!r}")
        ctl = SpeculativeReplayController.from_medusa(
            int(size), spec.record, prompt=spec.prompts[0] if spec.prompts else None,
            prompt_len=spec.prompt_len, vocab_size=spec.vocab_size, sampler=sampler, seed=spec.seed)
        return ctl, ctl.total_steps()
    if name == "beam" or name.startswith("beam-"):
        beams = _size(name, spec.beams)
        return BeamSearchController(prompt(16), num_beams=beams, max_new_tokens=spec.max_new_tokens,
                                    eos_token_ids=spec.eos_token_ids), spec.max_new_tokens
    if name == "sample" or name.startswith("sample-"):
        prompts = spec.prompts or [prompt(16)]
        cb = periodic_branching(spec.branch_every, spec.branch_factor, spec.max_leaves) \
            if spec.branch_every else None
        return SamplingController(prompts, n=_size(name, spec.n), sampler=sampler,
                                  max_new_tokens=spec.max_new_tokens, eos_token_ids=spec.eos_token_ids,
                                  callbacks=cb, prune_every=spec.prune_every), spec.max_new_tokens
    if name == "rollout":
        if spec.num_prompts < 1 and not spec.prompts:
            raise ValueError(f"rollout needs num_prompts >= 1, got {spec.num_prompts}")
        prompts = spec.prompts or [random_prompt(spec.prompt_len or 32, spec.vocab_size, spec.seed + i)
                                   for i in range(spec.num_prompts)]
        # random weights never emit EOS: each sample is fed it at its drawn length
        eos = tuple(spec.eos_token_ids) or (spec.vocab_size - 1,)
        lengths = rollout_lengths((len(prompts), spec.n), spec.max_new_tokens,
                                  median=spec.length_median or max(1.0, spec.max_new_tokens / 4),
                                  sigma=spec.length_sigma, seed=spec.seed)
        return SamplingController(prompts, n=spec.n, sampler=sampler, max_new_tokens=spec.max_new_tokens,
                                  eos_token_ids=eos, prune_every=spec.prune_every,
                                  forced_lengths=lengths), spec.max_new_tokens
    if name == "best-of-n":
        prompts = spec.prompts or [prompt(16)]
        return BestOfNController(prompts, n=spec.n, sampler=sampler, max_new_tokens=spec.max_new_tokens,
                                 eos_token_ids=spec.eos_token_ids, prune_every=spec.prune_every,
                                 keep_every=spec.keep_every, keep_fraction=spec.keep_fraction,
                                 min_keep=spec.min_keep), spec.max_new_tokens
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")


def _size(name: str, default: int) -> int:
    """The ``<k>`` of a ``beam-<k>`` / ``sample-<n>`` workload name, else ``default``."""
    if "-" not in name:
        return default
    k = name.split("-", 1)[1]
    if not k.isdigit() or int(k) < 1:
        raise ValueError(f"workload {name!r}: the size after '-' must be a positive integer")
    return int(k)
