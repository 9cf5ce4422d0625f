"""The server as OpenAI's own Python client sees it (CPU, 127.0.0.1, a tiny random Llama with a
word-level tokenizer and a chat template): chat and text completions, streaming, n, stop, logprobs,
penalties and logit_bias against a float64 reference, seeds, beam search and best_of against
transformers / the engine, refused fields, disconnects, shutdown, API keys and metrics."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
pytest.importorskip("prometheus_client")

from treeattn.engine import TreeEngine, TreeModel  # noqa: E402
from treeattn.serve import Scheduler  # noqa: E402
from helpers import save_tiny_llama  # noqa: E402
from treeattn.serve.chat import ChatTemplate  # noqa: E402
from treeattn.serve.server import ServerThread, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 256
TEMPLATE = ("{{ bos_token }} {% for m in messages %}{{ 't3' if m['role'] == 'user' else 't4' }} {{ m['content'] }} "
            "{% endfor %}{% if add_generation_prompt %}t5{% endif %}")
MESSAGES = [{"role": "system", "content": "t20 t21"}, {"role": "user", "content": "t30 t31 t32 t33"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, model dir with tokenizer.json and a chat template in tokenizer_config.json)."""
    d = tmp_path_factory.mktemp("tiny_chat")
    hf = save_tiny_llama(d, vocab=VOCAB, tokenizer=True)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t100", "eos_token": "t101", "chat_template": TEMPLATE}))
    return hf, d


def _serve(model_dir, *, kv_tokens=4096, api_key=None, start=True, **kw):
    model = TreeModel.from_pretrained(model_dir)
    sched = Scheduler(TreeEngine(model, kv_tokens=kv_tokens, page_size=16, keep_reserved=True), block_tokens=16, **kw)
    if start:
        sched.start()
    app = create_app(sched, model_name="tiny", tokenizer=model.tokenizer, max_model_len=512,
                     chat_template=ChatTemplate.from_pretrained(model_dir), api_key=api_key)
    return sched, ServerThread(app, shutdown_grace=2.0).start()


@pytest.fixture(scope="module")
def server(tiny):
    sched, srv = _serve(tiny[1], max_queue=256, max_batch=32)
    yield sched, srv
    srv.stop()
    sched.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(text):
    return [int(w[1:]) for w in text.split()]


def _idle_and_clean(sched, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = sched.stats()
        if s["running"] == 0 and s["waiting"] == 0 and sched.num_queued == 0:
            break
        time.sleep(0.02)
    sched.flush_cache()
    s = sched.stats()
    assert s["running"] == 0 and s["free_pages"] == s["num_pages"], s
    sched.call(sched.engine.pool.check)


def _chat_prompt(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return text, tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------- chat
def test_chat_template_renders_as_transformers(tiny):
    text, ids = _chat_prompt(tiny[1])
    assert ChatTemplate.from_pretrained(tiny[1]).render(MESSAGES) == text
    assert ids == [100, 4, 20, 21, 3, 30, 31, 32, 33, 5]


def test_greedy_chat_equals_transformers_generate(tiny, client):
    hf, d = tiny
    _, ids = _chat_prompt(d)
    k = 8
    ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=k, output_scores=True,
                      return_dict_in_generate=True)
    want = ref.sequences[0, len(ids):].tolist()
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=k, temperature=0,
                                       logprobs=True, top_logprobs=3)
    (c,) = r.choices
    assert _ids(c.message.content) == want and c.message.role == "assistant" and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == k and r.object == "chat.completion"
    ref_lp = [torch.log_softmax(s[0].double(), -1) for s in ref.scores]
    got = c.logprobs.content
    assert [e.token for e in got] == [f"t{t}" for t in want]
    np.testing.assert_allclose([e.logprob for e in got], [lp[t].item() for lp, t in zip(ref_lp, want)], atol=1e-4)
    for e, lp in zip(got, ref_lp):
        top = torch.topk(lp, 3)
        assert [t.token for t in e.top_logprobs] == [f"t{i}" for i in top.indices.tolist()]
        assert e.bytes == list(e.token.encode())


