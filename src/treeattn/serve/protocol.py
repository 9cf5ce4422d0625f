"""OpenAI-compatible request validation (``/v1/completions``, ``/v1/chat/completions``) and
response bodies.

Validation is hand-written (no schema library) so that every problem becomes a 400 with an
OpenAI-style JSON error naming the field. Every field of a request is either implemented or
refused by name (a ``null`` value means "not used" and is accepted): nothing is silently ignored.

Extensions, as vLLM users know them: ``ignore_eos``, ``stop_token_ids``, ``use_beam_search`` (with
``best_of`` beams, default ``n``), ``length_penalty`` and ``early_stopping`` (beam search only);
completions return each choice's ``token_ids``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from treeattn.serve.scheduler import SamplingParams

__all__ = ["ProtocolError", "GenerationRequest", "parse_completion", "parse_chat", "error_body", "MAX_N",
           "MAX_LOGPROBS", "usage_body"]

#: most choices (or beams) per request
MAX_N = 64
#: most alternatives per token in ``logprobs`` / ``top_logprobs``
MAX_LOGPROBS = 20
#: most stop strings per request (OpenAI's limit)
MAX_STOP = 4

_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
                     "presence_penalty", "frequency_penalty", "logit_bias", "seed", "user", "ignore_eos",
                     "stop_token_ids", "use_beam_search", "best_of", "length_penalty", "early_stopping"})
_COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo"}
_CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
_ROLES = frozenset({"system", "developer", "user", "assistant"})


class ProtocolError(ValueError):
    """A request the server refuses: ``status`` (HTTP code), message and the offending ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request of either endpoint.

    ``params.n`` sequences are generated (``best_of`` of them when sampling with ``best_of``);
    ``n`` are returned. ``logprobs``: alternatives per token to report (None: no log-probabilities;
    ``params.logprobs`` may ask for them anyway, to rank ``best_of`` samples).
    """

    prompt_ids: list
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo: bool
    model: str


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage_body(prompt_len: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens,
            "total_tokens": prompt_len + completion_tokens}


def _dump(v) -> str:
    return json.dumps(v)[:80]


def _int(body: dict, name: str, default, lo: int, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"'{name}' must be an integer, got {_dump(v)}", name)
    if v < lo or (hi is not None and v > hi):
        raise ProtocolError(f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}", name)
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProtocolError(f"'{name}' must be a number, got {_dump(v)}", name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise ProtocolError(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ProtocolError(f"'{name}' must be a boolean, got {_dump(v)}", name)
    return v


def _token_ids(v, name: str, vocab_size: int) -> list:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise ProtocolError(f"'{name}' must be a list of token ids", name)
    bad = [t for t in v if not 0 <= t < vocab_size]
    if bad:
        raise ProtocolError(f"token id {bad[0]} in '{name}' is outside the vocabulary [0, {vocab_size})", name)
    return list(v)


def _load(raw: bytes, model_name: str, allowed: frozenset) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ProtocolError("the body must be a JSON object")
    for name in sorted(body):
        if name not in allowed and body[name] is not None:
            raise ProtocolError(f"'{name}' is not supported by this server", name)
    model = body.get("model", model_name)
    if model != model_name:
        raise ProtocolError(f"the model '{model}' does not exist; this server serves '{model_name}'",
                            "model", status=404, kind="not_found_error")
    return body


def _prompt(body: dict, tokenizer, vocab_size: int) -> list:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                                   # a batch of one prompt
    if isinstance(p, str):
        if tokenizer is None:
            raise ProtocolError("this model has no tokenizer: send 'prompt' as token ids", "prompt")
        ids = tokenizer.encode(p).ids
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        ids = _token_ids(p, "prompt", vocab_size)
    elif p is None:
        raise ProtocolError("'prompt' is required", "prompt")
    else:
        raise ProtocolError("'prompt' must be a string or a list of token ids (one prompt per request)",
                            "prompt")
    if not ids:
        raise ProtocolError("'prompt' must not be empty", "prompt")
    return ids


def _messages(body: dict) -> list:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ProtocolError("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ProtocolError(f"'{where}' must be an object", "messages")
        for key in m:
            if key not in ("role", "content", "name") and m[key] is not None:
                raise ProtocolError(f"'{where}.{key}' is not supported by this server", "messages")
        if m.get("role") not in _ROLES:
            raise ProtocolError(f"'{where}.role' must be one of {sorted(_ROLES)}, got {_dump(m.get('role'))}",
                                "messages")
        content = m.get("content")
        if isinstance(content, list):         # content parts: only text is supported
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ProtocolError(f"'{where}.content' parts must be {{'type': 'text', 'text': ...}}",
                                        "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ProtocolError(f"'{where}.content' must be a string or a list of text parts", "messages")
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _stops(body: dict, tokenizer, vocab_size: int) -> tuple:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None or stop == []:
        stop = []
    elif (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
          or len(stop) > MAX_STOP):
        raise ProtocolError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    if stop and tokenizer is None:
        raise ProtocolError("this model has no tokenizer: stop strings need one (use 'stop_token_ids')", "stop")
    ids = body.get("stop_token_ids")
    ids = [] if ids is None else _token_ids(ids, "stop_token_ids", vocab_size)
    return tuple(stop), tuple(ids)


def _logit_bias(body: dict, vocab_size: int) -> tuple:
    lb = body.get("logit_bias")
    if lb is None:
        return ()
    if not isinstance(lb, dict):
        raise ProtocolError("'logit_bias' must map token ids to biases", "logit_bias")
    out = []
    for k, v in lb.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise ProtocolError(f"'logit_bias' key {_dump(k)} is not a token id", "logit_bias") from None
        if not 0 <= tok < vocab_size:
            raise ProtocolError(f"'logit_bias' token id {tok} is outside the vocabulary [0, {vocab_size})",
                                "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise ProtocolError(f"'logit_bias' values must be numbers in [-100, 100], got {_dump(v)}", "logit_bias")
        out.append((tok, float(v)))
    return tuple(out)


def _finish(body: dict, ids: list, *, logprobs: int | None, echo: bool, default_max: int | None,
            tokenizer, vocab_size: int, max_model_len: int, fits, model_name: str) -> GenerationRequest:
    """The fields both endpoints share, then the length and KV-cache checks."""
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise ProtocolError("'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(opts, dict):
            raise ProtocolError("'stream_options' must be an object", "stream_options")
        for key in opts:
            if key != "include_usage" and opts[key] is not None:
                raise ProtocolError(f"'stream_options.{key}' is not supported by this server", "stream_options")
        include_usage = _bool(opts, "include_usage")
    n = _int(body, "n", 1, 1, MAX_N)
    beam = _bool(body, "use_beam_search")
    best_of = _int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of < n:
        raise ProtocolError(f"'best_of' ({best_of}) must be >= 'n' ({n})", "best_of")
    stop, stop_ids = _stops(body, tokenizer, vocab_size)
    max_tokens = _int(body, "max_tokens", None, 1)
    if body.get("max_completion_tokens") is not None:
        mct = _int(body, "max_completion_tokens", None, 1)
        if max_tokens is not None and mct != max_tokens:
            raise ProtocolError("'max_tokens' and 'max_completion_tokens' differ", "max_completion_tokens")
        max_tokens = mct
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else max(1, max_model_len - len(ids))
    temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
    penalties = {name: _float(body, name, 0.0, -2.0, 2.0) for name in ("presence_penalty", "frequency_penalty")}
    bias = _logit_bias(body, vocab_size)
    seed = _int(body, "seed", None, 0, 2**63 - 1)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    for name in ("length_penalty", "early_stopping"):
        if body.get(name) is not None and not beam:
            raise ProtocolError(f"'{name}' needs 'use_beam_search': true", name)
    length_penalty = _float(body, "length_penalty", 1.0, -10.0, 10.0)
    early_stopping = _bool(body, "early_stopping")
    if beam:
        # beam search ranks the model's own log-probabilities: no sampling options apply
        for name, unused in (("temperature", temperature in (0.0,) or body.get("temperature") is None),
                             ("top_p", top_p == 1.0), ("presence_penalty", not penalties["presence_penalty"]),
                             ("frequency_penalty", not penalties["frequency_penalty"]), ("logit_bias", not bias),
                             ("seed", seed is None), ("stop", not stop), ("logprobs", logprobs is None)):
            if not unused:
                raise ProtocolError(f"'{name}' is not supported with 'use_beam_search'", name)
    elif best_of is not None and best_of > n and stream:
        raise ProtocolError("'best_of' larger than 'n' cannot be streamed", "best_of")
    width = (best_of or n) if beam else 1
    generated = n if beam else (best_of or n)
    ranked = not beam and generated > n          # best_of samples are ranked by cumulative logprob
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0 if beam else temperature, top_p=top_p, n=generated, seed=seed,
        ignore_eos=_bool(body, "ignore_eos"), presence_penalty=penalties["presence_penalty"],
        frequency_penalty=penalties["frequency_penalty"], logit_bias=bias, stop=stop, stop_token_ids=stop_ids,
        logprobs=logprobs if logprobs is not None else (0 if ranked else None), use_beam_search=beam,
        beam_width=width, length_penalty=length_penalty, early_stopping=early_stopping)
    if len(ids) + max_tokens > max_model_len:
        raise ProtocolError(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) "
                            f"exceeds the model's limit of {max_model_len} tokens", "prompt")
    seqs = width if beam else generated
    if fits is not None and not fits(len(ids), max_tokens, seqs):
        raise ProtocolError(f"the prompt ({len(ids)} tokens) with {seqs} sequences x max_tokens="
                            f"{max_tokens} does not fit in the KV cache", "max_tokens")
    return GenerationRequest(ids, params, n, stream, include_usage, logprobs, echo, model_name)


def parse_completion(raw: bytes, *, model_name: str, tokenizer, vocab_size: int, max_model_len: int,
                     fits=None) -> GenerationRequest:
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
    body = _load(raw, model_name, _COMPLETION_FIELDS)
    ids = _prompt(body, tokenizer, vocab_size)
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = _bool(body, "echo")
    if echo and logprobs is not None:
        raise ProtocolError("'echo' with 'logprobs' is not supported: the server does not compute the "
                            "prompt's log-probabilities", "echo")
    return _finish(body, ids, logprobs=logprobs, echo=echo, default_max=16, tokenizer=tokenizer,
                   vocab_size=vocab_size, max_model_len=max_model_len, fits=fits, model_name=model_name)


def parse_chat(raw: bytes, *, model_name: str, tokenizer, chat_template, vocab_size: int, max_model_len: int,
               fits=None) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body and render its messages with ``chat_template``
    (:class:`~treeattn.serve.chat.ChatTemplate`); arguments as :func:`parse_completion`."""
    body = _load(raw, model_name, _CHAT_FIELDS)
    msgs = _messages(body)
    if tokenizer is None or chat_template is None:
        raise ProtocolError("this model has no tokenizer and chat template: use /v1/completions", "messages")
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    try:
        text = chat_template.render(msgs, add_generation_prompt=True)
    except Exception as e:       # the template's own raise_exception() or a rendering error
        raise ProtocolError(f"the chat template failed on these messages: {e}", "messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise ProtocolError("the chat template rendered an empty prompt", "messages")
    return _finish(body, ids, logprobs=(top or 0) if want else None, echo=False, default_max=None,
                   tokenizer=tokenizer, vocab_size=vocab_size, max_model_len=max_model_len, fits=fits,
                   model_name=model_name)
