"""The engine's user API: :meth:`TreeEngine.generate` (parallel sampling over a forest of prompts)
and :meth:`TreeEngine.beam_search`, their output records and the argument checks they run before
any work.

>>> engine = TreeEngine(TreeModel.from_pretrained("Meta-Llama-3-8B-Instruct", device="cuda"))
>>> out = engine.generate(["The capital of France is", "1, 1, 2, 3, 5,"], n=4, temperature=0.8,
...                       top_p=0.95, seed=0, max_new_tokens=32)
>>> out[0].samples[2].text, out[0].samples[2].cumulative_logprob
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treeattn.engine.beam import BeamSearchController
from treeattn.engine.controller import SamplingController
from treeattn.engine.sampling import Sampler

__all__ = ["SampleOutput", "GenerationOutput", "BeamSearchOutput", "generate", "beam_search"]


@dataclass(frozen=True)
class SampleOutput:
    """One sampled continuation.

    Attributes
    ----------
    token_ids : list of int
        The generated tokens (the prompt excluded; a stop token that ended the sample included).
    text : str or None
        ``token_ids`` decoded by the model's tokenizer (special tokens skipped); None without one.
    logprobs : list of float or None
        Log-probability of each generated token under the distribution it was drawn from: the
        temperature-scaled logits after top-k / top-p filtering; with ``temperature=0`` (greedy)
        the model's own distribution. None when not requested.
    cumulative_logprob : float or None
        Their sum.
    finish_reason : {"stop", "length"}
        A stop token ended it, or it reached ``max_new_tokens``.
    """

    token_ids: list
    text: str | None
    logprobs: list | None
    cumulative_logprob: float | None
    finish_reason: str


@dataclass(frozen=True)
class GenerationOutput:
    """The ``n`` samples of one prompt.

    Attributes
    ----------
    prompt_token_ids : list of int
    samples : list of SampleOutput
        Sample ``j`` first.
    """

    prompt_token_ids: list
    samples: list


@dataclass(frozen=True)
class BeamSearchOutput:
    """The best beams of a beam search, best first.

    Attributes
    ----------
    prompt_token_ids : list of int
    sequences : list of list of int
        Generated tokens of each returned beam (the prompt excluded).
    scores : list of float
        Their length-penalised scores (``sum log p / generated_len ** length_penalty``).
    text : list of str or None
        ``sequences`` decoded by the model's tokenizer; None without one.
    """

    prompt_token_ids: list
    sequences: list
    scores: list
    text: list | None


# ---------------------------------------------------------------------- checks
def _tokenize(engine, prompts) -> list:
    """Token-id lists of ``prompts`` (one str or id list, or a sequence of them), checked."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and all(isinstance(t, (int, np.integer)) for t in prompts)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings or token-id lists")
    tok = engine.model.tokenizer
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tok is None:
                raise ValueError(f"prompt {i} is text but the model has no tokenizer (tokenizer.json); "
                                 "pass token ids")
            ids = tok.encode(p).ids
        elif isinstance(p, (list, tuple, np.ndarray)) and all(isinstance(t, (int, np.integer)) for t in p):
            ids = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        _check_ids(engine, ids, f"prompt {i}")
        out.append(ids)
    return out


def _check_ids(engine, ids, what: str) -> None:
    vocab = engine.model.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what}: token id {bad[0]} is out of the model's vocabulary [0, {vocab})")


