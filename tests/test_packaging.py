"""Packaging: the attention library imports and runs with only its core dependencies (torch,
triton, numpy); the engine's, server's and benchmarks' packages stay optional extras."""
import subprocess
import sys
import textwrap

import treeattn

# the packages of the extras (pyproject's engine, serve, bench, test): none may be needed by core
OPTIONAL = ("safetensors", "tokenizers", "tqdm", "rich", "fastapi", "uvicorn", "httpx",
            "prometheus_client", "matplotlib", "transformers", "openai")

_CORE_ONLY = textwrap.dedent("""
    import importlib.abc
    import sys

    BLOCKED = set(sys.argv[1:])


    class Blocker(importlib.abc.MetaPathFinder):
        # as if the extras were not installed: every import of them fails as a missing module would
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None


    sys.meta_path.insert(0, Blocker())

    import torch

    import treeattn
    import treeattn.api
    import treeattn.kernels.attention
    import treeattn.kernels.merge
    import treeattn.launchers
    import treeattn.plan

    torch.manual_seed(0)
    parents, lengths = [-1, 0, 0], [5, 3, 2]
    q = torch.randn(2, 4, 16, dtype=torch.float64)
    k = torch.randn(sum(lengths), 2, 16, dtype=torch.float64)
    v = torch.randn_like(k)
    o = treeattn.tree_attention(q, k, v, parents, lengths, backend="torch")
    assert o.shape == (2, 4, 16) and torch.isfinite(o).all()
    loaded = sorted(m for m in BLOCKED if m in sys.modules)
    assert not loaded, loaded
    print("core-only ok", treeattn.__version__)
""")


def test_core_imports_and_runs_without_the_extras():
    done = subprocess.run([sys.executable, "-c", _CORE_ONLY, *OPTIONAL], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "core-only ok" in done.stdout


def test_version_is_a_string():
    assert isinstance(treeattn.__version__, str) and treeattn.__version__
