"""Decoding trees: the read-only :class:`DecodingTree`, its vectorised topology, and builders of
trees from kernel-suite specs, block tables, Tree-of-Thoughts templates and Medusa token trees, the
built-in workload-shaped trees by family, and the tree a sliding-window layer's queries see."""
from treeattn.tree.decoding_tree import DecodingTree
from treeattn.tree.builders import (find_shared, load_kernel_suite, medusa_records, suite_trees,
                                    tree_from_block_tables, tree_from_medusa, tree_from_spec,
                                    tree_from_tot_template)
from treeattn.tree.families import (WORKLOAD_FAMILIES, WorkloadTree, tree_by_name, tree_family, workload_names,
                                    workload_tree, workload_trees)
from treeattn.tree.window import window_tree

__all__ = ["DecodingTree", "find_shared", "load_kernel_suite", "suite_trees", "tree_from_spec",
           "tree_from_block_tables", "tree_from_tot_template", "tree_from_medusa", "medusa_records", "window_tree",
           "WORKLOAD_FAMILIES", "WorkloadTree", "workload_names", "workload_tree", "workload_trees", "tree_by_name",
           "tree_family"]
