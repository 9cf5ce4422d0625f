"""Probe: the attention kernel with int32 element offsets (what the launcher picks unless a tensor
spans 2^31 elements) against int64 ones (``WIDE``, forced), the same plans timed alternately in
one process.

Premise (session 38, Nsight Compute on an H200, ``ncu_s38.txt``): the masked path tiles of the
deep 1024-leaf trees and the leaf launches are bound by issuing instructions (2 warps a
scheduler; ALU the busiest pipe at 30-43%), and int64 adds and multiplies are most of their
integer work. Each case's ``auto`` plan is made twice (two plans, two launch caches) and run
once per round with ``treeattn.ops._wide`` patched to report a span of 2^31 elements for the
``int64`` one (session 38's runs patched the function it replaced, ``_span``, alike;
:func:`check_gpu.ab_suite`); both outputs are checked against an fp32 reference.

Usage::

    python benchmarks/probe_wide.py [--trees ...] [--heads 32/8,64/8] [--rounds 3] [--out FILE]
"""
from __future__ import annotations

from check_gpu import ab_parser, ab_suite

import treeattn.ops as ops


def main() -> None:
    args = ab_parser(__doc__.split("\n\n")[0]).parse_args()
    patches = {"int32": {"_wide": ops._wide}, "int64": {"_wide": lambda *args: True}}
    ab_suite(args, patches, ops, base="int64")


if __name__ == "__main__":
    main()