def test_chat_stream_with_usage_equals_the_plain_answer(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.8, seed=3, n=2)
    plain = client.chat.completions.create(**kw)
    texts, fin, usage, roles = ["", ""], [None, None], None, set()
    for ch in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        assert ch.object == "chat.completion.chunk"
        if not ch.choices:
            usage = ch.usage
            continue
        assert ch.usage is None
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            roles.add(c.delta.role)
            fin[c.index] = c.finish_reason or fin[c.index]
    assert texts == [c.message.content for c in plain.choices] and fin == ["length", "length"]
    assert "assistant" in roles
    assert usage is not None and usage.model_dump() == plain.usage.model_dump()
    assert usage.completion_tokens == 12


# ---------------------------------------------------------------------- completions
def test_completions_n_seed_logprobs_and_echo(client):
    kw = dict(model="tiny", prompt="t7 t8 t9 t10", max_tokens=5, temperature=0.9, n=3, seed=11, logprobs=2)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    other = client.completions.create(**{**kw, "seed": 12})
    assert [c.text for c in a.choices] != [c.text for c in other.choices]
    for c in a.choices:
        lp = c.logprobs
        assert lp.tokens == c.text.split() and len(lp.token_logprobs) == 5
        assert all(len(t) == 2 for t in lp.top_logprobs)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
        assert all(v <= 0 for v in lp.token_logprobs)
    e = client.completions.create(model="tiny", prompt="t7 t8", max_tokens=2, temperature=0, echo=True)
    assert e.choices[0].text.startswith("t7 t8")
    s = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="t7 t8", max_tokens=2, temperature=0, echo=True, stream=True))
    assert s.replace(" ", "") == e.choices[0].text.replace(" ", "")


def test_seeded_samples_equal_engine_generate(tiny, client):
    prompt = [7, 8, 9, 10, 11]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0.8, top_p=0.9, n=2, seed=5)
    eng = TreeEngine(TreeModel.from_pretrained(tiny[1]), kv_tokens=1024, page_size=16)
    (out,) = eng.generate([prompt], n=2, temperature=0.8, top_p=0.9, seed=5, max_new_tokens=6)
    assert [c.model_extra["token_ids"] for c in r.choices] == [s.token_ids for s in out.samples]


def test_stop_strings_and_stop_token_ids(client):
    base = client.completions.create(model="tiny", prompt="t40 t41 t42", max_tokens=8, temperature=0)
    text, ids = base.choices[0].text, base.choices[0].model_extra["token_ids"]
    stop = f" t{ids[3]}"
    cut = text[: text.find(stop)]
    for stream in (False, True):
        kw = dict(model="tiny", prompt="t40 t41 t42", max_tokens=8, temperature=0, stop=[stop, "never"])
        if stream:
            chunks = list(client.completions.create(**kw, stream=True))
            got, fin = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(**kw)
            got, fin = r.choices[0].text, r.choices[0].finish_reason
        assert (got, fin) == (cut, "stop")
    r = client.completions.create(model="tiny", prompt="t40 t41 t42", max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [ids[2]]})
    assert r.choices[0].model_extra["token_ids"] == ids[:2] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 2


def test_penalties_and_logit_bias_match_a_float64_reference(tiny, client):
    hf, _ = tiny
    prompt, k = [9, 8, 7, 6, 5, 9, 8], 7
    bias = {"17": 3.0, "200": -100.0}
    for pres, freq in ((1.5, 0.0), (0.0, 2.0), (-1.0, 0.5)):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=k, temperature=0, presence_penalty=pres,
                                      frequency_penalty=freq, logit_bias=bias, logprobs=0)
        seq, want, lps = list(prompt), [], []
        with torch.no_grad():
            for _ in range(k):
                x = hf(torch.tensor([seq])).logits[0, -1].double()
                counts = torch.bincount(torch.tensor(want, dtype=torch.int64), minlength=VOCAB).double()
                x = x - freq * counts - pres * (counts > 0).double()
                for t, b in bias.items():
                    x[int(t)] += b
                want.append(int(x.argmax()))
                lps.append(torch.log_softmax(x, -1)[want[-1]].item())
                seq.append(want[-1])
        assert r.choices[0].model_extra["token_ids"] == want
        np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs, lps, atol=1e-4)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0.7, seed=1,
                                  logit_bias={"42": 100})
    assert r.choices[0].model_extra["token_ids"] == [42] * 4


