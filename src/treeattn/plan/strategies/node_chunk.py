"""``node_chunk``: DeFT-Node-Chunk, DeFT-Node with large nodes cut into fixed chunks
(128 tokens, DeFT's choice) for a weak load balance."""
from __future__ import annotations

from treeattn.plan.select.cost import CostModel
from treeattn.plan.strategies.items import WorkItems
from treeattn.plan.strategies.node import node_items
from treeattn.plan.format import HeadConfig
from treeattn.plan.strategies.split import split_long_items
from treeattn.tree import DecodingTree


def plan_node_chunk(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    chunk = cost.deft_chunk_tokens
    return split_long_items(node_items(tree), chunk), f"node_chunk: nodes cut into {chunk}-token chunks"
