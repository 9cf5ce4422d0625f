"""The ``treeattn`` command line: ``demo``, ``attention``, ``run``, ``serve``, ``bench``."""
from treeattn.cli.main import main

__all__ = ["main"]
