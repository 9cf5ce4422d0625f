"""The scheduler's loop without HTTP, on a tiny random model on the CPU: decode step ``t + 1`` is
enqueued before step ``t``'s tokens are read (overlap) and the outputs equal the synchronous loop's;
long prompts are prefilled in chunks between decode steps, equal to one prefill, and a request
cancelled in the middle of its chunks leaves no page behind."""
import contextlib
import threading
import time

import pytest

from treeattn.engine import TreeEngine, TreeModel
from treeattn.serve import PrefixCache, SamplingParams, Scheduler
from treeattn.serve import scheduler as scheduler_module

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 256


def _scheduler(*, eos=(), tokenizer=False, kv_tokens=2048, **kw):
    model = TreeModel.random("tiny")
    if eos:
        model.config = model.config.with_eos(eos)
    if tokenizer:               # a word-level tokenizer of t0 .. t255, for stop strings
        tokenizers = pytest.importorskip("tokenizers")
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
        model.tokenizer = tok
    engine = TreeEngine(model, kv_tokens=kv_tokens, page_size=16, keep_reserved=True)
    return Scheduler(engine, block_tokens=16, **kw)


class _Collect:
    """``emit`` of one request: its events per choice; ``done`` is set when every choice ended."""

    def __init__(self, n=1, on_event=None):
        self.tokens, self.finish, self.logprobs = [[] for _ in range(n)], [None] * n, [[] for _ in range(n)]
        self.done, self.error, self.on_event = threading.Event(), None, on_event

    def __call__(self, events):
        if isinstance(events, str):
            self.error = events
            self.done.set()
            return
        for ev in events:
            if ev.token is not None:
                self.tokens[ev.choice].append(ev.token)
            if ev.logprob is not None:
                self.logprobs[ev.choice].append((ev.logprob, ev.top))
            self.finish[ev.choice] = ev.finish
        if self.on_event is not None:
            self.on_event(self)
        if all(f is not None for f in self.finish):
            self.done.set()


def _run(sched, requests, timeout=30.0):
    """Submit ``(prompt, params[, collector])`` before the engine thread starts (one admission), run
    them to their end; returns the collectors."""
    out = []
    for r in requests:
        got = r[2] if len(r) > 2 else _Collect(r[1].n)
        sched.submit(r[0], r[1], got)
        out.append(got)
    sched.start()
    try:
        for got in out:
            assert got.done.wait(timeout), "a request did not finish"
            assert got.error is None, got.error
        _assert_clean(sched)
    finally:
        sched.stop()
    return out


