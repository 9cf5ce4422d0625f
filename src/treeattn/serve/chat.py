"""A model's chat template, rendered as Hugging Face transformers' ``apply_chat_template`` renders it.

The template is the Jinja source in the model directory's ``tokenizer_config.json``
(``chat_template``: a string, or a list of named templates whose ``default`` is used) or in
``chat_template.jinja``. It runs in jinja2's immutable sandbox with transformers' settings
(``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps
non-ASCII text, the ``raise_exception`` and ``strftime_now`` globals), and sees ``messages``,
``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

__all__ = ["ChatTemplate"]

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _raise(message: str):
    raise ValueError(message)


def _token_text(v) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken dict."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class ChatTemplate:
    """A compiled chat template.

    Parameters
    ----------
    source : str
        The Jinja template.
    special_tokens : dict, optional
        ``bos_token``, ``eos_token``, ... as strings, visible to the template.
    """

    def __init__(self, source: str, *, special_tokens: dict | None = None):
        try:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:
            raise ImportError("chat templates need jinja2 (pip install 'treeattn[serve]')") from e

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._template = env.from_string(source)

    @classmethod
    def from_pretrained(cls, model_dir) -> ChatTemplate | None:
        """The template of a Hugging Face model directory, or None when it has none."""
        d = Path(model_dir)
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        source = cfg.get("chat_template")
        if isinstance(source, list):           # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None and (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text()
        if not isinstance(source, str):
            return None
        return cls(source, special_tokens={k: _token_text(cfg.get(k)) for k in _SPECIAL})

    def render(self, messages: list, *, add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (a list of ``{"role", "content"}``); tokenize it without
        adding special tokens (the template writes them)."""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens)
