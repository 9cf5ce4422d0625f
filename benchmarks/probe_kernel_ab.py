"""Probe: the attention kernel of this checkout against another version of
``treeattn/kernels/attention.py`` (``--baseline FILE``), and any more versions (``--variant
NAME=FILE``), the same plans timed alternately in one process.

Each case's ``auto`` plan is made once for each version (one launch cache each); ``treeattn.ops``
launches that version's ``_tree_partial_attention_kernel`` for it (:func:`check_gpu.ab_suite`).
Every output is checked against an fp32 reference; times are CUDA-graph replays (L2 flushed), each
plan once a round over ``--rounds`` rounds, and the best round of each is compared with the
baseline's.

Usage::

    python benchmarks/probe_kernel_ab.py --baseline OLD_attention.py [--variant NAME=FILE ...] [--trees ...]
                                         [--heads 32/8,64/8] [--rounds 3] [--out FILE]
"""
from __future__ import annotations

import importlib.util

from check_gpu import ab_parser, ab_suite

import treeattn.ops as ops


def load_kernel(path: str):
    """``_tree_partial_attention_kernel`` of the module at ``path`` (its imports resolve in this
    checkout's package)."""
    spec = importlib.util.spec_from_file_location("baseline_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._tree_partial_attention_kernel


def main() -> None:
    ap = ab_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="another version of kernels/attention.py")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                    help="one more version of kernels/attention.py to time (repeatable)")
    args = ap.parse_args()
    name = "_tree_partial_attention_kernel"
    variants = dict(v.split("=", 1) for v in args.variant)
    patches = {"base": {name: load_kernel(args.baseline)}, "new": {name: getattr(ops, name)},
               **{v: {name: load_kernel(path)} for v, path in variants.items()}}
    ab_suite(args, patches, ops, base="base", extra={"baseline": args.baseline, "variants": variants})


if __name__ == "__main__":
    main()
