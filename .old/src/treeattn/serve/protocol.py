"""OpenAI-compatible ``/v1/completions`` request validation and response bodies.

Validation is hand-written (no schema library) so that every problem becomes a 400 with an
OpenAI-style JSON error naming the field. Unknown fields are ignored, as OpenAI clients send
extras; features the server lacks (``logprobs``, ``echo``, ``best_of``, ``suffix``, stop strings)
are rejected when asked for.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from treeattn.serve.scheduler import SamplingParams

__all__ = ["ProtocolError", "Completion", "parse_completion", "error_body", "completion_body",
           "chunk_body", "MAX_N"]

#: most choices per request
MAX_N = 64

#: fields of OpenAI's API this server lacks, with the values that mean "not used"
_UNSUPPORTED = (("logprobs", (None,)), ("echo", (None, False)), ("best_of", (None, 1)),
                ("suffix", (None, "")), ("stop", (None, "")))


class ProtocolError(ValueError):
    """A request the server refuses: ``status`` (HTTP code), message and the offending ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


@dataclass(frozen=True)
class Completion:
    """A validated completion request."""

    prompt_ids: list
    params: SamplingParams
    stream: bool
    model: str


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _int(body: dict, name: str, default, lo: int, hi: int | None = None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"'{name}' must be an integer, got {json.dumps(v)}", name)
    if v < lo or (hi is not None and v > hi):
        raise ProtocolError(f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}", name)
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProtocolError(f"'{name}' must be a number, got {json.dumps(v)}", name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise ProtocolError(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _prompt(body: dict, tokenizer, vocab_size: int) -> list:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                                   # a batch of one prompt
    if isinstance(p, str):
        if tokenizer is None:
            raise ProtocolError("this model has no tokenizer: send 'prompt' as token ids", "prompt")
        ids = tokenizer.encode(p).ids
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        ids = list(p)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ProtocolError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
    elif p is None:
        raise ProtocolError("'prompt' is required", "prompt")
    else:
        raise ProtocolError("'prompt' must be a string or a list of token ids (one prompt per request)",
                            "prompt")
    if not ids:
        raise ProtocolError("'prompt' must not be empty", "prompt")
    return ids


def parse_completion(raw: bytes, *, model_name: str, tokenizer, vocab_size: int, max_model_len: int,
                     fits=None) -> Completion:
    """Validate a ``/v1/completions`` body.

    Parameters
    ----------
    raw : bytes
        The HTTP body.
    max_model_len : int
        Longest prompt plus ``max_tokens``.
    fits : callable ``(prompt_len, max_tokens, n) -> bool``, optional
        Whether the KV cache can hold the request at all.

    Raises
    ------
    ProtocolError
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ProtocolError("the body must be a JSON object")
    model = body.get("model", model_name)
    if model != model_name:
        raise ProtocolError(f"the model '{model}' does not exist; this server serves '{model_name}'",
                            "model", status=404, kind="not_found_error")
    for name, allowed in _UNSUPPORTED:
        v = body.get(name)
        if v not in allowed and v != []:
            raise ProtocolError(f"'{name}' is not supported by this server", name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ProtocolError(f"'stream' must be a boolean, got {json.dumps(stream)}", "stream")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ProtocolError(f"'ignore_eos' must be a boolean, got {json.dumps(ignore_eos)}", "ignore_eos")
    ids = _prompt(body, tokenizer, vocab_size)
    params = SamplingParams(
        max_tokens=_int(body, "max_tokens", 16, 1), temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), n=_int(body, "n", 1, 1, MAX_N),
        seed=_int(body, "seed", None, 0, 2**63 - 1), ignore_eos=ignore_eos)
    if len(ids) + params.max_tokens > max_model_len:
        raise ProtocolError(f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) "
                            f"exceeds the model's limit of {max_model_len} tokens", "prompt")
    if fits is not None and not fits(len(ids), params.max_tokens, params.n):
        raise ProtocolError(f"the prompt ({len(ids)} tokens) with n={params.n} x max_tokens="
                            f"{params.max_tokens} does not fit in the KV cache", "max_tokens")
    return Completion(ids, params, stream, model_name)


def _usage(prompt_len: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens,
            "total_tokens": prompt_len + completion_tokens}


def completion_body(rid: str, created: int, model: str, choices: list, prompt_len: int) -> dict:
    """The non-streaming response; ``choices``: ``(text, token_ids, finish_reason)`` per choice."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": text, "token_ids": ids, "logprobs": None,
                         "finish_reason": fin} for i, (text, ids, fin) in enumerate(choices)],
            "usage": _usage(prompt_len, sum(len(ids) for _, ids, _ in choices))}


def chunk_body(rid: str, created: int, model: str, deltas: list) -> dict:
    """One streamed chunk; ``deltas``: ``(index, text, token_ids, finish_reason)``."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": text, "token_ids": ids, "logprobs": None,
                         "finish_reason": fin} for i, text, ids, fin in deltas]}
