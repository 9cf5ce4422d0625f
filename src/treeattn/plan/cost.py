"""Device cost model shared by planners that balance work and by ``auto``.

Constants describe an NVIDIA H200 (132 SMs, ~4.25 TB/s copy bandwidth); they only steer choices,
so plans are identical on every host (tests on CPU plan exactly what the GPU runs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treeattn.plan.plan import HeadConfig


@dataclass(frozen=True)
class CostModel:
    num_sms: int = 132
    #: bytes per second a full GPU streams from HBM
    bandwidth: float = 4.25e12
    #: bytes per second one program streams when few run (latency-bound tail)
    program_bandwidth: float = 0.1e12
    launch_overhead_s: float = 3e-6
    program_overhead_s: float = 1.0e-6
    #: programs the attention grid should have before long items are split
    target_programs: int = 264
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
                 *, masked: bool = False, launches: int = 1) -> float:
        """Seconds for one run of items with these lengths and query counts (attention + merge)."""
        from treeattn.plan.plan import BLOCK_M_CHOICES

        group, hkv, d, eb = heads.group, heads.num_kv_heads, heads.head_dim, heads.elem_bytes
        q_per_tile = max(1, max(BLOCK_M_CHOICES) // group)
        tiles = -(-item_queries // q_per_tile)
        kv_bytes = item_len * hkv * d * 2 * eb * (1.1 if masked else 1.0)
        rows = int(item_queries.sum())
        partial_bytes = rows * heads.num_qo_heads * (d + 1) * 4 * 2
        q_bytes = rows * heads.num_qo_heads * d * eb
        total = float((kv_bytes * tiles).sum()) + partial_bytes + q_bytes
        programs = int(tiles.sum()) * hkv
        longest = float((kv_bytes / hkv).max()) if item_len.size else 0.0
        stream = max(total / self.bandwidth, longest / self.program_bandwidth)
        return (stream + programs * self.program_overhead_s / self.num_sms
                + (launches + 1) * self.launch_overhead_s)
