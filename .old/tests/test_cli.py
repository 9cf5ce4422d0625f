import subprocess
import sys

from treeattn.cli import main


def test_attention_on_a_suite_tree(capsys):
    assert main(["attention", "--tree", "1,4,8_300,40,9", "--heads", "8/2", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    for s in ("sequence", "node_chunk", "flatten", "pack", "greedy", "auto ->"):
        assert s in out


def test_attention_on_a_tot_template(capsys):
    assert main(["attention", "--template", "docmerge", "--heads", "4/4", "--head-dim", "64"]) == 0
    assert "Tree-of-Thoughts template 'docmerge'" in capsys.readouterr().out


def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "treeattn.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and all(c in proc.stdout for c in ("demo", "run", "attention", "bench"))


def test_demo_runs_the_strategy_table_then_the_decode(capsys):
    assert main(["demo", "--template", "docmerge", "--scale", "0.01", "--strategies", "auto,sequence"]) == 0
    out = capsys.readouterr().out
    assert "vs sequence" in out and "node_chunk" in out  # the attention table: every strategy
    assert "every strategy generated the same thoughts" in out  # the end-to-end decode
