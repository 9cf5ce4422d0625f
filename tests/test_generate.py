"""The engine's user API (generate, beam_search), counter-based seeded sampling and EOS pruning at
prune points, on a tiny random Llama against transformers (fp32, CPU, torch attention backend)."""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from treeattn.engine import Sampler, SamplingController, TreeEngine, TreeModel  # noqa: E402
from treeattn.engine.sampling import sample_streams  # noqa: E402
from helpers import save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, model dir, model dir with a word-level tokenizer of tokens ``t0 .. t255``)."""
    plain = tmp_path_factory.mktemp("tiny_llama")
    hf = save_tiny_llama(plain, vocab=VOCAB)
    with_tok = tmp_path_factory.mktemp("tiny_llama_tok")
    save_tiny_llama(with_tok, vocab=VOCAB, tokenizer=True)     # (the same seed: the same weights)
    return hf, plain, with_tok


@pytest.fixture(scope="module")
def model(tiny):
    return TreeModel.from_pretrained(tiny[1])


def engine(model, **kw):
    return TreeEngine(model, **{"page_size": 4, "kv_tokens": 2048, **kw})


# ---------------------------------------------------------------------- generate
def test_greedy_generate_matches_transformers(tiny, model):
    hf, _, _ = tiny
    prompts = [[5, 17, 99, 3, 42, 7, 1, 200], [9, 8, 7]]
    eng = engine(model)
    outs = eng.generate(prompts, temperature=0, max_new_tokens=12)
    assert eng.pool.num_free_pages == eng.pool.num_pages and eng.tree.num_nodes == 0
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, output_scores=True,
                          return_dict_in_generate=True)
        (s,) = out.samples
        assert out.prompt_token_ids == prompt and s.token_ids == ref.sequences[0, len(prompt):].tolist()
        ref_lp = [torch.log_softmax(sc[0].double(), -1)[t].item() for sc, t in zip(ref.scores, s.token_ids)]
        np.testing.assert_allclose(s.logprobs, ref_lp, atol=1e-4)
        assert s.cumulative_logprob == pytest.approx(sum(ref_lp), abs=1e-3)
        assert s.finish_reason == "length" and s.text is None


def test_generate_text_with_tokenizer(tiny):
    m = TreeModel.from_pretrained(tiny[2])
    eng = engine(m)
    (out,) = eng.generate("t5 t17 t99", n=3, temperature=0.7, seed=4, max_new_tokens=5)
    assert out.prompt_token_ids == [5, 17, 99] and len(out.samples) == 3
    for s in out.samples:
        assert len(s.token_ids) == 5 and s.text == " ".join(f"t{t}" for t in s.token_ids)
    beams = eng.beam_search("t5 t17 t99", num_beams=2, max_new_tokens=4)
    assert beams.text == [" ".join(f"t{t}" for t in s) for s in beams.sequences]
    with pytest.raises(ValueError, match="no tokenizer"):
        engine(TreeModel.from_pretrained(tiny[1])).generate("t1 t2")


def test_beam_search_matches_transformers(tiny, model):
    hf, _, _ = tiny
    prompt = [5, 17, 99, 3, 42, 7, 1, 200]
    out = engine(model).beam_search(prompt, num_beams=4, max_new_tokens=8, num_return_sequences=3)
    ref = hf.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=3, do_sample=False,
                      max_new_tokens=8, output_scores=True, return_dict_in_generate=True)
    assert out.sequences == ref.sequences[:, len(prompt):].tolist() and out.prompt_token_ids == prompt
    np.testing.assert_allclose(out.scores, ref.sequences_scores.tolist(), atol=1e-4)


@pytest.mark.parametrize("kw", [dict(temperature=0.9), dict(temperature=1.3, top_k=20), dict(top_p=0.8)])
def test_seeded_samples_do_not_depend_on_the_batch(model, kw):
    a, b, c = [5, 17, 99, 3], [9, 8, 7], list(range(40, 60))
    eng = engine(model)
    alone = eng.generate([a], n=2, seed=11, max_new_tokens=8, **kw)[0]
    mixed = eng.generate([c, a, b], n=5, seed=11, max_new_tokens=8, stop_token_ids=[3], **kw)
    for j in range(2):     # the stop token only cuts samples short
        mine, ref = mixed[1].samples[j].token_ids, alone.samples[j].token_ids
        assert mine == ref[: len(mine)] and (len(mine) == len(ref) or mine[-1] == 3)
        np.testing.assert_allclose(mixed[1].samples[j].logprobs, alone.samples[j].logprobs[: len(mine)], atol=1e-5)
    assert eng.generate([a], n=2, seed=11, max_new_tokens=8, **kw)[0] == alone
    assert eng.generate([a], n=2, seed=12, max_new_tokens=8, **kw)[0].samples != alone.samples
    assert len({tuple(s.token_ids) for s in mixed[0].samples}) > 1


@pytest.mark.parametrize("kw, match", [
    (dict(n=0), "n must be >= 1"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[]), "non-empty"),
    (dict(prompts=[[1, VOCAB]]), f"token id {VOCAB} is out of"),
    (dict(prompts=[[1, -3]]), "token id -3 is out of"),
    (dict(stop_token_ids=[VOCAB + 5]), "stop_token_ids"),
    (dict(n=64, max_new_tokens=200), "KV pages"),
    (dict(prompts=[list(range(200)) * 12]), "KV pages"),
])
def test_generate_rejects_bad_arguments_before_any_work(model, kw, match):
    eng = engine(model, kv_tokens=1024)
    prompts = kw.pop("prompts", [[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match=match):
        eng.generate(prompts, **kw)
    assert not eng.stats and eng.tree.num_nodes == 0 and eng.pool.num_free_pages == eng.pool.num_pages


@pytest.mark.parametrize("kw, match", [
    (dict(num_beams=0), "num_beams"),
    (dict(num_beams=VOCAB + 1), "num_beams"),
    (dict(num_return_sequences=5), "num_return_sequences"),
    (dict(num_return_sequences=0), "num_return_sequences"),
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[1, 999]), "token id 999"),
    (dict(eos_token_ids=[-1]), "eos_token_ids"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(num_beams=32, max_new_tokens=200), "KV pages"),
])
def test_beam_search_rejects_bad_arguments_before_any_work(model, kw, match):
    eng = engine(model, kv_tokens=1024)
    prompt = kw.pop("prompt", [1, 2, 3])
    with pytest.raises(ValueError, match=match):
        eng.beam_search(prompt, **kw)
    assert not eng.stats and eng.tree.num_nodes == 0


def test_generate_needs_an_idle_engine(model):
    eng = engine(model)
    eng.prefill(eng.tree.add_root(), [1, 2, 3])
    with pytest.raises(ValueError, match="reset"):
        eng.generate([[1, 2]])


# ---------------------------------------------------------------------- EOS at prune points
def _eos_run(model, prune_every, *, forced=None, n=6, steps=30):
    eng = engine(model)
    start = eng.pool.num_free_pages
    eos = list(range(0, VOCAB, 11))
    ctl = SamplingController([list(range(1, 10)), [7, 7, 7, 7, 7]], n=n, sampler=Sampler(temperature=1.5, seed=2),
                             max_new_tokens=steps, eos_token_ids=eos, prune_every=prune_every, logprobs=True,
                             forced_lengths=forced)
    leaves = eng.run(ctl)["leaves"]
    return eng, start, eos, {(leaf["prompt"], leaf["sample"]): leaf for leaf in leaves}


@pytest.mark.parametrize("prune_every", [3, 8, 100])
def test_pruning_at_prune_points_equals_pruning_every_step(model, prune_every):
    _, _, eos, ref = _eos_run(model, 1)
    eng, _, _, got = _eos_run(model, prune_every)
    assert sorted(got) == sorted(ref) and len(ref) == 12
    assert 0 < sum(leaf["finished"] for leaf in ref.values()) < 12     # some stopped, some ran to the end
    for key, r in ref.items():
        g = got[key]
        assert g["tokens"] == r["tokens"] and g["finished"] == r["finished"]
        assert len(g["logprobs"]) == len(g["tokens"]) - (9 if key[0] == 0 else 5)
        np.testing.assert_allclose(g["logprobs"], r["logprobs"], atol=1e-5)
        assert torch.allclose(g["logits"], r["logits"], atol=1e-5)
        assert (g["tokens"][-1] in eos) == g["finished"]
        assert not any(t in eos for t in g["tokens"][-len(g["logprobs"]): -1])   # nothing after an EOS
    assert all(leaf["node"] not in eng.tree for leaf in got.values() if leaf["finished"])


def test_forced_eos_rollout_frees_every_page(model):
    lengths = np.array([[3, 9, 1, 17, 25, 40], [2, 2, 5, 8, 13, 21]])   # 40: past the cap, ends by length
    eng, start, eos, got = _eos_run(model, 4, forced=lengths, steps=30)
    for (p, j), leaf in got.items():
        gen = len(leaf["logprobs"])
        assert gen <= lengths[p, j] and (leaf["finished"] or gen == 30)
        assert leaf["finished"] == (leaf["tokens"][-1] in eos)
    eng.reset()
    eng.pool.check()
    assert eng.pool.num_free_pages == start == eng.pool.num_pages
    # every sample ended by EOS: the run itself freed every page
    eng, start, _, got = _eos_run(model, 4, forced=np.minimum(lengths, 30), steps=30)
    assert all(leaf["finished"] for leaf in got.values())
    assert eng.pool.num_free_pages == start and eng.tree.num_nodes == 0


# ---------------------------------------------------------------------- counter-based sampling
@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.7, top_k=5), dict(top_p=0.6)])
def test_counter_based_sampling_follows_the_distribution(kw):
    """Frequencies of 40k draws (40k streams, one step) against the float64 filtered softmax."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2, 1.5], dtype=torch.float64)
    s = Sampler(seed=5, **kw)
    x = logits / s.temperature
    if s.top_k:
        x = torch.where(x >= torch.topk(x, s.top_k).values[-1], x, -torch.inf)
    p = torch.softmax(x, 0)
    if s.top_p < 1:
        order = torch.argsort(p, descending=True)
        drop = (torch.cumsum(p[order], 0) - p[order]) >= s.top_p
        p[order[drop]] = 0
        p /= p.sum()
    draws = 40000
    tokens = s.sample(logits.float()[None].expand(draws, -1), streams=torch.arange(draws), step=3)
    freq = torch.bincount(tokens, minlength=8).double() / draws
    assert (freq - p).abs().max() < 4 * (0.25 / draws) ** 0.5
    assert torch.all(freq[p == 0] == 0)
    lp = s.logprobs(logits.float()[None], torch.tensor([0]))
    assert lp.item() == pytest.approx(torch.log(p[0]).item(), abs=1e-5)


def test_streams_are_per_prompt_and_sample():
    a = sample_streams(3, [1, 2, 3], 4)
    assert a.tolist() == sample_streams(3, [1, 2, 3], 4).tolist()
    assert a[2:].tolist() == sample_streams(3, [1, 2, 3], 2, first=2).tolist()
    assert len(set(a.tolist()) | set(sample_streams(3, [1, 2, 4], 4).tolist())) == 8
    assert set(a.tolist()).isdisjoint(sample_streams(4, [1, 2, 3], 4).tolist())
