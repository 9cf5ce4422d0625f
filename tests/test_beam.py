"""Device-resident beam search against transformers: widths, decode windows shorter than the
search (re-planned trees), the Triton backend in the interpreter, and the KV pool afterwards."""
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from treeattn.engine import BeamSearchController, TreeEngine, TreeModel  # noqa: E402
from treeattn.engine.beam import _candidates, _inverse, _place  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, eos_token_id=None,
        bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("beam_llama")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, TreeModel.from_pretrained(path)


def _hf_beams(hf, prompt, k, n, new, **kw):
    ref = hf.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=n, do_sample=False,
                      max_new_tokens=new, output_scores=True, return_dict_in_generate=True, **kw)
    scores = ref.sequences_scores.tolist() if k > 1 else None    # (num_beams=1 is greedy search there)
    return ref.sequences.tolist(), scores


@pytest.mark.parametrize("k, window", [(1, 16), (3, 4), (8, 5)])
def test_widths_and_windows_match_transformers(tiny, k, window):
    hf, model = tiny
    prompt = [7, 3, 99, 12, 5, 64, 1]
    seqs, scores = _hf_beams(hf, prompt, k, k, 14, length_penalty=1.0, early_stopping=False)
    eng = TreeEngine(model, page_size=4, kv_tokens=1024, window=window)
    ours = eng.run(BeamSearchController(prompt, num_beams=k, max_new_tokens=14))
    assert ours["sequences"] == seqs
    if scores is not None:
        np.testing.assert_allclose(ours["scores"], scores, atol=1e-4)
    eng.reset()
    assert eng.pool.num_free_pages == eng.pool.num_pages


def test_eos_stops_early_with_results_frozen(tiny):
    """A search that finishes early: results equal transformers' even when the host keeps
    stepping until it polls the device's flag."""
    hf, model = tiny
    prompt = [7, 3, 99, 12, 5, 64, 1]
    plain = hf.generate(torch.tensor([prompt]), num_beams=4, do_sample=False, max_new_tokens=20)
    eos = int(plain[0, len(prompt) + 2])
    seqs, scores = _hf_beams(hf, prompt, 4, 2, 20, eos_token_id=eos, pad_token_id=eos, early_stopping=True)
    eng = TreeEngine(model, page_size=4, kv_tokens=1024)
    ours = eng.run(BeamSearchController(prompt, num_beams=4, max_new_tokens=20, eos_token_ids=[eos],
                                        early_stopping=True, num_return_sequences=2))
    for mine, theirs in zip(ours["sequences"], seqs):
        assert theirs[: len(mine)] == mine and set(theirs[len(mine):]) <= {eos}
    np.testing.assert_allclose(ours["scores"], scores, atol=1e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="a CPU model on the Triton backend needs the interpreter")
def test_triton_backend_in_interpreter(tiny):
    hf, model = tiny
    prompt = [7, 3, 99, 12, 5]
    seqs, scores = _hf_beams(hf, prompt, 3, 3, 5)
    eng = TreeEngine(model, page_size=4, kv_tokens=512, backend="triton")
    ours = eng.run(BeamSearchController(prompt, num_beams=3, max_new_tokens=5))
    assert ours["sequences"] == seqs
    np.testing.assert_allclose(ours["scores"], scores, atol=1e-4)


@pytest.mark.parametrize("bad, match", [
    (dict(prompt=[]), "non-empty prompt"),
    (dict(num_beams=0), "num_beams"),
    (dict(num_return_sequences=5), "num_return_sequences"),
    (dict(early_stopping="sometimes"), "early_stopping"),
])
def test_bad_arguments(bad, match):
    kw = dict(prompt=[1, 2], num_beams=4, max_new_tokens=4) | bad
    with pytest.raises(ValueError, match=match):
        BeamSearchController(kw.pop("prompt"), **kw)


def test_more_beams_than_candidates_refused_before_prefill(tiny):
    _, model = tiny
    eng = TreeEngine(model, page_size=4, kv_tokens=4096)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.run(BeamSearchController([1, 2], num_beams=200, max_new_tokens=2))
    assert eng.tree.num_nodes == 0


@pytest.mark.parametrize("seed", range(20))
def test_new_beams_stay_in_their_parents_leaves(seed):
    """Every parent's first new beam keeps the parent's leaf, the others fill the leaves that no new
    beam descends from: the leaves are a permutation, and no copy reads a leaf another writes."""
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, 17, (1,), generator=g))
    parent = torch.randint(0, k, (k,), generator=g)
    leaf = _place(parent)
    assert sorted(leaf.tolist()) == list(range(k))
    seen = set()
    for p, l in zip(parent.tolist(), leaf.tolist()):
        assert (l == p) == (p not in seen)
        seen.add(p)
    src = parent[_inverse(leaf)]         # the leaf each leaf copies from
    moved = src != torch.arange(k)
    assert not set(src[moved].tolist()) & set(torch.arange(k)[moved].tolist())


@pytest.mark.parametrize("k, vocab", [(1, 50), (4, 300), (8, 1000), (16, 129)])
def test_fused_candidates_equal_log_softmax_topk(device, k, vocab):
    """The fused selection (chunk candidates; Triton's interpreter on CPU) picks the same
    continuations with the same log-probabilities as log_softmax + topk over every beam's
    vocabulary."""
    g = torch.Generator().manual_seed(k * vocab)
    logits = (torch.randn(k, vocab, generator=g) * 4).to(device)
    scores = (torch.randn(k, generator=g) * 3).to(device)
    keep = 2 * k
    ref_v, ref_b, ref_t = _candidates(logits, scores, keep, fused=False)
    v, b, t = _candidates(logits, scores, keep, fused=True)
    torch.testing.assert_close(v, ref_v, rtol=0, atol=1e-5)
    assert sorted(zip(b.tolist(), t.tolist())) == sorted(zip(ref_b.tolist(), ref_t.tolist()))
