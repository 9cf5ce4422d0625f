"""Lowering: work items -> a :class:`~treeattn.plan.format.Plan` of int32 tensors (addressing,
merge configuration, tree mask), and the lazy update that patches a plan for appended tokens."""
