"""Benchmarks: device timing helpers and the ``treeattn bench`` commands (CUDA only)."""
