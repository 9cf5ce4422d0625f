"""``treeattn run`` and ``treeattn bench e2e`` through the engine's parsers (wired into a local
argparse tree the way the main CLI wires them)."""
import argparse
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from treeattn.bench.e2e import _schedule  # noqa: E402
from treeattn.cli.engine import add_bench_e2e_parser, add_run_parser  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


def cli(argv) -> int:
    parser = argparse.ArgumentParser(prog="treeattn")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_run_parser(sub)
    bench = sub.add_parser("bench").add_subparsers(dest="bench_cmd", required=True)
    add_bench_e2e_parser(bench)
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                                   initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                                   pad_token_id=None)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("cli_llama")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def test_run_beam_writes_transformers_sequences(tiny, tmp_path, capsys):
    hf, path = tiny
    out = tmp_path / "beam.json"
    assert cli(["run", "--model", str(path), "--workload", "beam", "--beams", "4", "--max-new-tokens", "16",
                "--prompt-ids", "4,8,15,16,23,42", "--device", "cpu", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    ref = hf.generate(torch.tensor([[4, 8, 15, 16, 23, 42]]), num_beams=4, num_return_sequences=4,
                      do_sample=False, max_new_tokens=16, output_scores=True, return_dict_in_generate=True)
    assert got["sequences"] == ref.sequences.tolist()
    printed = capsys.readouterr().out.splitlines()   # every beam's new token ids, best first
    for i, seq in enumerate(ref.sequences.tolist()):
        assert printed[i].startswith(f"beam {i} (score ") and printed[i].endswith(" ".join(map(str, seq[6:])))
    assert got["scores"] == sorted(got["scores"], reverse=True)
    assert len(got["per_step"]) == 15


def test_run_sample_dumps_leaf_logits(tiny, tmp_path, capsys):
    hf, path = tiny
    out = tmp_path / "sample.json"
    assert cli(["run", "--model", str(path), "--workload", "sample", "--n", "2", "--prompt-ids", "1,2,3;9,8",
                "--max-new-tokens", "12", "--branch-every", "4", "--seed", "5", "--device", "cpu",
                "--json", str(out), "--dump-logits"]) == 0
    err = capsys.readouterr().err
    assert "12/12" in err                      # the progress bar
    got = json.loads(out.read_text())
    assert len(got["leaves"]) == 2 * 2 * 2 * 2 and {leaf["prompt"] for leaf in got["leaves"]} == {0, 1}
    for leaf in got["leaves"]:
        with torch.no_grad():
            ref = hf(torch.tensor([leaf["tokens"]])).logits[0, -1]
        assert (ref - torch.tensor(leaf["last_logits"])).abs().max().item() <= 1e-4
    assert {"queries", "tree_tokens", "strategy", "kv_ms", "plan_ms", "wall_ms"} <= set(got["per_step"][0])


@pytest.mark.parametrize("workload", ["fewshot --branches 3 --prompt-len 40 --steps 6",
                                      "tot-set --scale 0.02 --steps 8", "speculative-64 --steps 4"])
def test_run_replay_workloads(tmp_path, workload):
    out = tmp_path / "r.json"
    argv = ["run", "--random-weights", "tiny", "--device", "cpu", "--strategy", "flatten", "--quiet",
            "--json", str(out), "--workload"] + workload.split()
    assert cli(argv) == 0
    got = json.loads(out.read_text())
    assert got["steps"] == int(workload.split()[-1]) and got["strategies_used"] == {"flatten": got["steps"]}


def test_run_reports_bad_inputs(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["run", "--model", str(tmp_path / "missing"), "--workload", "beam"])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
    assert cli(["run", "--random-weights", "tiny", "--workload", "beam", "--prompt-ids", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert cli(["run", "--random-weights", "tiny", "--workload", "beam", "--prompt", "hello"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    assert cli(["run", "--random-weights", "tiny", "--workload", "sample", "--n", "8", "--prompt-ids", "1,2;3",
                "--max-new-tokens", "300", "--kv-tokens", "4000"]) == 2
    assert "2 prompt(s) of 3 tokens + 16 samples x 300 new tokens need at least 4,803 KV tokens" in \
        capsys.readouterr().err
    assert cli(["run", "--random-weights", "tiny", "--workload", "beam", "--max-new-tokens", "70000",
                "--beams", "1", "--kv-tokens", "100000"]) == 2
    assert "exceed the model's max_position_embeddings (65,536)" in capsys.readouterr().err
    out = tmp_path / "new" / "r.json"   # --json's folders are made
    assert cli(["run", "--random-weights", "tiny", "--device", "cpu", "--workload", "speculative-32", "--steps", "2",
                "--quiet", "--json", str(out)]) == 0
    assert out.exists() and capsys.readouterr().out.startswith("accepted (")


@pytest.mark.slow
def test_bench_e2e_cpu_smoke(tmp_path):
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    assert cli(["bench", "e2e", "--random-weights", "tiny", "--device", "cpu", "--steps", "3",
                "--windows", "1", "--breakdown-steps", "1", "--warmup-steps", "2",
                "--workloads", "tot-keyword,speculative-32", "--json", str(out), "--png", str(png)]) == 0
    got = json.loads(out.read_text())
    assert set(got["workloads"]) == {"tot-keyword", "speculative-32"} and "partial" not in got
    for w in got["workloads"].values():
        assert w["deft_speedup"] and w["speedup"] > 0
        for r in w["strategies"].values():
            assert len(r["step_ms"]) == 3 and r["leaked_pages"] == 0
            assert set(r["breakdown_ms"]) == {"attention", "kv_management", "plan", "rest"}
            # the GPU's (here: the host clock's) idle time between steps is part of each latency
            assert 0 <= r["host_overhead"] < 1 and 0 <= r["idle_ms"] <= r["busy_step_ms"] + r["idle_ms"]
            assert r["busy_step_ms"] <= r["mean_step_ms"] + 1e-9
    assert png.stat().st_size > 10_000


def test_bench_e2e_keeps_finished_runs_when_cut_off(tmp_path, monkeypatch):
    """Each finished run is written to --json at once (marked partial), so a benchmark stopped
    by a time limit or an error keeps what it measured; the full result replaces it."""
    import treeattn.cli.engine as engine_cli

    def cut_off(model, workloads, strategies, *, progress, **kw):
        progress("tot-set", "auto", {"mean_step_ms": 7.0, "gpu_step_ms": 6.9, "idle_ms": 0.1, "host_overhead": 0.01,
                                     "wall_s": 1.0, "breakdown_ms": {"attention": 0.6}})
        raise ValueError("stopped")

    monkeypatch.setattr(engine_cli, "bench_e2e", cut_off)
    out = tmp_path / "e2e.json"
    assert cli(["bench", "e2e", "--random-weights", "tiny", "--device", "cpu", "--json", str(out)]) != 0
    got = json.loads(out.read_text())
    assert got["partial"] and got["runs"]["tot-set"]["auto"]["mean_step_ms"] == 7.0


@pytest.mark.parametrize("total,windows,breakdown,warmup", [(400, 10, 2, 1), (5193, 20, 2, 1), (7, 5, 1, 2), (3, 4, 1, 1)])
def test_bench_e2e_all_steps_schedule(total, windows, breakdown, warmup):
    """``--steps all``: the windows tile the workload, so every step runs the model and all but
    each window's warm-up and breakdown steps are timed; a timed run starts after a warm-up step."""
    kinds = _schedule(total, None, windows, breakdown, warmup)
    assert sorted(kinds) == list(range(total))
    used = max(1, min(windows, total // (warmup + 1 + breakdown)))
    assert sum(k == "timed" for k in kinds.values()) == total - used * (warmup + breakdown)
    for step, kind in kinds.items():
        if kind == "timed" and kinds.get(step - 1) != "timed":
            assert kinds[step - 1] == "warm"


def test_bench_e2e_steps_argument(capsys):
    with pytest.raises(SystemExit):
        cli(["bench", "e2e", "--random-weights", "tiny", "--steps", "0"])
    assert "positive count or 'all'" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_e2e_cuda_smoke(tmp_path):
    out = tmp_path / "e2e.json"
    assert cli(["bench", "e2e", "--random-weights", "tiny", "--device", "cuda", "--steps", "6",
                "--windows", "2", "--workloads", "fewshot-20,tot-set,speculative-64", "--json", str(out)]) == 0
    for w in json.loads(out.read_text())["workloads"].values():
        for r in w["strategies"].values():
            assert r["cuda_graphs"] and r["leaked_pages"] == 0 and r["gpu_step_ms"] > 0
            assert 0 < r["breakdown_ms"]["attention"] < r["gpu_step_ms"]


def test_run_with_a_tokenizer(tiny, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf, path = tiny
    words = [f"w{i}" for i in range(256)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    out = tmp_path / "t.json"
    try:
        assert cli(["run", "--model", str(path), "--workload", "beam", "--beams", "2", "--max-new-tokens", "4",
                    "--prompt", "w5 w6 w7", "--device", "cpu", "--quiet", "--json", str(out)]) == 0
    finally:
        (path / "tokenizer.json").unlink()
    got = json.loads(out.read_text())
    assert got["sequences"][0][:3] == [5, 6, 7] and got["texts"][0].startswith("w5 w6 w7")
    text = " ".join(f"w{t}" for t in got["sequences"][0][3:])
    assert capsys.readouterr().out.startswith(f"beam 0 (score {got['scores'][0]:.3f}): {text!r}\n")
