"""One decode step's token choice for a batch of requests with different sampling options, on the
device and vectorised over rows: OpenAI's ``presence_penalty`` / ``frequency_penalty`` and
``logit_bias``, then greedy or seeded temperature / top-p sampling, and the log-probabilities
``logprobs`` asks for.

A row's random noise is the engine's counter-based Gumbel noise
(:class:`treeattn.engine.sampling.Sampler`) of its stream (:func:`~treeattn.engine.sampling.sample_streams`
of the request's seed, prompt and choice index) at its own output index, so a seeded request
samples what ``TreeEngine.generate(..., seed=seed)`` samples for it, whatever else shares its batch
or when it was admitted or preempted.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treeattn.engine.planning import upload
from treeattn.engine.sampling import (_GOLDEN32, _MASK32, LogNormaliser, _mix32, gumbel_noise,
                                      inverse_temperature)
from treeattn.launchers import gumbel_argmax

__all__ = ["RowOptions", "StepChoice", "choose_tokens"]


@dataclass
class RowOptions:
    """Host-side options of one step's rows (``n`` rows).

    Attributes
    ----------
    temperature, top_p : float64 ``[n]``
        ``temperature == 0``: greedy.
    seeds, streams, steps : int64 ``[n]``
        The request's seed, the row's random stream and its output index (the noise's counter).
    presence, frequency : float64 ``[n]``
        OpenAI's penalties, over the tokens the row generated so far (``outputs``).
    outputs : list of list of int
        Generated tokens per row (read only for rows with a penalty).
    bias : tuple of int64 / int64 / float64 arrays
        ``(rows, token ids, values)`` of every row's ``logit_bias`` entries.
    top_logprobs : int
        Alternatives reported per row (0: only the chosen token's log-probability).
    want_logprobs : bool
        Whether any row reports log-probabilities.
    """

    temperature: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray
    streams: np.ndarray
    steps: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    outputs: list
    bias: tuple
    top_logprobs: int = 0
    want_logprobs: bool = False


@dataclass
class StepChoice:
    """Device results of :func:`choose_tokens`: int64 ``tokens [n]``; with ``want_logprobs`` float32
    ``logprobs [n]`` and ``top_values`` / int64 ``top_ids [n, top_logprobs]``, else None."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None


def _counters(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]``: the noise counters of :meth:`Sampler.gumbel` with a seed and a step per row."""
    return _mix32((steps * _GOLDEN32 + seeds) & _MASK32)


def _penalised(logits: torch.Tensor, opt: RowOptions) -> torch.Tensor:
    """Logits less ``frequency * count + presence * (count > 0)`` of each row's generated tokens,
    plus its ``logit_bias`` (out of place: the engine keeps its logits)."""
    x = logits.float()
    n, vocab = x.shape
    dev = x.device
    pen = (opt.presence != 0) | (opt.frequency != 0)
    if pen.any():
        width = max((len(opt.outputs[r]) for r in np.flatnonzero(pen)), default=0)
        if width:
            ids = np.full((n, width), vocab, dtype=np.int64)       # column ``vocab``: padding
            for r in np.flatnonzero(pen):
                ids[r, : len(opt.outputs[r])] = opt.outputs[r]
            idx = upload(ids, dev)
            counts = torch.zeros(n, vocab + 1, device=dev).scatter_add_(1, idx, torch.ones_like(idx, dtype=x.dtype))
            counts = counts[:, :vocab]
            freq = upload(opt.frequency, dev, torch.float32)[:, None]
            pres = upload(opt.presence, dev, torch.float32)[:, None]
            x = x - counts * freq - (counts > 0).to(x.dtype) * pres
    rows, cols, vals = opt.bias
    if len(rows):
        x = x.index_put((upload(rows, dev), upload(cols, dev)), upload(vals, dev, torch.float32),
                        accumulate=True)
    return x


def _sampled(x: torch.Tensor, opt: RowOptions, greedy: np.ndarray) -> torch.Tensor:
    """int64 ``[n]``: every row's seeded draw from ``x`` at its temperature (greedy rows: 1) and
    top-p; on CUDA in one pass over ``x`` (two passes and a sort with top-p)."""
    dev = x.device
    inv = upload(inverse_temperature(np.where(greedy, 1.0, opt.temperature)), dev, torch.float32)
    streams = upload(opt.streams, dev)
    counters = _counters(upload(opt.seeds & _MASK32, dev), upload(opt.steps, dev))
    if (opt.top_p < 1).any():
        s = x * inv[:, None]
        sx, order = torch.sort(s, dim=-1, descending=True)
        p = torch.softmax(sx, dim=-1)
        top_p = upload(opt.top_p, dev, torch.float32)[:, None]
        drop = (p.cumsum(-1) - p) >= top_p          # the most likely token always stays
        s, scale = s.scatter(-1, order, sx.masked_fill(drop, float("-inf"))), 1.0
    else:
        s, scale = x, inv
    if x.is_cuda:
        return gumbel_argmax(s, streams=streams, counter=counters, scale=scale)[0]
    if scale is inv:
        s = x * inv[:, None]
    return (s + gumbel_noise(streams, counters, x.shape[-1])).argmax(dim=-1)


def choose_tokens(logits: torch.Tensor, opt: RowOptions) -> StepChoice:
    """One token per row of ``logits`` (float32 ``[n, vocab]``), without waiting for the device.

    Log-probabilities are those of the penalised and biased logits at temperature 1 (the model's
    distribution as the request shaped it, before temperature and top-p), as vLLM reports them.
    """
    x = _penalised(logits, opt)
    greedy = opt.temperature == 0
    norm = None
    if opt.want_logprobs and x.is_cuda:
        # the greedy tokens and the log-probabilities' normaliser in one pass
        tokens, norm = gumbel_argmax(x, stats=True)
    else:
        tokens = x.argmax(dim=-1) if greedy.any() else None
    if not greedy.all():
        sampled = _sampled(x, opt, greedy)
        tokens = torch.where(upload(greedy, x.device, torch.bool), tokens, sampled) if greedy.any() else sampled
    out = StepChoice(tokens)
    if opt.want_logprobs:
        k = min(opt.top_logprobs, x.shape[-1])
        if norm is not None:
            out.logprobs = LogNormaliser(x, 1.0, norm).logprobs(tokens)
            if k:
                top, out.top_ids = torch.topk(x, k, dim=-1)
                out.top_values = (top - norm[:, :1]) - norm[:, 1:]
        else:
            lp = torch.log_softmax(x, dim=-1)
            out.logprobs = lp.gather(-1, tokens[:, None]).squeeze(-1)
            if k:
                out.top_values, out.top_ids = torch.topk(lp, k, dim=-1)
    return out
