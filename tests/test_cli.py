import subprocess
import sys

import pytest

from treeattn.cli.main import main


@pytest.mark.slow
def test_attention_on_a_suite_tree(capsys):
    assert main(["attention", "--tree", "1,4,8_300,40,9", "--heads", "8/2", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    for s in ("sequence", "node_chunk", "flatten", "pack", "greedy", "auto ->"):
        assert s in out


@pytest.mark.slow
def test_attention_on_a_tot_template(capsys):
    assert main(["attention", "--template", "docmerge", "--heads", "4/4", "--head-dim", "64"]) == 0
    assert "Tree-of-Thoughts template 'docmerge'" in capsys.readouterr().out


@pytest.mark.slow
def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "treeattn.cli.main", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and all(c in proc.stdout for c in ("demo", "run", "attention", "bench"))


@pytest.mark.slow
def test_demo_runs_the_strategy_table_then_the_decode(capsys):
    assert main(["demo", "--template", "docmerge", "--scale", "0.01", "--strategies", "auto,sequence"]) == 0
    out = capsys.readouterr().out
    assert "vs sequence" in out and "node_chunk" in out  # the attention table: every strategy
    assert "every strategy generated the same thoughts" in out  # the end-to-end decode


def test_bench_kernels_keeps_finished_cases_when_cut_off(tmp_path, monkeypatch):
    """``bench kernels --out`` writes every finished case at once (marked partial), so a run
    stopped by a time limit or an error keeps what it measured (the GPU stubbed out)."""
    import json

    import pytest

    import treeattn.bench.kernels as kernels

    class Mode:
        num_streams, pdl = 0, True

        def __init__(self, **kw):
            pass

    def bench_case(spec, hq, hkv, *a, **kw):
        if len(done) == 2:
            raise RuntimeError("cut off")
        done.append(spec)
        return {"tree": spec, "hq": hq, "hkv": hkv}

    done = []
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(kernels, "copy_bandwidth", lambda: 3e12)
    monkeypatch.setattr(kernels, "provenance", lambda: {"device": "stub"})
    monkeypatch.setattr(kernels, "TreeAttention", Mode)
    monkeypatch.setattr(kernels, "bench_case", bench_case)
    out = tmp_path / "k.json"
    with pytest.raises(RuntimeError, match="cut off"):
        main(["bench", "kernels", "--strategies", "auto", "--out", str(out), "--plot", ""])
    got = json.loads(out.read_text())
    assert got["partial"] and [r["tree"] for r in got["rows"]] == done and got["copy_bandwidth_TBps"] == 3.0
