"""Decoding trees: the read-only :class:`DecodingTree`, its vectorised topology, and builders of
trees from kernel-suite specs, block tables, Tree-of-Thoughts templates and Medusa token trees."""
from treeattn.tree.decoding_tree import DecodingTree
from treeattn.tree.builders import (find_shared, load_kernel_suite, medusa_records, suite_trees,
                                    tree_from_block_tables, tree_from_medusa, tree_from_spec,
                                    tree_from_tot_template)

__all__ = ["DecodingTree", "find_shared", "load_kernel_suite", "suite_trees", "tree_from_spec",
           "tree_from_block_tables", "tree_from_tot_template", "tree_from_medusa", "medusa_records"]