def _check_int(value, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {value}")
    return int(value)


def _check_idle(engine) -> None:
    if engine.tree.num_nodes:
        raise ValueError("the engine holds sequences of an earlier run; call reset() first")


def _check_pages(engine, prompts, width: int, max_new_tokens: int) -> None:
    """Refuse a request whose KV cannot fit: each prompt's pages plus ``width`` private tails of
    ``max_new_tokens`` tokens (a lower bound of what decoding allocates)."""
    p = engine.pool.page_size
    need = 0
    for ids in prompts:
        if width == 1:
            need += -(-(len(ids) + max_new_tokens) // p)
        else:
            need += -(-len(ids) // p) + width * -(-max_new_tokens // p)
    free = engine.pool.num_free_pages
    if need > free:
        raise ValueError(f"the request needs at least {need} KV pages of {p} tokens but the pool has {free} "
                         f"free; build the engine with a larger kv_tokens or ask for fewer tokens")


def _decode(tok, ids) -> str | None:
    return tok.decode(ids) if tok is not None else None


# ---------------------------------------------------------------------- entry points
def generate(engine, prompts, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             seed: int | None = None, max_new_tokens: int = 16, stop_token_ids=(), ignore_eos: bool = False,
             logprobs: bool = True, prune_every: int = 8) -> list:
    """Sample ``n`` continuations of every prompt (see :meth:`TreeEngine.generate`)."""
    prompts = _tokenize(engine, prompts)
    n = _check_int(n, "n", 1)
    max_new_tokens = _check_int(max_new_tokens, "max_new_tokens", 1)
    top_k = _check_int(top_k, "top_k", 0)
    prune_every = _check_int(prune_every, "prune_every", 1)
    if not (isinstance(temperature, (int, float)) and np.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None:
        seed = _check_int(seed, "seed", 0)
    stops = [int(t) for t in stop_token_ids]
    _check_ids(engine, stops, "stop_token_ids")
    if not ignore_eos:
        stops += list(engine.model.config.eos_token_ids)
    _check_idle(engine)
    _check_pages(engine, prompts, n, max_new_tokens)

    if seed is None:      # fresh entropy, as an unseeded sampler would draw
        seed = int(np.random.SeedSequence().entropy % 2**63)
    sampler = Sampler(greedy=True) if temperature == 0 else Sampler(temperature, top_k, top_p, seed=seed)
    ctl = SamplingController(prompts, n=n, sampler=sampler, max_new_tokens=max_new_tokens, eos_token_ids=stops,
                             prune_every=prune_every, logprobs=logprobs)
    tok = engine.model.tokenizer
    try:
        leaves = engine.run(ctl)["leaves"]
    finally:
        engine.reset()
    grid = [[None] * n for _ in prompts]
    for leaf in leaves:
        ids = leaf["tokens"][len(prompts[leaf["prompt"]]):]
        lps = leaf["logprobs"]
        grid[leaf["prompt"]][leaf["sample"]] = SampleOutput(
            token_ids=ids, text=_decode(tok, ids), logprobs=lps,
            cumulative_logprob=float(sum(lps)) if lps is not None else None,
            finish_reason="stop" if leaf["finished"] else "length")
    return [GenerationOutput(prompt_token_ids=p, samples=row) for p, row in zip(prompts, grid)]


def beam_search(engine, prompt, *, num_beams: int = 4, max_new_tokens: int = 16, length_penalty: float = 1.0,
                early_stopping=False, eos_token_ids=(), num_return_sequences: int | None = None
                ) -> BeamSearchOutput:
    """Beam search over one prompt (see :meth:`TreeEngine.beam_search`)."""
    if isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError("prompt is empty")
    if not isinstance(prompt, str) and isinstance(prompt, (list, tuple)) \
            and not all(isinstance(t, (int, np.integer)) for t in prompt):
        raise ValueError("beam_search takes one prompt: a string or a list of token ids")
    ids = _tokenize(engine, prompt)[0]
    vocab = engine.model.config.vocab_size
    num_beams = _check_int(num_beams, "num_beams", 1, vocab)
    max_new_tokens = _check_int(max_new_tokens, "max_new_tokens", 1)
    if num_return_sequences is not None:
        num_return_sequences = _check_int(num_return_sequences, "num_return_sequences", 1, num_beams)
    if not (isinstance(length_penalty, (int, float)) and np.isfinite(length_penalty)):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    eos = [int(t) for t in eos_token_ids]
    _check_ids(engine, eos, "eos_token_ids")
    _check_idle(engine)
    _check_pages(engine, [ids], num_beams, max_new_tokens)

    ctl = BeamSearchController(ids, num_beams=num_beams, max_new_tokens=max_new_tokens,
                               length_penalty=length_penalty, early_stopping=early_stopping, eos_token_ids=eos,
                               num_return_sequences=num_return_sequences)
    try:
        out = engine.run(ctl)
    finally:
        engine.reset()
    seqs = [s[len(ids):] for s in out["sequences"]]
    tok = engine.model.tokenizer
    return BeamSearchOutput(prompt_token_ids=ids, sequences=seqs, scores=list(out["scores"]),
                            text=[tok.decode(s) for s in seqs] if tok is not None else None)
