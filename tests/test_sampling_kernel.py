"""The fused sampling kernel (treeattn.launchers.gumbel_argmax) against the torch reference path of
treeattn.engine.sampling: the same tokens (the noise is an integer hash and the same float32
formula) and the same log-probabilities. Under Triton's interpreter on CPU (tests/conftest.py)."""
import numpy as np
import pytest
import torch

from treeattn.engine.sampling import LogNormaliser, Sampler, gumbel_noise, inverse_temperature
from treeattn.launchers import gumbel_argmax, row_topk_candidates


def _logits(rng, n, vocab, dtype, *, strided=False):
    x = torch.from_numpy(rng.standard_normal((n, vocab + 5)) * 3).to(dtype)
    # rows 5 entries apart (a slice of a wider matrix), or every other element of a row
    return x[:, 2:vocab + 2] if strided == "rows" else x.repeat_interleave(2, 1)[:, :2 * vocab:2] if strided else x[:, :vocab].contiguous()


def _reference(logits, streams, counter, scale):
    """The torch path: tokens of ``argmax(x + G)`` and log_softmax of ``x = logits.float() * scale``."""
    x = logits.float() * (scale[:, None] if isinstance(scale, torch.Tensor) else scale)
    y = x if streams is None else x + gumbel_noise(streams, counter, logits.shape[1])
    return y.argmax(-1), torch.log_softmax(x, -1)


def _check(device, logits, streams=None, counter=0, scale=1.0, **kw):
    """The kernel on ``device`` against the reference there: equal tokens, the log-probabilities of
    the drawn, the first and the last token within 1e-5."""
    on = [t.to(device) if isinstance(t, torch.Tensor) else t for t in (logits, streams, counter, scale)]
    logits, streams, counter, scale = on
    tokens, norm = gumbel_argmax(logits, streams=streams, counter=counter, scale=scale, stats=True, **kw)
    ref, lsm = _reference(logits, streams, counter, scale)
    assert torch.equal(tokens, ref)
    scaled = logits.float() * (scale[:, None] if isinstance(scale, torch.Tensor) else scale)
    for t in (tokens, torch.zeros_like(tokens), torch.full_like(tokens, logits.shape[1] - 1)):
        lp = LogNormaliser(scaled, 1.0, norm).logprobs(t)
        torch.testing.assert_close(lp, lsm.gather(-1, t[:, None]).squeeze(-1), rtol=1e-5, atol=1e-6)
    return tokens.cpu(), norm


# (the interpreter's cost is mostly per program: a few programs per case, several tiles each)
@pytest.mark.parametrize("n,vocab,dtype,strided,row_counter,temperature,parts", [
    (1, 1, torch.float32, False, False, 1.0, 1),
    (3, 7, torch.bfloat16, "rows", True, 0.7, 1),
    (5, 300, torch.float32, "cols", False, 1.3, 1),
    (3, 2001, torch.float32, "rows", False, 0.6, 2),   # (a partial last tile)
    (1, 2001, torch.bfloat16, False, True, 2.0, 3),
])
def test_gumbel_argmax_matches_the_torch_path(rng, device, n, vocab, dtype, strided, row_counter, temperature, parts):
    logits = _logits(rng, n, vocab, dtype, strided=strided)
    streams = torch.from_numpy(rng.integers(0, 2**40, n))
    counter = torch.from_numpy(rng.integers(0, 2**32, n)) if row_counter else int(rng.integers(2**31, 2**32))
    _check(device, logits, streams, counter, inverse_temperature(temperature), block=128, parts=parts)


def test_per_row_scale_and_greedy(rng, device):
    logits = _logits(rng, 3, 300, torch.bfloat16)
    scale = torch.from_numpy(inverse_temperature(np.array([0.5, 1.0, 3.0])))
    _check(device, logits, torch.arange(3), torch.tensor([0, 1, 2**32 - 1]), scale, block=128, parts=1)
    _check(device, logits, block=128, parts=1)  # greedy: argmax(x) and the statistics