def test_beam_search_and_best_of(tiny, client):
    hf, _ = tiny
    prompt = [5, 17, 99, 3, 42, 7]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, n=2, best_of=3,
                                  extra_body={"use_beam_search": True})
    ref = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=2, do_sample=False, max_new_tokens=5,
                       return_dict_in_generate=True)
    assert [c.model_extra["token_ids"] for c in r.choices] == ref.sequences[:, len(prompt):].tolist()
    kw = dict(model="tiny", prompt=prompt, max_tokens=4, temperature=1.0, seed=9)
    every = client.completions.create(**kw, n=3, logprobs=0).choices
    best = client.completions.create(**kw, n=1, best_of=3).choices
    cum = [sum(c.logprobs.token_logprobs) for c in every]
    assert len(best) == 1 and best[0].text == every[int(np.argmax(cum))].text and best[0].logprobs is None


@pytest.mark.parametrize("path,body,param", [
    ("completions", {"suffix": "t1"}, "suffix"),
    ("completions", {"foo": 1}, "foo"),
    ("completions", {"logprobs": 2, "echo": True}, "echo"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ("completions", {"best_of": 3, "n": 1, "stream": True}, "best_of"),
    ("completions", {"best_of": 1, "n": 2}, "best_of"),
    ("completions", {"length_penalty": 0.5}, "length_penalty"),
    ("completions", {"use_beam_search": True, "temperature": 0.7}, "temperature"),
    ("completions", {"use_beam_search": True, "stop": "t1"}, "stop"),
    ("completions", {"logit_bias": {"999": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"3": 101}}, "logit_bias"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"stop_token_ids": [256]}, "stop_token_ids"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "t1", "tool_calls": []}]}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "t1"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ("chat", {"messages": []}, "messages"),
])
def test_unsupported_or_bad_fields_get_400_naming_them(server, path, body, param):
    base = {"prompt": "t1 t2", "max_tokens": 2} if path == "completions" else {"messages": MESSAGES, "max_tokens": 2}
    url = f"{server[1].url}/v1/{'chat/completions' if path == 'chat' else 'completions'}"
    r = httpx.post(url, json={**base, **body}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="'suffix' is not supported"):
        client.completions.create(model="tiny", prompt="t1", suffix="t2")


# ---------------------------------------------------------------------- lifecycle
def test_dropped_non_streaming_request_frees_its_pages_within_a_second(server):
    sched, srv = server
    before = sched.stats()["steps"]
    body = {"prompt": list(range(1, 40)), "max_tokens": 450, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.5)
    dropped = time.monotonic()
    while sched.stats()["running"] and time.monotonic() - dropped < 1.0:
        time.sleep(0.01)
    assert time.monotonic() - dropped < 1.0, "the dropped request still runs"
    _idle_and_clean(sched)
    # stopped before its 450 tokens (an idle machine decodes ~300 of them in the 0.5 s timeout)
    assert sched.stats()["steps"] - before < 440


def test_dropped_beam_search_stops(server):
    sched, srv = server
    before = sched.stats()["steps"]
    body = {"prompt": list(range(1, 20)), "max_tokens": 400, "n": 4, "use_beam_search": True, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.5)
    _idle_and_clean(sched)
    assert sched.stats()["steps"] - before <= 1        # cancelled, not run to its 400 tokens


def test_forty_concurrent_requests_lose_nothing(server):
    sched, srv = server

    async def go():
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def one(i):
            if i % 2:
                r = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"t{i} t9"}],
                                                    max_tokens=3 + i % 4, temperature=0.5, seed=i)
                return r.usage.completion_tokens
            got = 0
            async for ch in await c.completions.create(model="tiny", prompt=[3, 4, i], max_tokens=3 + i % 4,
                                                       stream=True, temperature=0):
                got += len(ch.choices[0].model_extra["token_ids"]) if ch.choices else 0
            return got
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(40))), 60)
        finally:
            await c.close()
    assert asyncio.run(go()) == [3 + i % 4 for i in range(40)]
    _idle_and_clean(sched)


