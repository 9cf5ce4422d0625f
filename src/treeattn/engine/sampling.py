"""Token samplers: greedy, temperature, top-k, top-p, seeded; they never synchronise with the host.

Randomness is counter-based: the uniform of vocabulary entry ``v`` for a sequence at decode step
``t`` is an integer hash of ``(stream, t, v)``, where ``stream`` identifies the sequence
(:func:`sample_streams`: from the seed, its prompt and its sample index). A sequence's tokens
therefore depend on nothing else in the batch (which other prompts or samples share it, their
order, what was pruned), and a step is a few elementwise passes on the device: no per-row
generators, no ``torch.multinomial`` host checks. Tokens are drawn with the Gumbel-max trick,
``argmax(logits / T + G)`` with ``G = -log(-log U)``, which draws from the softmax exactly.

Dividing by ``T`` is a product with its float32 reciprocal (what torch's ``x / T`` computes on
CUDA), so the CPU, CUDA and fused paths round alike. On CUDA the draw and the normaliser of the
log-probabilities are one pass of :func:`treeattn.launchers.gumbel_argmax` over the logits
(after top-k / top-p, over the filtered scores); on the CPU the torch ops here are the reference.
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np
import torch

from treeattn.launchers import gumbel_argmax

__all__ = ["LogNormaliser", "Sampler", "gumbel_noise", "inverse_temperature", "sample_streams"]

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B1


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` integer hash of int64 values in ``[0, 2**32)``, elementwise.

    int64 products wrap modulo 2**64, whose low 32 bits are the uint32 product; masking keeps
    every value non-negative, so the right shifts are logical.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """:func:`_mix32` of one host integer (the step counter: no device round trip)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(streams: torch.Tensor, counter, vocab: int) -> torch.Tensor:
    """float32 ``[n, vocab]`` standard Gumbel noise of ``streams`` (int64 ``[n]``) under ``counter``:
    the hashed (step, seed) of every row, an int or an int64 ``[n]`` tensor in ``[0, 2**32)``."""
    base = _mix32((streams & _MASK32) ^ counter)
    v = (torch.arange(vocab, device=streams.device, dtype=torch.int64) * _GOLDEN32) & _MASK32
    h = _mix32(_mix32(base[:, None] ^ v[None, :]))
    # 23 bits: (k + 0.5) / 2**23 is exact in float32, so U stays inside (0, 1)
    u = ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


def inverse_temperature(temperature):
    """The float32 reciprocal of ``temperature`` (a float, or a float64 array: a float32 array)
    that logits are multiplied by in place of dividing by ``temperature``."""
    inv = np.float32(1) / np.asarray(temperature, dtype=np.float32)
    return float(inv) if inv.ndim == 0 else inv


