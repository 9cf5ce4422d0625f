"""Argument types and checks shared by the ``treeattn`` sub-commands.

Each ``*_arg`` function is an argparse ``type=``: it turns the text into a value or raises
:class:`argparse.ArgumentTypeError`, so a bad value ends in a one-line ``treeattn <cmd>: error:``
and exit status 2 before the command does any work.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from treeattn import STRATEGIES

__all__ = ["CliParser", "LOG_LEVELS", "add_log_level", "device_arg", "heads_arg", "heads_list_arg",
           "positive_int", "nonnegative_int", "positive_float", "probability", "strategies_arg",
           "tree_spec_arg", "existing_dir", "existing_file", "prepare_output", "error"]

LOG_LEVELS = ("debug", "info", "warning", "error")


class CliParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose usage errors are one line on stderr (exit 2):
    ``treeattn <cmd>: error: <message>``; ``--help`` still shows the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_log_level(p) -> None:
    """``--log-level`` on a (sub-)parser; unset on a sub-command keeps the top-level choice."""
    p.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                   help="least severe log messages shown on stderr (default: info)")


def positive_int(text: str) -> int:
    return _number(text, int, lambda x: x >= 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _number(text, int, lambda x: x >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    return _number(text, float, lambda x: x > 0, "a number > 0")


def probability(text: str) -> float:
    return _number(text, float, lambda x: 0 < x <= 1, "a number in (0, 1]")


def _number(text: str, kind, ok, what: str):
    try:
        x = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(x):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return x


def heads_arg(text: str) -> tuple[int, int]:
    """``"Q/KV"`` query and KV head counts, both >= 1, Q a multiple of KV (grouped-query attention)."""
    parts = text.split("/")
    try:
        hq, hkv = (int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected query/KV heads such as 32/8, got {text!r}") from None
    if hq < 1 or hkv < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(f"query heads must be a positive multiple of the KV heads, got {text!r}")
    return hq, hkv


def heads_list_arg(text: str) -> list[tuple[int, int]]:
    """Comma-separated ``Q/KV`` head configs (:func:`heads_arg`)."""
    heads = [heads_arg(h.strip()) for h in text.split(",") if h.strip()]
    if not heads:
        raise argparse.ArgumentTypeError("expected at least one query/KV heads pair such as 32/8")
    return heads


def strategies_arg(text: str) -> list[str]:
    """Comma-separated names from :data:`treeattn.STRATEGIES` (at least one, no repeats)."""
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [s for s in names if s not in STRATEGIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown strategies {', '.join(bad) or '(none given)'}; "
                                         f"expected a comma-separated list from {', '.join(STRATEGIES)}")
    return names


def tree_spec_arg(text: str) -> str:
    """A kernel-suite tree spec ``sizes_lengths`` (checked by building the tree)."""
    from treeattn.tree import tree_from_spec

    try:
        tree_from_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def device_arg(text: str) -> str:
    """``cpu`` or ``cuda`` (the latter only where PyTorch sees a GPU)."""
    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    if text == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("cuda: PyTorch sees no CUDA GPU on this machine "
                                         f"(torch {torch.__version__}); use --device cpu")
    return text


def existing_dir(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"directory {text!r} does not exist")
    return text


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"file {text!r} does not exist")
    return text


def prepare_output(path: str | None, option: str) -> str | None:
    """Create the parent folders of an output ``path`` before any work, so a path that cannot be
    written fails at once instead of after a long run. Raises ValueError naming ``option``."""
    if not path:
        return path
    parent = Path(path).expanduser().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot create folder {parent}: {e.strerror}") from None
    if Path(path).is_dir():
        raise ValueError(f"{option} {path}: is a folder, expected a file name")
    return str(Path(path).expanduser())


def error(prog: str, err: Exception) -> int:
    """Report a bad input found while a command runs: one line on stderr, exit status 2."""
    print(f"{prog}: error: {err}", file=sys.stderr)
    return 2
