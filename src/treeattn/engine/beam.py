"""Beam search as a branch controller, step for step the algorithm of Hugging Face transformers'
``generate(num_beams=k, do_sample=False)`` (v4.50+ vectorised beam search, batch size 1): the same
candidate set (top ``max(2, 1 + #eos) * k``), length penalty, early-stopping heuristic and
finished-hypothesis bookkeeping, so both return the same sequences and scores.

Everything a step decides stays on the device: scores, the selected parents and tokens, the
finished hypotheses and the stop condition. The host never waits for the GPU inside the loop, so
it plans and enqueues step ``t + 1`` while the GPU runs step ``t``.

On the tree: the prompt is one root whose KV all ``k`` beams share (read once a step by
prefix-aware attention); each beam is a child leaf holding the tokens it generated. The tree's
shape is therefore fixed for the whole search, and the engine plans it once per decode window.
Each new beam's first continuation stays in its parent's leaf; the others take the leaves of
beams that ended, and the KV of their parents' generated tokens is copied there on the device (one
kernel a step that moves only those leaves' tokens, over all layers: what the host could only
avoid by waiting for the selection). The prompt is never copied. Beams sit in the leaves in no
particular order of score.
"""
from __future__ import annotations

import numpy as np
import torch

from treeattn.engine.controller import BranchController
from treeattn.engine.planning import upload
from treeattn.launchers import TOPK_CANDIDATES, gumbel_argmax, row_topk_candidates

__all__ = ["BeamSearchController"]

_NEG = -1.0e9