class LogNormaliser(NamedTuple):
    """What :meth:`Sampler.logprobs` rates a step's tokens with (:meth:`Sampler.draw`), any tokens
    of those rows, without another pass over the vocabulary.

    Attributes
    ----------
    scores : [n, V] tensor
        The rows' scores before ``scale``: the logits (any float dtype) or float32 filtered scores.
    scale : float
        What ``scores`` are multiplied by (in float32) to give the distribution's logits.
    norm : float32 [n, 2] or None
        Each row's max and ``log(sum(exp(x - max)))`` of the scaled scores ``x``
        (:func:`~treeattn.launchers.gumbel_argmax`); None: ``log_softmax`` of ``scores`` rates them.
    """

    scores: torch.Tensor
    scale: float
    norm: torch.Tensor | None

    def logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """float32 ``[n]``: the log-probability of ``tokens`` (int64 ``[n]``), one per row."""
        if self.norm is None:
            x = self.scores.float() if self.scale == 1.0 else self.scores.float() * self.scale
            return torch.log_softmax(x, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        x = self.scores.gather(-1, tokens[:, None]).squeeze(-1).float()
        if self.scale != 1.0:
            x = x * self.scale
        # (x - max) - log-sum: torch.log_softmax's own order of operations
        return (x - self.norm[:, 0]) - self.norm[:, 1]


def sample_streams(seed: int, prompt, count: int, *, first: int = 0) -> np.ndarray:
    """int64 ``[count]`` random-stream ids of samples ``first .. first + count - 1`` of ``prompt``.

    A stream is a 32-bit digest of ``(seed, prompt tokens, sample index)``: the same prompt with
    the same seed gives the same samples whatever else is decoded with it, and different prompts
    get independent streams.
    """
    head = hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=16,
                           key=(int(seed) % 2**64).to_bytes(8, "little")).digest()
    return np.asarray([int.from_bytes(hashlib.blake2b(head + j.to_bytes(8, "little"), digest_size=4).digest(),
                                      "little") for j in range(first, first + count)], dtype=np.int64)


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
        Seed of the random streams.

    Notes
    -----
    :meth:`sample` is the batch-independent form (each row names its stream and the step);
    calling the sampler directly numbers the rows ``0 .. n-1`` and its calls ``0, 1, ...``, so
    there a row's token depends on its position in the batch.
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
        self._calls = 0

    def __repr__(self) -> str:
        if self.greedy:
            return "Sampler(greedy)"
        return (f"Sampler(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, "
                f"seed={self.seed})")

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, V]``: temperature-scaled logits with the tokens top-k / top-p drop set to
        ``-inf`` (their softmax is the distribution sampled from). Temperature: see the module."""
        x = logits.float() * inverse_temperature(self.temperature)
        if self.top_k and self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:
            sx, idx = torch.sort(x, dim=-1, descending=True)
            p = torch.softmax(sx, dim=-1)
            drop = (p.cumsum(-1) - p) >= self.top_p   # the most likely token always stays
            x = x.scatter(-1, idx, sx.masked_fill(drop, float("-inf")))
        return x

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, V]``: the distribution sampled from (after temperature, top-k, top-p)."""
        return torch.softmax(self.scores(logits), dim=-1)

    def gumbel(self, streams: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
        """float32 ``[n, vocab]`` standard Gumbel noise of ``streams`` (int64 ``[n]``) at ``step``."""
        return gumbel_noise(streams, self._counter(step), vocab)

    def _counter(self, step: int) -> int:
        return _mix32_int(step * _GOLDEN32 + self.seed)

    def filtered(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, V]``: what :meth:`sample` and :meth:`logprobs` draw from and rate against:
        :meth:`scores`, or the logits themselves when greedy. Pass it to both to compute it once."""
        return logits.float() if self.greedy else self.scores(logits)

    def _fused_input(self, logits: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``(x, scale)`` whose product is what the fused kernel samples from: the logits and the
        inverse temperature, or, with top-k / top-p, the filtered scores (they sort the vocabulary:
        torch ops) and 1."""
        if self.greedy:
            return logits, 1.0
        if self.top_k and self.top_k < logits.shape[-1] or self.top_p < 1.0:
            return self.scores(logits), 1.0
        return logits, inverse_temperature(self.temperature)

    def sample(self, logits: torch.Tensor, *, streams: torch.Tensor, step: int,
               filtered: torch.Tensor | None = None) -> torch.Tensor:
        """int64 ``[n]`` tokens from ``logits [n, V]``; row ``i`` uses stream ``streams[i]`` (int64,
        on ``logits``' device) at decode step ``step``, so it depends on nothing else in the batch.
        ``filtered``: :meth:`filtered` of ``logits``, when already computed."""
        _check_logits(logits)
        if self.greedy:
            return logits.argmax(dim=-1)
        if filtered is None and logits.is_cuda:
            x, scale = self._fused_input(logits)
        else:
            x, scale = (self.scores(logits) if filtered is None else filtered), 1.0
        if x.is_cuda:
            return gumbel_argmax(x, streams=streams, counter=self._counter(step), scale=scale)[0]
        return (x + self.gumbel(streams, step, logits.shape[-1])).argmax(dim=-1)

    def draw(self, logits: torch.Tensor, *, streams: torch.Tensor, step: int) -> tuple[torch.Tensor, LogNormaliser]:
        """:meth:`sample`'s tokens and what :meth:`logprobs` rates this step's tokens with
        (``norm=``): on CUDA one pass over the logits for both, whatever tokens are rated."""
        _check_logits(logits)
        if not logits.is_cuda:
            x = self.filtered(logits)
            return self.sample(logits, streams=streams, step=step, filtered=x), LogNormaliser(x, 1.0, None)
        x, scale = self._fused_input(logits)
        tokens, norm = gumbel_argmax(x, streams=None if self.greedy else streams, counter=self._counter(step),
                                     scale=scale, stats=True)
        return tokens, LogNormaliser(x, scale, norm)

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, *, filtered: torch.Tensor | None = None,
                 norm: LogNormaliser | None = None) -> torch.Tensor:
        """float32 ``[n]``: log-probability of ``tokens [n]`` under the distribution sampled from
        (temperature-scaled and filtered; greedy: the model's own distribution, temperature 1).
        ``filtered``: :meth:`filtered` of ``logits``, or ``norm``: :meth:`draw`'s, when already
        computed."""
        if norm is not None:
            return norm.logprobs(tokens)
        if filtered is None and logits.is_cuda:
            x, scale = self._fused_input(logits)
            return LogNormaliser(x, scale, gumbel_argmax(x, scale=scale, stats=True)[1]).logprobs(tokens)
        x = self.filtered(logits) if filtered is None else filtered
        return torch.log_softmax(x, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]`` tokens, on ``logits``' device, from ``logits [n, V]`` (rows are streams
        ``0 .. n-1``, the call count is the step)."""
        _check_logits(logits)
        step, self._calls = self._calls, self._calls + 1
        return self.sample(logits, streams=torch.arange(logits.shape[0], device=logits.device), step=step)


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {tuple(logits.shape)}")
