import argparse
import logging
import subprocess
import sys

import pytest
import torch

from treeattn.cli.main import build_parser, main, version


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
    proc = subprocess.run([sys.executable, "-m", "treeattn.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and all(c in proc.stdout for c in ("demo", "run", "attention", "bench"))


@pytest.mark.parametrize("argv,message", [
    ("attention --heads 32", "expected query/KV heads"),
    ("attention --heads 6/4", "positive multiple of the KV heads"),
    ("attention --head-dim 0", "positive integer"),
    ("attention --tree garbage", "malformed tree spec"),
    ("attention --template bogus", "unknown template 'bogus'"),
    ("demo --strategies auto,bogus", "unknown strategies bogus"),
    ("demo --scale -1", "a number > 0"),
    ("run --random-weights tiny --workload beam --max-new-tokens 100000 --kv-tokens 4096",
     "need at least 400,016 KV tokens"),
    ("run --random-weights nope --workload beam", "invalid choice"),
    ("run --random-weights tiny --workload beam --top-p 2", "(0, 1]"),
    ("bench kernels --heads 32/8,7/2", "positive multiple"),
    ("bench e2e --workloads tot-set,nope", "unknown workloads nope"),
    ("bench serve --rate 1 --trace missing.jsonl", "does not exist"),
    ("serve --random-weights tiny --port 70000", "TCP port"),
])
def test_bad_arguments_end_in_one_line_before_any_work(argv, message, capsys):
    try:    # argparse exits on what it checks itself; the commands return 2 on the rest
        code = main(argv.split())
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    cmd = " ".join(argv.split()[:2] if argv.startswith("bench") else argv.split()[:1])
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"treeattn {cmd}: error: ")
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
@pytest.mark.parametrize("argv", ["attention --device cuda", "demo --device cuda",
                                  "run --random-weights tiny --workload beam --device cuda"])
def test_cuda_without_a_gpu_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv.split())
    assert e.value.code == 2 and "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_kernels_without_a_gpu_fails_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "kernels", "--out"]) == 2
    assert capsys.readouterr().err == ("treeattn bench kernels: error: it needs a CUDA GPU, and PyTorch "
                                       "sees none on this machine\n")
    assert list(tmp_path.iterdir()) == []


def test_library_input_errors_become_one_line(monkeypatch, capsys):
    """A ValueError from the library (bad input only it can see) is exit 2 without a traceback;
    other exceptions, bugs, keep theirs."""
    cli_main = sys.modules["treeattn.cli.main"]   # (the package exports main, the function)

    def reject(args):
        raise ValueError("template entry 7 has no nodes")

    monkeypatch.setattr(cli_main, "attention", reject)
    assert main(["attention"]) == 2
    assert capsys.readouterr().err == "treeattn attention: error: template entry 7 has no nodes\n"

    def bug(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli_main, "attention", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["attention"])


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"treeattn {version()}"


def test_every_option_and_command_has_help():
    def walk(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {a.dest for a in action._choices_actions if a.help}
                for cmd, sub in action.choices.items():
                    assert cmd in helped, f"{name} {cmd}: no help"
                    yield from walk(sub, f"{name} {cmd}")
            elif action.help != argparse.SUPPRESS:
                yield name, action

    missing = [f"{name} {'/'.join(a.option_strings)}" for name, a in walk(build_parser(), "treeattn")
               if not a.help]
    assert not missing, missing


def test_log_level_warning_hides_info(monkeypatch, capsys):
    """``--log-level`` configures logging once for the process, before or after the command."""
    cli_main = sys.modules["treeattn.cli.main"]   # (the package exports main, the function)

    def logs(args):
        logging.getLogger("treeattn.engine.graphs").info("an info message")
        logging.getLogger("treeattn.engine.graphs").warning("a warning")
        return 0

    monkeypatch.setattr(cli_main, "attention", logs)
    for argv in (["--log-level", "warning", "attention"], ["attention", "--log-level", "warning"]):
        assert main(argv) == 0
        err = capsys.readouterr().err
        assert "a warning" in err and "an info message" not in err
    assert main(["attention"]) == 0
    assert "an info message" in capsys.readouterr().err
    logging.getLogger().setLevel(logging.WARNING)


def test_demo_shows_the_tree_the_kv_saved_and_auto(capsys):
    assert main(["demo", "--template", "set", "--scale", "0.02"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert lines[-1].endswith("every KV page was freed.") and lines[-2].startswith("Summary: auto read")
    assert "prompt (" in out and "├── t" in out                      # the generated tree
    assert "vs sequence" in out and "auto picked" in out and "est. GPU us" in out
    for s in ("sequence", "node_chunk", "flatten", "pack", "greedy", "paths"):
        assert f"\n  {s} " in out                                    # every strategy planned
    assert " ms" not in out                                            # no CPU timings


def test_render_tree_cuts_wide_levels():
    from treeattn.cli.demo import render_tree

    lines = render_tree([-1, 0, 0, 0, 1], lambda n: f"n{n} " + "x" * 30, width=20, max_children=2)
    assert lines == ["n0 " + "x" * 14 + "...", "├── n1 " + "x" * 10 + "...", "│   └── n4 " + "x" * 6 + "...",
                     "├── n2 " + "x" * 10 + "...", "└── ... 1 more th..."]


def test_bench_kernels_keeps_finished_cases_when_cut_off(tmp_path, monkeypatch):
    """``bench kernels --out`` writes every finished case at once (marked partial), so a run
    stopped by a time limit or an error keeps what it measured (the GPU stubbed out)."""
    import json

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
    monkeypatch.setattr(kernels.torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "new" / "dir" / "k.json"     # its folders are made before any measuring
    with pytest.raises(RuntimeError, match="cut off"):
        main(["bench", "kernels", "--strategies", "auto", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["partial"] and [r["tree"] for r in got["rows"]] == done and got["copy_bandwidth_TBps"] == 3.0


def test_bench_kernels_writes_only_where_asked(tmp_path, monkeypatch):
    """No output file without --out / --plot; given without a path, the file is named after the
    GPU actually used, in the current folder."""
    import treeattn.bench.kernels as kernels

    class Mode:
        num_streams, pdl = 0, True

        def __init__(self, **kw):
            pass

    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(kernels.torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(kernels, "copy_bandwidth", lambda: 3e12)
    monkeypatch.setattr(kernels, "provenance", lambda: {"device": "stub"})
    monkeypatch.setattr(kernels, "TreeAttention", Mode)
    monkeypatch.setattr(kernels, "suite_trees", lambda suite: ["1_8"])
    monkeypatch.setattr(kernels, "bench_case", lambda spec, hq, hkv, *a, **kw: {
        "tree": spec, "hq": hq, "hkv": hkv, "requests": 1, "tree_tokens": 8, "roofline_us": 1.0,
        "us": {"auto": 2.0}, "graph_us": {"auto": 1.5}})
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "kernels", "--strategies", "auto", "--heads", "8/8"]) == 0
    assert list(tmp_path.iterdir()) == []
    assert main(["bench", "kernels", "--strategies", "auto", "--heads", "8/8", "--out"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["nvidia_h100_80gb_hbm3_kernels.json"]