def _assert_clean(sched, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = sched.stats()
        if s["running"] == 0 and s["waiting"] == 0 and sched.num_queued == 0:
            break
        time.sleep(0.01)
    sched.flush_cache()
    s = sched.stats()
    assert s["running"] == 0 and s["free_pages"] == s["num_pages"], s
    sched.call(sched.engine.pool.check)


def test_overlap_enqueues_the_next_step_before_reading_this_one(monkeypatch):
    log = []
    wait = scheduler_module._HostCopy.wait
    monkeypatch.setattr(scheduler_module._HostCopy, "wait", lambda self: (log.append("read"), wait(self))[1])
    for overlap, want in ((True, "decode read " * 3 + "read"), (False, "read decode " * 3 + "read")):
        sched = _scheduler(overlap=overlap)
        decode = sched.engine.decode

        def logged(nodes, tokens, decode=decode, **kw):
            log.append("decode")
            return decode(nodes, tokens, **kw)
        sched.engine.decode = logged
        log.clear()
        (got,) = _run(sched, [([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))])
        assert " ".join(log) == want.strip() and len(got.tokens[0]) == 4   # no step beyond max_tokens


def _mixed(probe):
    """Seeded, greedy, penalised and log-prob requests; stops at tokens / strings the probe run
    (no stops) produced, so that several choices stop early."""
    base = [
        ([1, 2, 3, 4], {"n": 2, "temperature": 0.9, "top_p": 0.9, "seed": 3}),
        ([9, 8, 7], {"temperature": 0}),
        ([9, 8, 7, 6, 5], {"temperature": 0.7, "seed": 5, "presence_penalty": 1.0, "frequency_penalty": 0.5,
                           "logprobs": 2}),
        ([40, 41], {"n": 3, "temperature": 1.2, "seed": 8, "logit_bias": ((17, 2.0),)}),
    ]
    out = []
    for r, (prompt, kw) in enumerate(base):
        if probe is not None:
            toks = probe[r].tokens[0]
            kw = {**kw, "stop_token_ids": (toks[3],)} if r % 2 == 0 else {**kw, "stop": (f"t{toks[5]}",)}
        out.append((prompt, SamplingParams(max_tokens=10, **kw)))
    return out


def test_overlapped_outputs_equal_the_synchronous_loop():
    probe = _run(_scheduler(tokenizer=True, overlap=False), _mixed(None))
    eos = probe[1].tokens[0][7]          # the model's EOS ends request 1 (and maybe others) early
    runs = [_run(_scheduler(eos=(eos,), tokenizer=True, overlap=o), _mixed(probe)) for o in (False, True)]
    sync, over = ([(g.tokens, g.finish, g.logprobs) for g in run] for run in runs)
    assert over == sync
    assert sum(f.count("stop") for _, f, _ in sync) >= 4 and sum(f.count("length") for _, f, _ in sync) >= 1


def _long_prompt_run(chunk, *, long_len=150, abort_after=None):
    """A running request (``short``, 12 greedy tokens) and a ``long_len``-token prompt queued behind
    it; with ``abort_after`` the long one is cancelled once ``short`` has that many tokens."""
    sched = _scheduler(prefill_chunk=chunk)
    short_seen = []          # short's token count when each of long's events came

    def on_short(c):
        if abort_after is not None and len(c.tokens[0]) == abort_after:
            sched.abort(long_id)
    short, long = _Collect(on_event=on_short), _Collect(on_event=lambda c: short_seen.append(len(short.tokens[0])))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sched.submit([3, 1, 4, 1, 5], params, short)
    long_id = sched.submit([(7 * i + 3) % VOCAB for i in range(long_len)], params, long)
    sched.start()
    try:
        assert short.done.wait(30) and short.error is None
        if abort_after is None:
            assert long.done.wait(30) and long.error is None
        _assert_clean(sched)
        return short, long, short_seen, sched.stats()
    finally:
        sched.stop()


def test_chunked_prefill_equals_one_prefill_and_lets_running_requests_decode():
    # 32 tokens a step: short's prompt (5) and long's first 16, then long's chunks end at 48, 80,
    # 112, 144 and its last 6 tokens are prefilled with its placement
    short, long, seen, stats = _long_prompt_run(32)
    short0, long0, seen0, stats0 = _long_prompt_run(0)
    assert long.tokens == long0.tokens and short.tokens == short0.tokens
    assert stats["prefill_chunks"] == 5 and stats0["prefill_chunks"] == 0
    assert seen[0] == 6 and seen0[0] == 1      # short decoded one token per chunk while long waited
    assert stats["prefill_tokens"] == stats0["prefill_tokens"] == 155 and stats["prefix_hit_tokens"] == 0


def test_cancelled_in_the_middle_of_its_chunks_frees_its_pages():
    short, long, seen, stats = _long_prompt_run(16, long_len=200, abort_after=3)
    assert seen == [] and long.finish == [None]         # never placed, never emitted
    assert 2 <= stats["prefill_chunks"] < 12 and short.finish == ["length"]


def test_prefix_chunks_are_pinned_shared_and_counted_once():
    engine = TreeEngine(TreeModel.random("tiny"), kv_tokens=1024, page_size=16)
    cache, pool = PrefixCache(engine, block_tokens=16), engine.pool
    prompt = list(range(1, 60))
    node, at = cache.insert_prefix(prompt, 32)
    assert at == 32 and cache.miss_tokens == 32 and cache.evict(pool.num_pages + 1) == 0   # pinned
    assert cache.match(prompt[:40] + [0])[1] == 32      # shared with other prompts already
    with pytest.raises(ValueError, match="multiple of 16"):
        cache.insert_prefix(prompt, 40)
    last = cache.insert(prompt, counted=at)
    assert (cache.hit_tokens, cache.miss_tokens) == (0, 59)
    cache.unpin(node)
    cache.release(last)
    assert cache.clear() == 4 and pool.num_free_pages == pool.num_pages
    pool.check()


def test_requests_admitted_together_share_one_prefill_pass():
    """Four prompts admitted in one iteration, two sharing a system prompt none had cached (the
    later ones match the first one's blocks, written in the same pass): one forward pass, and the
    greedy outputs and prefix hits of prefilling them one at a time."""
    system = list(range(100, 132))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reqs = [(system + [1, 2, 3], params), ([7, 8, 9], params), (system + [4, 5], SamplingParams(
        n=2, max_tokens=6, temperature=0, ignore_eos=True)), (system + [6], params)]
    runs = []
    for batched, bound in ((True, None), (False, None), (True, 36)):
        sched = _scheduler()
        model, calls = sched.engine.model, []
        prefill = model.prefill
        model.prefill = lambda *a, **kw: (calls.append(a[0].shape[0]), prefill(*a, **kw))[1]
        if not batched:
            sched.engine.batched_prefill = contextlib.nullcontext
        if bound:            # a pass runs as soon as its queue holds this many tokens
            sched.engine.prefill_tokens = bound
        got = _run(sched, reqs)
        runs.append(([g.tokens for g in got], calls, sched.cache.hit_tokens))
    (tokens, calls, hits), (tokens1, calls1, hits1), (tokens2, calls2, hits2) = runs
    assert calls == [35 + 3 + 2 + 1] and calls1 == [35, 3, 2, 1] and calls2 == [35 + 3, 2 + 1]
    assert hits == hits1 == hits2 == 2 * len(system) and tokens == tokens1 == tokens2


def test_serve_cli_options():
    import argparse

    from treeattn.cli.serve import add_serve_parser

    sub = argparse.ArgumentParser().add_subparsers()
    p = add_serve_parser(sub)
    a = p.parse_args(["--random-weights", "tiny"])
    assert (a.prefill_chunk, a.no_overlap) == (2048, False)
    a = p.parse_args(["--random-weights", "tiny", "--prefill-chunk", "0", "--no-overlap"])
    assert (a.prefill_chunk, a.no_overlap) == (0, True)
    with pytest.raises(ValueError, match="prefill_chunk"):
        _scheduler(prefill_chunk=-1)