class BeamSearchController(BranchController):
    """Beam search of width ``num_beams`` over one prompt.

    Parameters
    ----------
    prompt : list of int
    num_beams : int
    max_new_tokens : int
    length_penalty : float
        Finished scores are ``sum log p / generated_len ** length_penalty``.
    early_stopping : bool or "never"
        transformers' meaning.
    eos_token_ids : sequence of int
    num_return_sequences : int, optional
        Default ``num_beams``.
    poll_every : int
        The host reads the device's "search finished" flag without waiting: the flag is copied
        asynchronously every step and read once the copy has landed. A finished search freezes
        its results on the device, so the few steps that run before the host sees the flag
        change nothing but time; ``poll_every`` steps at the latest, the host waits for it.

    Notes
    -----
    The sequences of the search live on the device; ``engine.tree.tokens`` of a beam's leaf is
    not its hypothesis (beams swap histories). :meth:`result` copies them to the host once.
    """

    def __init__(self, prompt, *, num_beams: int = 4, max_new_tokens: int = 16, length_penalty: float = 1.0,
                 early_stopping=False, eos_token_ids=(), num_return_sequences: int | None = None,
                 poll_every: int = 8):
        if not len(prompt):
            raise ValueError("beam search needs a non-empty prompt")
        if num_beams < 1 or max_new_tokens < 1:
            raise ValueError(f"num_beams and max_new_tokens must be >= 1, got {num_beams}, {max_new_tokens}")
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        if poll_every < 1:
            raise ValueError(f"poll_every must be >= 1, got {poll_every}")
        self.prompt = [int(t) for t in prompt]
        self.k, self.max_new = num_beams, max_new_tokens
        self.length_penalty, self.early_stopping = float(length_penalty), early_stopping
        self.eos = tuple(int(e) for e in eos_token_ids)
        self.n_return = num_return_sequences or num_beams
        if not 1 <= self.n_return <= num_beams:
            raise ValueError(f"num_return_sequences must be in [1, {num_beams}]")
        self.keep = max(2, 1 + len(self.eos)) * num_beams
        self.poll_every = poll_every

    def query_counts(self) -> list:
        return [self.k]

    def start(self, engine) -> None:
        vocab = engine.model.config.vocab_size
        if self.k > vocab:
            raise ValueError(f"num_beams={self.k} exceeds the vocabulary ({vocab} tokens)")
        root = engine.tree.add_root()
        engine.prefill(root, self.prompt)
        k, d = self.k, engine.device
        self.nodes = [root] if k == 1 else engine.tree.branch(root, k)
        self.dev = d
        self.gen = torch.zeros(k, self.max_new, dtype=torch.int64, device=d)     # running beams' tokens
        self.run_scores = torch.full((k,), _NEG, device=d)
        self.run_scores[0] = 0.0
        self.fin_gen = torch.zeros(k, self.max_new, dtype=torch.int64, device=d)
        self.fin_len = torch.zeros(k, dtype=torch.int64, device=d)
        self.fin_scores = torch.full((k,), _NEG, device=d)
        self.fin_flags = torch.zeros(k, dtype=torch.bool, device=d)
        self.improvable = torch.ones((), dtype=torch.bool, device=d)
        self.done = torch.zeros((), dtype=torch.bool, device=d)
        self.eos_ids = torch.tensor(self.eos, dtype=torch.int64, device=d)
        self.cur_len = len(self.prompt)
        self.max_length = self.cur_len + self.max_new
        self._flag = None       # (host copy of ``done``, its copy event) in flight
        self._since_poll = 0

    def step(self, engine, step: int) -> bool:
        if step >= self.max_new or self._finished():
            return False
        k, prompt_len, t = self.k, len(self.prompt), step
        logits = engine.logits_for(self.nodes)
        top_v, beam, tok = _candidates(logits, self.run_scores, self.keep, fused=logits.is_cuda)
        last = self.cur_len + 1 >= self.max_length     # (host-known: every candidate has this length)
        if last:
            hits = torch.ones_like(tok, dtype=torch.bool)
        else:
            hits = (tok[:, None] == self.eos_ids).any(-1)
        # running beams of the next step: the best k candidates that did not stop
        run_lp = top_v + hits.float() * _NEG
        nxt = torch.topk(run_lp, k).indices
        # finished hypotheses: stopped candidates among the top k, length-penalised
        cand_gen = self.gen[beam]
        cand_gen[:, t] = tok
        just = hits & (torch.arange(self.keep, device=self.dev) < k)
        fin_lp = top_v / float((self.cur_len + 1 - prompt_len) ** self.length_penalty)
        if self.early_stopping is True:
            fin_lp = fin_lp + self.fin_flags.all().float() * _NEG
        fin_lp = fin_lp + (~self.improvable).float() * _NEG + (~just).float() * _NEG
        merged = torch.cat((self.fin_scores, fin_lp))
        best = torch.topk(merged, k).indices
        keep_old = self.done        # a finished search keeps its results while the host catches up
        self.fin_gen = torch.where(keep_old, self.fin_gen, torch.cat((self.fin_gen, cand_gen))[best])
        self.fin_len = torch.where(keep_old, self.fin_len,
                                   torch.cat((self.fin_len, torch.full_like(just, t + 1, dtype=torch.int64)))[best])
        self.fin_scores = torch.where(keep_old, self.fin_scores, merged[best])
        self.fin_flags = torch.where(keep_old, self.fin_flags, torch.cat((self.fin_flags, just))[best])
        # the new beams' leaves: each beam's first continuation stays in its leaf, the others
        # take the leaves of beams that ended, so only those leaves' KV is rewritten
        at = nxt[_inverse(_place(beam[nxt]))]       # the candidate each leaf continues with
        self.run_scores = run_lp[at]
        self.cur_len += 1
        self._update_improvable(prompt_len)
        stopped = ~self.improvable | hits.all()
        if self.early_stopping is True:
            stopped = stopped | self.fin_flags.all()
        self.done = self.done | stopped
        self._post_flag()
        if last:
            return False
        self.gen = cand_gen[at]
        if k > 1 and t > 0:
            self._reorder_kv(engine, beam[at])
        engine.decode(self.nodes, tok[at], horizon=self.max_new - step - 1)
        return True

    def _update_improvable(self, prompt_len: int) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - prompt_len
        else:
            best_len = self.cur_len - prompt_len
        best_running = self.run_scores.max() / float(best_len ** self.length_penalty)
        worst = torch.where(self.fin_flags, self.fin_scores.min(), torch.full_like(self.fin_scores, _NEG))
        self.improvable = self.improvable & (best_running > worst).any()

    def _reorder_kv(self, engine, parents: torch.Tensor) -> None:
        """Leaf ``j`` continues leaf ``parents[j]``'s hypothesis: copy that leaf's generated KV into
        ``j``'s slots (every layer, on the device, no host wait). A leaf that is some leaf's parent
        continues itself (:func:`_place`), so no copy reads a slot another copy writes, and the
        leaves that continue themselves move no bytes."""
        own = np.stack([engine.kv.own_slots(n) for n in self.nodes])     # [k, generated (this rank's)]
        if not own.shape[1]:
            return
        dst = upload(own, engine.device)
        engine.kv.copy(dst[parents].reshape(-1), dst.reshape(-1), in_place=True)

    def _post_flag(self) -> None:
        """Start copying ``done`` to the host (pinned, asynchronous on CUDA)."""
        if self._flag is not None:
            return
        if self.done.device.type != "cuda":
            self._flag = (self.done.clone(), None)
            return
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(self.done, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._flag = (host, ev)

    def _finished(self) -> bool:
        """Whether the device has flagged the search finished, as far as the host knows without
        waiting (waiting only every ``poll_every`` steps)."""
        if self._flag is None:
            return False
        host, ev = self._flag
        self._since_poll += 1
        if ev is not None and not ev.query():
            if self._since_poll < self.poll_every:
                return False
            ev.synchronize()
        self._flag, self._since_poll = None, 0
        return bool(host)

    def result(self, engine) -> dict:
        """``{"sequences": [[ids incl. prompt], ...], "scores": [...]}``, best first."""
        n = self.n_return
        gen, lens, scores = (x[:n].tolist() for x in (self.fin_gen, self.fin_len, self.fin_scores))
        return {"sequences": [self.prompt + g[:m] for g, m in zip(gen, lens)],
                "scores": [float(s) for s in scores]}


def _candidates(logits: torch.Tensor, scores: torch.Tensor, keep: int, *, fused: bool) -> tuple:
    """The ``keep`` best continuations ``(log-probability + score, beam, token)`` (float32, int64,
    int64 ``[keep]``, best first) of beams with ``logits [k, V]`` and running ``scores [k]``.

    ``fused``: each row's log-softmax normaliser and its chunks' best entries in one pass each
    (:func:`~treeattn.launchers.gumbel_argmax`, :func:`~treeattn.launchers.row_topk_candidates`),
    then ``torch.topk`` over those few thousand candidates, where ``log_softmax`` and ``topk`` over
    all ``k x V`` entries took 140-180 us for 4-16 beams of a 128K vocabulary (H200)."""
    if fused and keep <= TOPK_CANDIDATES[-1]:
        x = logits.float()
        norm = gumbel_argmax(x, stats=True)[1]
        v, i = row_topk_candidates(x, keep)
        # (x - max) - log-sum-exp, as torch.log_softmax rates a token
        cand = (v - norm[:, :1]) - norm[:, 1:] + scores[:, None]
        top_v, j = torch.topk(cand.reshape(-1), keep)
        return top_v, j // v.shape[1], i.reshape(-1)[j].long()
    logp = torch.log_softmax(logits.float(), dim=-1) + scores[:, None]
    top_v, top_i = torch.topk(logp.reshape(-1), keep)
    vocab = logp.shape[-1]
    return top_v, top_i // vocab, top_i % vocab


def _place(parent: torch.Tensor) -> torch.Tensor:
    """The leaf of each new beam (int64 ``[k]``), given its parent's leaf ``parent`` (int64 ``[k]``,
    new beams in any order): the first new beam of each parent takes the parent's leaf, the others
    the leaves no new beam descends from, in order. On the device, without a host read."""
    k = parent.shape[0]
    ar = torch.arange(k, device=parent.device)
    same = parent[:, None] == parent[None, :]
    first = ~(same & (ar[None, :] < ar[:, None])).any(1)
    free = ~((parent[:, None] == ar[None, :]) & first[:, None]).any(0)
    # the r-th other beam takes the r-th free leaf (there are as many of each)
    rank = torch.cumsum(~first, 0) - 1
    free_rank = torch.cumsum(free, 0) - 1
    match = free[None, :] & (free_rank[None, :] == rank[:, None])
    return torch.where(first, parent, match.int().argmax(1))


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of the permutation ``perm`` (int64 ``[k]``)."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.shape[0], device=perm.device))
