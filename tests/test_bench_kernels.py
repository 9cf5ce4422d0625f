"""``treeattn bench kernels`` without a GPU: the summary's comparisons and the up-front compile
(the GPU and the timed cases stubbed out)."""
import json

import pytest

import treeattn.bench.kernels as kernels
from treeattn.cli.main import main


def _row(tree, hq, hkv, roofline, graph_us, peers=None):
    return {"tree": tree, "hq": hq, "hkv": hkv, "requests": 2, "tree_tokens": 7, "roofline_us": roofline,
            "us": dict(graph_us),
            "graph_us": dict(graph_us), **({"peers_us": peers} if peers else {})}


def test_summary_counts_auto_within_5pct_of_the_fastest_strategy():
    rows = [_row("a", 32, 8, 10.0, {"auto": 20.0, "sequence": 30.0, "paths": 20.0}, {"pat": 25.0}),
            _row("b", 32, 8, 10.0, {"auto": 21.0, "sequence": 20.4, "paths": 22.0}, {"pat": 20.0}),
            _row("c", 32, 8, 40.0, {"auto": 60.0, "sequence": 50.0, "paths": 70.0}),
            _row("a", 32, 32, 10.0, {"auto": 15.0})]
    got = kernels.summarize(rows)
    s = got["32/8"]
    assert s["cases_compared"] == 3 and s["auto_within_5pct_of_fastest"] == 2
    assert s["auto_worst_over_fastest"] == pytest.approx(1.2)
    assert s["auto_graph_over_roofline"] == pytest.approx((2.0 * 2.1 * 1.5) ** (1 / 3))
    assert s["cases_with_peers"] == 2 and s["graph_cases_faster_than_best_peer"] == 1
    assert "cases_compared" not in got["32/32"]  # auto alone: nothing to compare its choice with


@pytest.mark.parametrize("workers", [None, 0, 3])
def test_compile_workers_precompile_each_head_config_before_the_cases(tmp_path, monkeypatch, workers):
    calls = []

    class Mode:
        num_streams, pdl = 0, True

        def __init__(self, **kw):
            self.kw = kw

        def precompile(self, **kw):
            calls.append(("precompile", kw))
            return 1

    def bench_case(spec, hq, hkv, *a, **kw):
        calls.append(("case", spec, hq, hkv))
        return _row(spec, hq, hkv, 1.0, {"auto": 2.0})

    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(kernels, "copy_bandwidth", lambda: 3e12)
    monkeypatch.setattr(kernels, "provenance", lambda: {"device": "stub"})
    monkeypatch.setattr(kernels, "load_anchors", lambda: {})
    monkeypatch.setattr(kernels, "suite_trees", lambda suite: ["1,2_3,4"])
    monkeypatch.setattr(kernels, "TreeAttention", Mode)
    monkeypatch.setattr(kernels, "bench_case", bench_case)
    out = tmp_path / "k.json"
    argv = ["bench", "kernels", "--strategies", "auto", "--heads", "32/8,64/8", "--out", str(out), "--plot", ""]
    assert main(argv + ([] if workers is None else ["--compile-workers", str(workers)])) == 0
    pre = [c[1] for c in calls if c[0] == "precompile"]
    if workers is None:
        assert not pre and json.loads(out.read_text())["precompile_s"] is None
        return
    # every head config compiled (the suite's page size 1, fp16, d128) before the first case
    assert [(k["num_qo_heads"], k["num_kv_heads"]) for k in pre] == [(32, 8), (64, 8)]
    assert all(k["page_size"] == 1 and k["head_dim"] == 128 and k["workers"] == workers
               and k["dtype"] == kernels.torch.float16 for k in pre)
    assert [c[0] for c in calls] == ["precompile", "precompile", "case", "case"]
    assert json.loads(out.read_text())["precompile_s"] >= 0
