"""Speculative verification steps of :class:`~treeattn.engine.engine.TreeEngine`: a draft token
tree below a leaf is queried as tree-structured queries (each draft sees the leaf's path and its
own ancestors among the drafts), then the accepted drafts join the leaf."""
from __future__ import annotations

import time

import numpy as np
import torch

from treeattn.engine.planning import upload

__all__ = ["SpeculativeSteps"]


class SpeculativeSteps:
    """:meth:`verify` and :meth:`accept` (a mixin of :class:`~treeattn.engine.engine.TreeEngine`,
    whose state and forward pass they use)."""

    def verify(self, node: int, root_token: torch.Tensor, draft_parents, draft_tokens: torch.Tensor
               ) -> torch.Tensor:
        """Speculative verification: append ``root_token [1]`` to leaf ``node`` and query it together
        with a draft token tree below it.

        Parameters
        ----------
        draft_parents : int sequence ``[m]``
            Parent draft of each draft token (``-1``: the root token); parents come first.
        draft_tokens : int64 ``[m]`` on the model's device

        Returns
        -------
        float32 logits ``[1 + m, vocab]``: row 0 after the root token, row ``1 + i`` after draft ``i``.
        """
        self.flush_prefill()
        t0 = time.perf_counter()
        self._close_window()
        par = np.asarray(draft_parents, dtype=np.int64)
        depth = self._draft_depth(par)
        rslot, rpos = self.tree.append_run(node, root_token)
        dslots = self.kv.scratch(par.size)
        pos = np.concatenate((rpos, rpos[0] + depth))
        self._check_positions(pos)
        plan, plan_ms, ntok, seen, sliding = None, 0.0, 0, (0, 0), None
        if self.compute:
            dtree = self.tree.decoding_tree([node], drafts=(node, par, dslots))
            plan, plan_ms, ntok = self.planner.plan(dtree), self.planner.last_ms, dtree.num_tokens
            seen = (int(dtree.visible_tokens.sum()), int(dtree.node_extent.sum()))
            sliding, sliding_ms = self._sliding_plan(pos, lambda: dtree)
            plan_ms += sliding_ms
        tokens = torch.cat((root_token.reshape(1), draft_tokens.reshape(-1)))
        logits = self._forward(tokens, pos, np.concatenate((rslot, dslots)), plan, "verify", t0,
                               plan_ms, ntok, seen, sliding=sliding)
        self._verify = (node, dslots, draft_tokens.reshape(-1), logits)
        self._logits[node] = (logits, 0)
        return logits

    def _draft_depth(self, par: np.ndarray) -> np.ndarray:
        """Depth (1 = child of the root token) of every draft; cached for the last draft tree."""
        key = par.tobytes()
        if self._depth is None or self._depth[0] != key:
            bad = np.flatnonzero(par >= np.arange(par.size))
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"draft {i} has parent {int(par[i])}: parents must come first")
            depth = np.ones(par.size, dtype=np.int64)
            for i in np.flatnonzero(par >= 0):
                depth[i] = depth[par[i]] + 1
            self._depth = (key, depth)
        return self._depth[1]

    def accept(self, node: int, drafts) -> None:
        """Keep drafts ``drafts`` (a root-to-leaf path of the last :meth:`verify`, in order): their
        tokens join ``node`` and their K/V move from the scratch slots into ``node``'s slots."""
        if self._verify is None or self._verify[0] != node:
            raise ValueError(f"accept() needs a preceding verify() of node {node}")
        _, dslots, dtok, logits = self._verify
        drafts = [int(i) for i in drafts]
        if drafts:
            idx = upload(np.asarray(drafts), self.device)
            slots, _ = self.tree.append_run(node, dtok.index_select(0, idx))
            self.kv.copy(upload(dslots[drafts], self.device), upload(slots, self.device))
            self._logits[node] = (logits, 1 + drafts[-1])
        self._verify = None
