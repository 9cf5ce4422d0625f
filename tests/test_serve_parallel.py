"""``treeattn serve --tp N --sp M`` under torchrun on gloo CPU ranks (127.0.0.1): a tiny random
Llama served by 2 tensor-parallel ranks, then by 2 sequence-sharded ones, answers greedy, seeded
n = 2 sampling and beam-search completions (streamed and not, sent together) with the tokens of
a single-process server on the same weights; SIGTERM to torchrun ends every rank within the
grace period, the other ranks once rank 0 has stopped them; bad grids fail before any work."""
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

from helpers import free_port, save_tiny_llama  # noqa: E402

from treeattn.engine import TreeEngine, TreeModel  # noqa: E402
from treeattn.serve import Scheduler  # noqa: E402
from treeattn.serve.server import ServerThread, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
#: the pool and cache options of both servers
OPTIONS = dict(kv_tokens=2048, page_size=16, block_tokens=16)
GRACE = 2.0
BODIES = [
    {"prompt": list(range(3, 40)), "max_tokens": 8, "temperature": 0},
    {"prompt": list(range(3, 30)) + [7, 8], "max_tokens": 6, "temperature": 0, "stream": True},
    {"prompt": [5, 6, 7, 8, 9], "max_tokens": 7, "temperature": 1.0, "n": 2, "seed": 11},
    {"prompt": list(range(3, 40)) + [1, 2], "max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "n": 2,
     "seed": 4, "stream": True},
]
UNSEEDED = [4, 5, 6]
BEAM = {"prompt": [5, 17, 99, 3, 42, 7], "max_tokens": 4, "n": 2, "best_of": 3, "use_beam_search": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with 2 KV heads (one per TP rank) and every size even."""
    d = tmp_path_factory.mktemp("tiny_tp")
    save_tiny_llama(d, vocab=256, num_key_value_heads=2)
    return d


async def _complete(client, body):
    """Token ids per choice and finish reasons of one completion (streamed or not)."""
    body = {"model": "tiny", **body}
    if not body.get("stream"):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"]
        return [c["token_ids"] for c in ch], [c["finish_reason"] for c in ch]
    n = body.get("n", 1)
    ids, fin = [[] for _ in range(n)], [None] * n
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    ids[c["index"]] += c["token_ids"]
                    fin[c["index"]] = c["finish_reason"] or fin[c["index"]]
    return ids, fin


def _answers(url):
    """Every body of BODIES sent at once, then the beam search (it runs alone)."""
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            out = await asyncio.gather(*(_complete(client, b) for b in BODIES))
            return out + [await _complete(client, BEAM)]
    return asyncio.run(go())


def _unseeded_and_dropped(url):
    """An unseeded n = 2 sampling (rank 0 draws its seed for every rank) next to a stream whose
    client leaves after its first chunk; returns the sampled token ids, their log-probabilities
    and then the server's running requests once idle."""
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def drop():
                body = {"model": "tiny", "prompt": [9, 8, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            return
            body = {"model": "tiny", "prompt": UNSEEDED, "max_tokens": 5, "n": 2, "logprobs": 0}
            r = (await asyncio.gather(client.post("/v1/completions", json=body), drop()))[0]
            ch = r.json()["choices"]
            for _ in range(100):
                health = (await client.get("/health")).json()
                if health["running"] == 0 and health["waiting"] == 0:
                    break
                await asyncio.sleep(0.05)
            return [c["token_ids"] for c in ch], [c["logprobs"]["token_logprobs"] for c in ch], health["running"]
    return asyncio.run(go())


@pytest.fixture(scope="module")
def reference(model_dir):
    """The single-process server's answers."""
    kv, ps, blk = OPTIONS["kv_tokens"], OPTIONS["page_size"], OPTIONS["block_tokens"]
    sched = Scheduler(TreeEngine(TreeModel.from_pretrained(model_dir), kv_tokens=kv, page_size=ps,
                                 keep_reserved=True), block_tokens=blk).start()
    with ServerThread(create_app(sched, model_name="tiny", max_model_len=512)) as srv:
        out = _answers(srv.url)
    sched.stop()
    return out


def _children(pid: int) -> list:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.parametrize("grid", [("--tp", "2"), ("--sp", "2")], ids=["tp2", "sp2"])
def test_torchrun_serve_equals_one_process_and_stops_on_sigterm(model_dir, reference, grid, tmp_path):
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir).eval()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "treeattn.cli", "serve", "--model", str(model_dir), "--device", "cpu", *grid,
         "--port", str(port), "--kv-tokens", str(OPTIONS["kv_tokens"]), "--page-size", str(OPTIONS["page_size"]),
         "--prefix-block", str(OPTIONS["block_tokens"]), "--served-model-name", "tiny",
         "--shutdown-grace", str(GRACE), "--log-level", "info"], env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)  # (a process group of its own: a failed test kills the ranks too)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < end, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert _answers(url) == reference
        assert all(fin == ["length"] * len(fin) for _, fin in reference[:-1])
        ids, lps, running = _unseeded_and_dropped(url)
        assert [len(x) for x in ids] == [5, 5] and running == 0
        # every rank decoded the tokens rank 0 sampled: their log-probabilities are the model's
        for tokens, got in zip(ids, lps):
            with torch.no_grad():
                logits = hf(torch.tensor([UNSEEDED + tokens])).logits[0, len(UNSEEDED) - 1:-1]
            want = torch.log_softmax(logits.double(), -1)[torch.arange(len(tokens)), tokens]
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, atol=1e-4, rtol=0)
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        proc.wait(timeout=GRACE + 20)
        assert time.monotonic() - sent < GRACE + 5
        for pid in ranks:                   # (torchrun reaped them)
            assert not Path(f"/proc/{pid}").exists()
        out = (tmp_path / "serve.log").read_text()
        assert "waiting for rank 0 to stop the group" in out and "lost the other ranks" not in out, out[-3000:]
        assert "engine step failed" not in out, out[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):   # torchrun and every rank it started
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def test_serve_refuses_bad_grids(monkeypatch, capsys):
    """Outside torchrun, and with a model that does not split, ``serve`` fails before any work."""
    from treeattn.cli.main import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ["serve", "--random-weights", "small", "--device", "cpu"]
    assert main([*args, "--sp", "2"]) == 2
    assert ("--tp 1 --sp 2 needs 2 processes started by torchrun: torchrun --nproc-per-node 2 -m treeattn.cli "
            "serve") in capsys.readouterr().err
    assert main(["serve", "--random-weights", "tiny", "--device", "cpu", "--tp", "2"]) == 2
    assert "num_key_value_heads (1) divisible by 2" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main([*args, "--tp", "2"]) == 2
    assert "--tp 2 x --sp 1 = 2 ranks, but torchrun started 3 processes" in capsys.readouterr().err
