"""Every Python example of README.md and docs/*.md runs as written, on CPU.

Examples are the ```python blocks. A block that needs a GPU is marked by a first line
``# GPU only: <reason>`` and skipped here (benchmarks/check_gpu.py covers the GPU paths); a block
whose first line starts with ``# torchrun`` is a multi-process example and runs here as a
one-rank gloo group.
"""
import re
import socket
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks():
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            line = text[:m.start()].count("\n") + 2
            yield pytest.param(path, line, m.group(1), id=f"{path.relative_to(ROOT)}:{line}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_docs_have_examples():
    assert any(True for _ in _blocks())


@pytest.mark.parametrize("path, line, code", list(_blocks()))
def test_example_runs(path, line, code, monkeypatch):
    first = code.splitlines()[0]
    if first.startswith("# GPU only"):
        pytest.skip(first[2:])
    if first.startswith("# torchrun"):
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())),
                            ("RANK", "0"), ("WORLD_SIZE", "1")):
            monkeypatch.setenv(name, value)
    scope = {"__name__": "__example__"}
    # blank lines up front so that tracebacks point at the line of the Markdown file
    exec(compile("\n" * (line - 1) + code, str(path), "exec"), scope)
    for names, check in CHECKS:
        if all(n in scope for n in names):
            check(scope)


def _check_quickstart(s):
    """The paged example's updated plan, rerun over random KV, matches the float64 reference."""
    from treeattn import reference_attention

    pool, tree = s["pool"], s["pool"].tree()
    assert tree.num_queries == 4 and s["lse"].dtype == torch.float32 and torch.isfinite(s["o"]).all()
    k, v = pool.k_cache(0), pool.v_cache(0)
    k.copy_(torch.randn_like(k))
    v.copy_(torch.randn_like(v))
    q = torch.randn(4, 32, 128, dtype=k.dtype, device=k.device)
    o = s["wrapper"].run(q, k, v, s["plan"])
    ref, _ = reference_attention(q, k, v, tree)
    tol = _tol(k)
    torch.testing.assert_close(o.double(), ref, atol=tol, rtol=tol)


def _tol(t: torch.Tensor) -> float:
    """fp32 on CPU is exact to rounding; on a GPU the examples run fp16, or fp32 through TF32 MMAs."""
    return 1e-4 if t.device.type == "cpu" else 2e-2


def _check_engine(s):
    out = s["out"]
    assert out["sequences"] and len(out["sequences"]) == len(out["scores"])
    assert all(isinstance(t, int) for t in out["sequences"][0])


def _check_distributed(s):
    """One rank holds the whole KV: the sharded results equal the single-process ones."""
    import treeattn

    q, k, v = s["q"], s["k"], s["v"]
    tol = _tol(q)
    torch.testing.assert_close(s["o"], treeattn.tree_attention(q, k, v, s["parents"], s["lengths"]))
    p = torch.softmax(torch.einsum("qhd,thd->hqt", q, k.repeat_interleave(4, 1)) / 8, -1)
    dense = torch.einsum("hqt,thd->qhd", p, v.repeat_interleave(4, 1))
    torch.testing.assert_close(s["o_tree"], dense, atol=tol, rtol=tol)
    torch.testing.assert_close(s["o_ring"], dense, atol=tol, rtol=tol)


CHECKS = [
    (("pool", "wrapper", "plan"), _check_quickstart),
    (("engine", "out"), _check_engine),
    (("o_tree", "o_ring"), _check_distributed),
]
