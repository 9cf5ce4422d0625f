"""Planners: one file per strategy, each turning a tree into work items (runs of KV tokens and the
queries that share them); the shared item, split, lead and leaf-packing helpers beside them."""
