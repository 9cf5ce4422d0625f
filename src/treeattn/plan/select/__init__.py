"""Selection: the cost model that rates item sets by the launches they would make, and ``auto``,
which keeps the fastest-rated strategy."""
