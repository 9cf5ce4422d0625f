"""Device cost model shared by planners that balance work and by ``auto``.

Constants describe an NVIDIA H200 (132 SMs, ~4.25 TB/s copy bandwidth); the per-program and merge
constants were fitted to the measured latencies of every strategy on the kernel suite
(benchmarks/results/h200_check_gpu.json, benchmarks/NOTES.md). They only steer choices, so plans
are identical on every host (tests on CPU plan exactly what the GPU runs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treeattn.plan.plan import BLOCK_M_CHOICES, HeadConfig


@dataclass(frozen=True)
class CostModel:
    num_sms: int = 132
    #: bytes per second the whole GPU streams from HBM
    bandwidth: float = 4.25e12
    #: bytes per second one program streams on its own (its loop is latency-bound)
    program_bandwidth: float = 10e9
    #: fixed cost of one program (index, query and output round trips) and programs in flight per SM
    program_overhead_s: float = 2e-6
    programs_per_sm: int = 8
    #: one merge step (one partial row of one query) and a kernel launch
    merge_step_s: float = 1e-6
    launch_overhead_s: float = 2e-6
    #: programs the attention grid should have before long items are split
    target_programs: int = 1056
    min_split_tokens: int = 256
    #: DeFT's KV chunk / block size
    deft_chunk_tokens: int = 128
    # FastTree's padding and reduction coefficients (alpha, beta, gamma) and tile sizes
    fasttree_alpha: float = 1.0
    fasttree_beta: float = 1.0
    fasttree_gamma: float = 4.0
    fasttree_tile_q: int = 16
    fasttree_tile_kv: int = 64

    def estimate(self, item_len: np.ndarray, item_queries: np.ndarray, heads: HeadConfig,
                 *, merge_rows_max: int = 1) -> float:
        """Seconds for one run of items with these KV lengths and query counts.

        Attention: every query tile of every item is one program per KV head, costing a fixed
        overhead plus its bytes at single-program bandwidth; programs run ``programs_per_sm`` to
        an SM, and the whole grid cannot beat HBM bandwidth. Merge: partial rows written and read
        at HBM bandwidth, plus the longest chain of merge steps.
        """
        group, hkv, d, eb = heads.group, heads.num_kv_heads, heads.head_dim, heads.elem_bytes
        q_per_tile = max(1, max(BLOCK_M_CHOICES) // group)
        tiles = -(-item_queries // q_per_tile)
        prog_bytes = item_len * d * 2 * eb  # K and V of one KV head
        prog_time = self.program_overhead_s + prog_bytes / self.program_bandwidth
        slots = self.num_sms * self.programs_per_sm
        attn = max(float((prog_time * tiles).sum()) * hkv / slots,
                   float(prog_time.max()) if prog_time.size else 0.0,
                   float((prog_bytes * tiles).sum()) * hkv / self.bandwidth)
        rows = int(item_queries.sum())
        merge = (rows * heads.num_qo_heads * (d + 1) * 8 / self.bandwidth
                 + merge_rows_max * self.merge_step_s)
        return attn + merge + 2 * self.launch_overhead_s
