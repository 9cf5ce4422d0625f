"""Token samplers: greedy, temperature, top-k, top-p, seeded; they never synchronise with the host.

Sampling uses the exponential-race form of the Gumbel-max trick (``argmax(p / E)`` with
``E ~ Exp(1)``), which draws from ``p`` exactly without ``torch.multinomial``'s host checks.
"""
from __future__ import annotations

import torch

__all__ = ["Sampler"]


class Sampler:
    """Draw one token per row of a logits matrix.

    Parameters
    ----------
    temperature : float
        Logits are divided by it (``> 0``); ignored when ``greedy``.
    top_k : int
        Keep the ``top_k`` most likely tokens (0: all).
    top_p : float
        Keep the smallest set of most likely tokens whose probability reaches ``top_p`` (1: all).
    greedy : bool
        Take the arg-max (deterministic; ``temperature``, ``top_k``, ``top_p`` unused).
    seed : int
        Seed of the sampler's own random generator (one per device).
    """

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, *,
                 greedy: bool = False, seed: int = 0):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.greedy, self.seed = bool(greedy), int(seed)
        self._generators: dict = {}

    def __repr__(self) -> str:
        if self.greedy:
            return "Sampler(greedy)"
        return (f"Sampler(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, "
                f"seed={self.seed})")

    def generator(self, device: torch.device) -> torch.Generator:
        """This sampler's generator on ``device`` (created and seeded on first use)."""
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, V]``: the distribution sampled from (after temperature, top-k, top-p)."""
        x = logits.float() / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:
            sx, idx = torch.sort(x, dim=-1, descending=True)
            p = torch.softmax(sx, dim=-1)
            drop = (p.cumsum(-1) - p) >= self.top_p   # the most likely token always stays
            x = x.scatter(-1, idx, sx.masked_fill(drop, float("-inf")))
        return torch.softmax(x, dim=-1)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]`` tokens, on ``logits``' device, from ``logits [n, V]``."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [n, vocab], got shape {tuple(logits.shape)}")
        if self.greedy:
            return logits.argmax(dim=-1)
        p = self.probs(logits)
        race = torch.empty_like(p).exponential_(generator=self.generator(p.device))
        return (p / race).argmax(dim=-1)
