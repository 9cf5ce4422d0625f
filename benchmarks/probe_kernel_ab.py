"""Probe: the attention kernel of this checkout against another version of
``treeattn/kernels/attention.py`` (``--baseline FILE``), the same plans timed alternately in one
process.

Each case's ``auto`` plan is made twice (two plans, two launch caches); ``treeattn.ops`` launches
the baseline's ``_tree_partial_attention_kernel`` for one and this checkout's for the other
(:func:`check_gpu.ab_suite`). Both outputs are checked against an fp32 reference; times are
CUDA-graph replays (L2 flushed), each plan once a round over ``--rounds`` rounds, and the best
round of each is compared.

Usage::

    python benchmarks/probe_kernel_ab.py --baseline OLD_attention.py [--trees ...] [--heads 32/8,64/8]
                                         [--rounds 3] [--out FILE]
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
    args = ap.parse_args()
    name = "_tree_partial_attention_kernel"
    patches = {"base": {name: load_kernel(args.baseline)}, "new": {name: getattr(ops, name)}}
    ab_suite(args, patches, ops, base="base", new="new", extra={"baseline": args.baseline})


if __name__ == "__main__":
    main()