def test_models_advertises_what_the_pool_holds_and_429_retry_after(tiny):
    sched, srv = _serve(tiny[1], kv_tokens=256, start=False, max_queue=1)
    try:
        m = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
        assert m == sched.max_request_len() < 256
        assert sched.pages_needed(m - 1, 1, 1) <= sched.capacity_pages
        over = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1] * m, "max_tokens": 1}, timeout=10)
        assert over.status_code == 400
        results = []
        t = threading.Thread(target=lambda: results.append(httpx.post(
            f"{srv.url}/v1/completions", json={"prompt": [3] * (m - 1), "max_tokens": 1}, timeout=60)))
        t.start()
        end = time.monotonic() + 10
        while sched.num_queued < 1 and time.monotonic() < end:
            time.sleep(0.02)
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=10)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        sched.start()
        t.join(30)
        assert results[0].status_code == 200 and results[0].json()["usage"]["total_tokens"] == m
    finally:
        srv.stop()
        sched.stop()


def test_api_key(tiny):
    sched, srv = _serve(tiny[1], api_key="s3cret")
    try:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": MESSAGES}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "s3cret" not in r.text
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="t1", max_tokens=1).usage.completion_tokens == 1
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{srv.url}/metrics", timeout=10).status_code == 200
    finally:
        srv.stop()
        sched.stop()


def test_metrics(server, client):
    client.completions.create(model="tiny", prompt=[1, 2, 3, 4, 5, 6, 7, 8] * 4 + [1], max_tokens=3, temperature=0)
    client.completions.create(model="tiny", prompt=[1, 2, 3, 4, 5, 6, 7, 8] * 4 + [2], max_tokens=3, temperature=0,
                              n=2)
    text = httpx.get(f"{server[1].url}/metrics", timeout=10).text
    from prometheus_client.parser import text_string_to_metric_families

    vals = {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}
    assert vals["treeattn_kv_pages_total{}"] == server[0].engine.pool.num_pages
    assert vals["treeattn_num_requests_waiting{}"] == 0 and vals["treeattn_num_requests_running{}"] == 0
    assert 0 < vals["treeattn_prefix_cache_hit_rate{}"] < 1
    assert vals['treeattn_request_finished_total{"finish_reason": "length"}'] >= 3
    assert vals["treeattn_time_to_first_token_seconds_count{}"] >= 2
    assert vals["treeattn_time_per_output_token_seconds_count{}"] >= 2
    assert vals["treeattn_kv_read_saved_bytes_total{}"] > 0        # the n=2 choices share their prompt
    assert "treeattn_kv_pages_used" in text
    # step times: every step observed once (the server is idle); no GPU time on a CPU
    health = httpx.get(f"{server[1].url}/health", params={"decode_times_since": 0}, timeout=10).json()
    assert vals["treeattn_decode_step_seconds_count{}"] == health["decode_steps"] > 0
    assert vals["treeattn_prefill_step_seconds_count{}"] == health["prefill_steps"] > 0
    assert vals["treeattn_decode_step_seconds_sum{}"] == pytest.approx(health["decode_ms"] / 1e3)
    assert vals["treeattn_decode_step_gpu_seconds_count{}"] == health["decode_gpu_steps"] == 0
    times = health["decode_times"]
    assert times["first"] == 0 and len(times["wall_ms"]) == health["decode_steps"]
    assert min(times["wall_ms"]) >= 0 and set(times["gpu_ms"]) == {None}
    assert httpx.get(f"{server[1].url}/health", params={"decode_times_since": -1}, timeout=10).status_code == 422


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_with_requests_in_flight_exits_within_the_grace_period(tiny):
    port, grace = _free_port(), 1.0
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "TREEATTN_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "treeattn.cli", "serve", "--model", str(tiny[1]), "--port",
                             str(port), "--kv-tokens", "2048", "--shutdown-grace", str(grace), "--log-level",
                             "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < end, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        results = []

        def long_request():
            try:
                results.append(httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                                          json={"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True}))
            except httpx.HTTPError as e:
                results.append(e)
        threads = [threading.Thread(target=long_request) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        proc.wait(timeout=grace + 10)
        assert time.monotonic() - sent < grace + 3
        for t in threads:
            t.join(10)
        assert len(results) == 2          # every client got an answer or a closed connection
        out = proc.stdout.read().decode()
        assert "Bearer k" not in out and "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
