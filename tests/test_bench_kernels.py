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


def test_summary_holds_eager_runs_against_their_graph_replays_where_the_gpu_hides_the_host():
    rows = [_row("a", 32, 8, 10.0, {"auto": 40.0}), _row("b", 32, 8, 10.0, {"auto": 60.0}),
            _row("c", 32, 8, 10.0, {"auto": 100.0})]
    rows[0]["us"]["auto"] = 90.0   # (under 50 us of GPU time: not held to 1.2x)
    rows[1]["us"]["auto"] = 71.0
    rows[2]["us"]["auto"] = 130.0
    for r, host in zip(rows, (12.0, 20.0, 16.0)):
        r["auto_host_us"] = host
    s = kernels.summarize(rows)["32/8"]
    assert s["eager_cases_over_50us"] == 2 and s["eager_within_1_2x_of_graph"] == 1
    assert s["auto_host_us_median"] == 16.0 and s["auto_host_us_max"] == 20.0


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


def test_summary_reports_families_small_trees_and_the_targets():
    rows = [{**_row(t, 32, 8, roof, graph), "family": f} for t, f, roof, graph in (
        ("a", "beam", 5.0, {"auto": 10.0, "sequence": 10.0}),
        ("b", "beam", 8.0, {"auto": 14.0, "sequence": 12.0}),
        ("c", "doc-qa", 40.0, {"auto": 60.0, "sequence": 60.0}))]
    s = kernels.summarize(rows)["32/8"]
    assert s["families"] == {"beam": {"cases": 2, "auto_within_5pct_of_fastest": 1,
                                      "auto_worst_over_fastest": pytest.approx(14 / 12)},
                             "doc-qa": {"cases": 1, "auto_within_5pct_of_fastest": 1, "auto_worst_over_fastest": 1.0}}
    assert s["small_trees"] == 2 and s["small_tree_auto_median_us"] == 12.0  # roofline under 15 us
    assert s["auto_share_within_5pct"] == pytest.approx(2 / 3)
    assert list(s["targets_met"].values()) == [False, False, True]


def test_summary_reports_the_small_trees_median_layer_time_where_measured():
    rows = [{**_row(t, 32, 8, roof, {"auto": 20.0, "sequence": 25.0}), "auto_layer_us": layer}
            for t, roof, layer in (("a", 5.0, 9.0), ("b", 8.0, 11.0), ("c", 40.0, 50.0))]
    s = kernels.summarize(rows)["32/8"]
    assert s["small_tree_auto_median_us"] == 20.0
    assert s["small_tree_auto_layer_median_us"] == 10.0  # rooflines under 15 us only
    assert "small_tree_auto_layer_median_us" not in kernels.summarize([_row("a", 32, 8, 5.0, {"auto": 9.0})])["32/8"]


def test_workloads_suite_times_every_workload_tree_with_its_family(tmp_path, monkeypatch):
    from treeattn.tree import WORKLOAD_FAMILIES, tree_family, workload_names

    class Mode:
        num_streams, pdl = 0, True

        def __init__(self, **kw):
            pass

    def bench_case(spec, hq, hkv, *a, **kw):
        return {**_row(spec, hq, hkv, 4.0, {"auto": 10.0, "sequence": 10.0}), "family": tree_family(spec)}

    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(kernels, "copy_bandwidth", lambda: 3e12)
    monkeypatch.setattr(kernels, "provenance", lambda: {"device": "stub"})
    monkeypatch.setattr(kernels, "load_anchors", lambda: {})
    monkeypatch.setattr(kernels, "TreeAttention", Mode)
    monkeypatch.setattr(kernels, "bench_case", bench_case)
    out = tmp_path / "k.json"
    assert main(["bench", "kernels", "--suite", "workloads", "--strategies", "auto,sequence", "--heads", "32/8",
                 "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["tree"] for r in got["rows"]] == workload_names()
    assert set(got["summary"]["32/8"]["families"]) == set(WORKLOAD_FAMILIES)
    assert all(got["summary"]["32/8"]["targets_met"].values())
