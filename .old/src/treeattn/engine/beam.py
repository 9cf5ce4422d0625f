"""Beam search as a branch controller, step for step the algorithm of Hugging Face transformers'
``generate(num_beams=k, do_sample=False)`` (v4.50+ vectorised beam search, batch size 1): the same
candidate set (top ``max(2, 1 + #eos) * k``), length penalty, early-stopping heuristic and
finished-hypothesis bookkeeping, so both return the same sequences.

On the tree: a beam selected once continues in place, a beam selected ``m > 1`` times branches into
``m`` children sharing its KV, and a beam not selected is pruned (with every ancestor left without
live descendants).
"""
from __future__ import annotations

import numpy as np
import torch

from treeattn.engine.controller import BranchController
from treeattn.engine.planning import upload

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
    """

    def __init__(self, prompt, *, num_beams: int = 4, max_new_tokens: int = 16, length_penalty: float = 1.0,
                 early_stopping=False, eos_token_ids=(), num_return_sequences: int | None = None):
        if not prompt:
            raise ValueError("beam search needs a non-empty prompt")
        if num_beams < 1 or max_new_tokens < 1:
            raise ValueError(f"num_beams and max_new_tokens must be >= 1, got {num_beams}, {max_new_tokens}")
        self.prompt = [int(t) for t in prompt]
        self.k, self.max_new = num_beams, max_new_tokens
        self.length_penalty, self.early_stopping = float(length_penalty), early_stopping
        self.eos = tuple(int(e) for e in eos_token_ids)
        self.n_return = num_return_sequences or num_beams
        if not 1 <= self.n_return <= num_beams:
            raise ValueError(f"num_return_sequences must be in [1, {num_beams}]")
        self.keep = max(2, 1 + len(self.eos)) * num_beams

    def start(self, engine) -> None:
        root = engine.tree.add_root()
        engine.prefill(root, self.prompt)
        k = self.k
        self.nodes = [root] * k
        self.seqs = [list(self.prompt) for _ in range(k)]
        self.run_scores = torch.full((k,), _NEG)
        self.run_scores[0] = 0.0
        self.fin_seqs = [list(self.prompt) for _ in range(k)]
        self.fin_scores = torch.full((k,), _NEG)
        self.fin_flags = torch.zeros(k, dtype=torch.bool)
        self.improvable = True
        self.cur_len = len(self.prompt)
        self.max_length = self.cur_len + self.max_new

    def step(self, engine, step: int) -> bool:
        k, prompt_len = self.k, len(self.prompt)
        logits = engine.logits_for(self.nodes)
        logp = torch.log_softmax(logits.float(), dim=-1) + self.run_scores.to(logits.device)[:, None]
        vocab = logp.shape[-1]
        top_v, top_i = torch.topk(logp.reshape(-1), self.keep)
        top_v, top_i = top_v.cpu(), top_i.cpu()
        beam, tok = (top_i // vocab).tolist(), (top_i % vocab).tolist()
        cand = [self.seqs[b] + [t] for b, t in zip(beam, tok)]
        hits = torch.tensor([t in self.eos or self.cur_len + 1 >= self.max_length for t in tok])
        # running beams for the next step: the best k candidates that did not stop
        run_lp = top_v + hits.float() * _NEG
        nxt = torch.topk(run_lp, k).indices.tolist()
        # finished hypotheses: stopped candidates among the top k, length-penalised
        just = hits & (torch.arange(self.keep) < k)
        fin_lp = top_v / ((self.cur_len + 1 - prompt_len) ** self.length_penalty)
        if bool(self.fin_flags.all()) and self.early_stopping is True:
            fin_lp = fin_lp + _NEG
        if not self.improvable:
            fin_lp = fin_lp + _NEG
        fin_lp = fin_lp + (~just).float() * _NEG
        merged = torch.cat((self.fin_scores, fin_lp))
        best = torch.topk(merged, k).indices.tolist()
        seqs = self.fin_seqs + cand
        flags = torch.cat((self.fin_flags, just))
        self.fin_seqs = [seqs[i] for i in best]
        self.fin_scores, self.fin_flags = merged[best], flags[best]
        self.run_scores = run_lp[nxt]
        self.cur_len += 1
        self._update_improvable(prompt_len)
        alive = self.improvable and not (bool(self.fin_flags.all()) and self.early_stopping is True) \
            and not bool(hits.all())
        if not alive:
            return False
        self._advance(engine, [beam[j] for j in nxt], [tok[j] for j in nxt])
        return True

    def _update_improvable(self, prompt_len: int) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - prompt_len
        else:
            best_len = self.cur_len - prompt_len
        best_running = float(self.run_scores[0]) / (best_len ** self.length_penalty)
        worst = torch.where(self.fin_flags, self.fin_scores.min(), torch.tensor(_NEG))
        self.improvable = self.improvable and bool((best_running > worst).any())

    def _advance(self, engine, parents: list, tokens: list) -> None:
        """Move the tree to the new running beams and feed their last tokens."""
        tree = engine.tree
        old = self.nodes
        chosen: dict[int, list] = {}
        for j, b in enumerate(parents):
            chosen.setdefault(old[b], []).append(j)
        nodes = [0] * self.k
        for node, js in chosen.items():
            kids = [node] if len(js) == 1 else tree.branch(node, len(js))
            for j, kid in zip(js, kids):
                nodes[j] = kid
        for node in dict.fromkeys(old):
            if node not in chosen and node in tree:
                tree.prune(node)
        self.seqs = [self.seqs[b] + [t] for b, t in zip(parents, tokens)]
        self.nodes = nodes
        engine.decode(nodes, upload(np.asarray(tokens), engine.device))

    def result(self, engine) -> dict:
        """``{"sequences": [[ids incl. prompt], ...], "scores": [...]}``, best first."""
        n = self.n_return
        return {"sequences": [list(s) for s in self.fin_seqs[:n]],
                "scores": [float(s) for s in self.fin_scores[:n]]}