def test_ties_go_to_the_first_index(rng, device):
    # greedy: bf16 integers tie everywhere, across lanes, tiles and programs
    logits = torch.from_numpy(rng.integers(0, 3, (2, 1000))).to(torch.bfloat16)
    logits[1] = 1.0
    tokens, _ = _check(device, logits, block=128, parts=2)
    assert tokens[1] == 0
    # noisy: two entries with the same 23-bit uniform (so equal noise) and equal logits
    counter, vocab, found = 12345, 1000, []
    g = gumbel_noise(torch.arange(400), counter, vocab)
    for s in range(400):
        vals, counts = np.unique(g[s].numpy(), return_counts=True)
        for v in vals[counts > 1]:
            j, k = np.flatnonzero(g[s].numpy() == v)[:2]
            found.append((s, j, k))
        if len({k // 512 == j // 512 for _, j, k in found}) == 2:  # a tie inside a program and across
            break
    rows = [next(f for f in found if (f[2] // 512 == f[1] // 512) == same) for same in (True, False)]
    logits = torch.zeros(2, vocab)
    for r, (_, j, k) in enumerate(rows):
        logits[r, [j, k]] = 30.0
    tokens, _ = _check(device, logits, torch.tensor([s for s, _, _ in rows]), counter, block=128, parts=2)
    assert tokens.tolist() == [j for _, j, _ in rows]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy's, on the NaN and inf lanes)
def test_nan_and_inf_rows_follow_torch_argmax(rng, device):
    logits = _logits(rng, 4, 300, torch.float32)
    logits[0, [70, 150, 250]] = float("nan")     # the first NaN of a lane, of a program, of the row
    logits[1, 5:] = float("nan")
    logits[2] = float("-inf")                    # nothing drawable: token 0, as torch.argmax
    logits[3, [10, 200]] = float("inf")
    logits, streams = logits.to(device), torch.arange(4, device=device)
    tokens, norm = gumbel_argmax(logits, streams=streams, counter=7, stats=True, block=64, parts=2)
    ref, lsm = _reference(logits, streams, 7, 1.0)
    assert tokens.tolist() == ref.tolist() == [70, 5, 0, 10]
    lp = LogNormaliser(logits, 1.0, norm).logprobs(tokens)
    assert torch.isnan(lp).all() and torch.isnan(lsm.gather(-1, ref[:, None])).all()


def test_sampler_draws_as_its_torch_path(rng, device):
    """Sampler's fused path (on CUDA; on the CPU the kernel fed what the Sampler feeds it there:
    its scale, counter, filtered scores) against its torch path, which the CPU runs."""
    logits = _logits(rng, 2, 200, torch.float32).to(device)
    streams = torch.tensor([5, 2**33 + 1], device=device)
    for s in (Sampler(0.7, seed=3), Sampler(1.2, top_k=20, seed=4), Sampler(greedy=True)):
        x = s.filtered(logits)
        ref = x.argmax(-1) if s.greedy else (x + s.gumbel(streams, 9, 200)).argmax(-1)
        if logits.is_cuda:
            tokens, norm = s.draw(logits, streams=streams, step=9)
        else:
            x, scale = s._fused_input(logits)
            tokens, stats = gumbel_argmax(x, streams=None if s.greedy else streams, counter=s._counter(9),
                                          scale=scale, stats=True, block=128, parts=1)
            norm = LogNormaliser(x, scale, stats)
        assert torch.equal(tokens, ref)
        torch.testing.assert_close(s.logprobs(logits, ref, norm=norm), s.logprobs(logits, ref, filtered=s.filtered(logits)),
                                   rtol=1e-5, atol=1e-6)


def test_gumbel_argmax_rejects_bad_input():
    x = torch.zeros(2, 5)
    for kw, match in ((dict(streams=torch.zeros(3, dtype=torch.int64)), "streams"),
                      (dict(streams=torch.zeros(2, dtype=torch.int32)), "streams"),
                      (dict(counter=2**32), "counter"), (dict(scale=0.0), "scale"),
                      (dict(scale=torch.ones(2, dtype=torch.float64)), "scale"), (dict(block=100), "block")):
        with pytest.raises(ValueError, match=match):
            gumbel_argmax(x, **kw)
    for bad in (torch.zeros(5), torch.zeros(2, 0), torch.zeros(2, 5, dtype=torch.int64)):
        with pytest.raises(ValueError, match="logits|vocab"):
            gumbel_argmax(bad)


@pytest.mark.parametrize("n, vocab, k, block", [(1, 5, 3, 16), (3, 200, 16, 64), (2, 1000, 20, 128)])
def test_row_topk_candidates_hold_each_rows_top_k(device, n, vocab, k, block):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(n, vocab, generator=g).to(device)
    x[0, : min(4, vocab)] = 7.0                       # ties: the first indices win
    v, i = row_topk_candidates(x, k, block=block)
    assert v.shape == i.shape and v.shape[1] >= k
    for r in range(n):
        top = torch.topk(x[r], min(k, vocab)).values
        got = torch.topk(v[r], min(k, vocab)).values
        torch.testing.assert_close(got, top)
        real = i[r] >= 0
        assert torch.equal(x[r, i[r][real].long()], v[r][real])      # each value sits at its index
        assert torch.isneginf(v[r][~real]).all()
        assert len(set(i[r][real].tolist())) == int(real.sum())      # no entry twice


def test_row_topk_candidates_rejects_bad_input():
    x = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="k must be"):
        row_topk_candidates(x, 33)
    with pytest.raises(ValueError, match="power of two"):
        row_topk_candidates(x, 4, block=48)
    with pytest.raises(ValueError, match="logits"):
        row_topk_candidates(x[0], 4)
