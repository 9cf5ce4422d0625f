"""The fused layer kernels (treeattn.engine.fused; Triton's interpreter on CPU) against the PyTorch
reference ops of treeattn.engine.model, and the whole model with and without them.

On CPU the interpreter rounds float32 -> bfloat16 by truncation (the GPU rounds to nearest even),
so bf16 results are compared with a tolerance rather than bit for bit."""
import pytest
import torch
import torch.nn.functional as F
from helpers import rel_l2

from treeattn.engine import ModelConfig, TreeModel, fused
from treeattn.engine.model import apply_rope, rms_norm

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**31)))


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def rms_norm_ref(x, w, eps):
    """``model.rms_norm`` rounded as the kernel's backend rounds: Triton's CPU interpreter casts
    float32 -> bfloat16 by truncation (the GPU and torch round to nearest), and with two casts on
    a 64-wide row the rounding modes alone differ by up to 1.2% relative L2 (measured over 200
    seeds), so bf16 on the CPU is checked against the truncating computation."""
    if not (x.dtype == torch.bfloat16 and x.device.type == "cpu"):
        return rms_norm(x, w, eps)

    def trunc(t):
        return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return trunc(w.float() * trunc(xf).float())


def assert_close(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.dtype == torch.float32:
        err = (out - ref).abs().max().item()
        assert err <= 1e-5 * max(ref.abs().max().item(), 1e-30), err
    else:
        assert rel_l2(out, ref) <= 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, hidden", [(1, 64), (3, 96), (17, 64)])
def test_rms_norm(gen, device, dtype, n, hidden):
    x = randn(gen, n, hidden, dtype=dtype, scale=3.0).to(device)
    w = randn(gen, hidden, dtype=dtype).to(device)
    d = randn(gen, n, hidden, dtype=dtype).to(device)
    assert_close(fused.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    h, y = fused.add_rms_norm(x, d, w, 1e-5)
    assert_close(h, x + d)
    assert_close(y, rms_norm_ref(h, w, 1e-5))
    # in place into delta, into given buffers, and rows with a stride (a slice of a wider tensor)
    wide = randn(gen, n, 2 * hidden, dtype=dtype).to(device)
    out, d2 = torch.empty_like(x), d.clone()
    h2, y2 = fused.add_rms_norm(x, d2, w, 1e-5, h_out=d2, out=out)
    assert h2 is d2 and y2 is out and torch.equal(h2, h) and torch.equal(y2, y)
    assert_close(fused.rms_norm(wide[:, :hidden], w, 1e-6), rms_norm_ref(wide[:, :hidden], w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, heads, kv_heads, head_dim", [(1, 4, 1, 16), (3, 2, 2, 64), (17, 4, 2, 128)])
def test_rope_qkv_cache(gen, device, dtype, n, heads, kv_heads, head_dim):
    qs, kvs, num_slots, max_pos = heads * head_dim, kv_heads * head_dim, 3 * n + 5, 1000
    qkv = randn(gen, n, qs + 2 * kvs, dtype=dtype).to(device)
    ang = torch.rand(max_pos, head_dim // 2, generator=gen) * 6.3
    cos, sin = (torch.cat((f(ang), f(ang)), -1).to(dtype).to(device) for f in (torch.cos, torch.sin))
    positions = torch.randint(0, max_pos, (n,), generator=gen).to(device)
    slots = torch.randperm(num_slots, generator=gen)[:n].to(device)
    kc = randn(gen, num_slots, kv_heads, head_dim, dtype=dtype).to(device)
    vc = randn(gen, num_slots, kv_heads, head_dim, dtype=dtype).to(device)

    q_ref, k_ref, v_ref = qkv.split([qs, kvs, kvs], dim=-1)
    c, s = cos.index_select(0, positions), sin.index_select(0, positions)
    q_ref = apply_rope(q_ref.reshape(n, heads, head_dim), c, s)
    k_ref = apply_rope(k_ref.reshape(n, kv_heads, head_dim), c, s)
    v_ref = v_ref.reshape(n, kv_heads, head_dim).clone()
    kc_ref, vc_ref = kc.clone().index_copy_(0, slots, k_ref), vc.clone().index_copy_(0, slots, v_ref)

    q_out = torch.empty(n, heads, head_dim, dtype=dtype, device=device)
    counter = torch.full((1,), -1, dtype=torch.int32, device=device)
    q, k, v = fused.rope_qkv_cache(qkv, cos, sin, positions, slots, kc, vc, heads, kv_heads, head_dim,
                                   q_out=q_out, layer_out=counter, layer=n + 6)
    assert q is q_out and counter.item() == n + 6   # the attention graph's layer counter
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(v, v_ref)
    assert_close(kc, kc_ref)
    assert torch.equal(vc, vc_ref)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert torch.equal(kc[untouched], kc_ref[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, inter", [(1, 40), (3, 200), (17, 1100)])
def test_swiglu(gen, device, dtype, n, inter):
    gu = randn(gen, n, 2 * inter, dtype=dtype, scale=2.0).to(device)
    gate, up = gu.chunk(2, dim=-1)
    assert_close(fused.swiglu(gu), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("planes, kv_heads, head_dim", [(4, 2, 16), (70, 1, 24), (3, 5, 8)])
def test_copy_slots_moves_only_pairs_that_move(gen, device, dtype, planes, kv_heads, head_dim):
    kv = randn(gen, planes, 40, kv_heads, head_dim, dtype=dtype).to(device)
    # slots 0-9 are sources (or copy onto themselves), 20-29 destinations
    src = torch.tensor([0, 3, 3, 7, 5, 9], device=device)
    dst = torch.tensor([0, 20, 21, 7, 29, 9], device=device)
    ref = kv.clone()
    ref[:, dst] = ref[:, src]
    fused.copy_slots(kv, src, dst.int())
    assert torch.equal(kv, ref)
    fused.copy_slots(kv, src[:0], dst[:0])       # nothing to copy
    assert torch.equal(kv, ref)


def test_invalid_arguments(device):
    kv = torch.zeros(2, 8, 1, 16, device=device)
    with pytest.raises(ValueError, match="src"):
        fused.copy_slots(kv, torch.zeros(2, device=device), torch.zeros(2, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="differ in length"):
        fused.copy_slots(kv, torch.zeros(2, dtype=torch.int64, device=device),
                         torch.zeros(3, dtype=torch.int64, device=device))

    x = torch.randn(3, 64, device=device)
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(x, torch.randn(32, device=device), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        fused.add_rms_norm(x, x.half(), torch.randn(64, device=device), 1e-6)
    with pytest.raises(ValueError, match="gate_up"):
        fused.swiglu(torch.randn(3, 7, device=device))
    qkv, cache = torch.randn(3, 6 * 16, device=device), torch.zeros(8, 1, 16, device=device)
    tab, idx = torch.zeros(8, 16, device=device), torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="qkv"):
        fused.rope_qkv_cache(qkv, tab, tab, idx, idx, cache, cache, 3, 2, 16)
    with pytest.raises(ValueError, match="positions"):
        fused.rope_qkv_cache(qkv, tab, tab, idx.float(), idx, cache, cache, 4, 1, 16)
    with pytest.raises(ValueError, match="k_cache"):
        fused.rope_qkv_cache(qkv, tab, tab, idx, idx, cache.half(), cache, 4, 1, 16)
    with pytest.raises(ValueError, match="layer_out"):
        fused.rope_qkv_cache(qkv, tab, tab, idx, idx, cache, cache, 4, 1, 16, layer_out=idx[:1], layer=2)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    empty = fused.rope_qkv_cache(qkv[:0], tab, tab, idx[:0], idx[:0], cache, cache, 4, 1, 16, layer_out=counter,
                                 layer=5)
    assert counter.item() == 5                     # (no token: the counter still moves on)
    assert [t.shape[0] for t in empty] == [0, 0, 0]


def _run(model, device):
    """Prefill a root prompt, prefill a continuation of it, then decode 3 tokens with attention over
    everything (a plain causal chain). Returns the logits of each pass and the caches."""
    c = model.config
    caches = [(torch.zeros(64, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=device),
               torch.zeros(64, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=device))
              for _ in range(c.num_layers)]
    model.ensure_positions(64)

    def ar(a, b):
        return torch.arange(a, b, device=device)

    tok = torch.tensor([5, 17, 99, 3, 42, 7, 1, 200, 13, 77, 8, 31], device=device)
    first = model.prefill(tok[:9], ar(0, 9), ar(0, 9) + 2, ar(0, 0), caches, all_logits=True)
    second = model.prefill(tok[9:], ar(9, 12), ar(9, 12) + 2, ar(0, 9) + 2, caches)
    group = c.num_heads // c.num_kv_heads
    ctx = ar(0, 15) + 2

    def attend(layer, q):                     # token i sees the 12 prompt tokens and new tokens <= i
        k = caches[layer][0].index_select(0, ctx).repeat_interleave(group, 1).transpose(0, 1)
        v = caches[layer][1].index_select(0, ctx).repeat_interleave(group, 1).transpose(0, 1)
        mask = ar(0, 15)[None, :] <= 12 + ar(0, 3)[:, None]
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)

    dec = model.decode(torch.tensor([4, 9, 250], device=device), ar(12, 15), ar(12, 15) + 2, caches, attend)
    return [first, second, dec], caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_model_fused_matches_unfused(device, dtype):
    ref = TreeModel.random("tiny", device=device, dtype=dtype, fused=False)
    fz = TreeModel.random("tiny", device=device, dtype=dtype, fused=True)
    assert fz.fused and not ref.fused
    (l_ref, c_ref), (l_fz, c_fz) = _run(ref, device), _run(fz, device)
    for a, b in zip(l_fz, l_ref):
        if dtype == torch.float32:
            assert (a - b).abs().max().item() <= 1e-4
        else:
            assert rel_l2(a, b) <= 2e-2
    for (ka, va), (kb, vb) in zip(c_fz, c_ref):
        assert_close(ka, kb)
        assert_close(va, vb)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_qk_norm_models_fused_match_unfused(device, arch):
    """Qwen3 / Gemma 3 layers: the fused RoPE + K/V write after the per-head q/k norms (Gemma's
    norms and GeGLU stay in PyTorch), with both RoPE tables of Gemma's two kinds of layers."""
    gemma = arch == "gemma3_text"
    config = ModelConfig(arch=arch, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=1, head_dim=16, qk_norm=True, sliding_window=64,
                         layer_types=("sliding_attention", "full_attention"),
                         hidden_act="gelu_pytorch_tanh" if gemma else "silu",
                         local_rope_theta=100.0 if gemma else None, max_position_embeddings=512)
    ref = TreeModel.random(config, device=device, fused=False)
    fz = TreeModel(config, ref.weights, device=device, fused=True)
    gen = torch.Generator().manual_seed(0)
    for w in ref.weights.layers:               # norms other than the identity
        for t in (w.q_norm, w.k_norm, w.attn_norm):
            t.add_(torch.randn(t.shape, generator=gen).to(device) * 0.3)
    (l_ref, c_ref), (l_fz, c_fz) = _run(ref, device), _run(fz, device)
    for a, b in zip(l_fz, l_ref):
        assert (a - b).abs().max().item() <= 1e-4
    for (ka, va), (kb, vb) in zip(c_fz, c_ref):
        assert_close(ka, kb)
        assert_close(va, vb)


@pytest.mark.parametrize("fz", [False, True])
def test_output_buffers_of_the_pieces(device, fz):
    """``q_out`` / ``out`` (what the CUDA-graph segments use) give the same values as fresh outputs,
    also when ``out`` is the input ``h``; ``layer_out`` receives the layer (the attention graph's
    counter)."""
    model = TreeModel.random("tiny", device=device, fused=fz)
    c, n = model.config, 3
    model.ensure_positions(16)
    caches = [(torch.zeros(16, c.num_kv_heads, c.head_dim, device=device),
               torch.zeros(16, c.num_kv_heads, c.head_dim, device=device)) for _ in range(c.num_layers)]
    h = torch.randn(n, c.hidden_size, device=device)
    pos, slots = torch.tensor([3, 4, 4], device=device), torch.tensor([7, 2, 9], device=device)
    q, k, _ = model.pre_attention(0, h, pos, slots, caches)
    q_out = torch.full_like(q, float("nan"))
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    q2, k2, _ = model.pre_attention(1, h, pos, slots, caches, q_out=q_out, layer_out=counter)
    assert counter.item() == 1
    q2, k2, _ = model.pre_attention(0, h, pos, slots, caches, q_out=q_out, layer_out=counter)
    assert q2 is q_out and torch.equal(q2, q) and torch.equal(k2, k) and counter.item() == 0
    assert torch.equal(caches[0][0][slots], k)
    o = torch.randn(n, c.num_heads, c.head_dim, device=device)
    h_new = model.post_attention(0, h, o)
    assert model.post_attention(0, h, o, out=h) is h and torch.equal(h, h_new)


@pytest.mark.parametrize("fz", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_next_layer_is_post_then_pre_attention(device, fz, dtype):
    """``next_layer`` (the decode graphs' segment between two attentions: the MLP's residual add
    fused into the next layer's norm) gives the hidden state, q and K/V of ``post_attention`` of a
    layer followed by ``pre_attention`` of the next."""
    model = TreeModel.random("tiny", device=device, dtype=dtype, fused=fz)
    c, n = model.config, 3
    model.ensure_positions(16)

    def caches():
        return [(torch.zeros(16, c.num_kv_heads, c.head_dim, device=device, dtype=dtype),
                 torch.zeros(16, c.num_kv_heads, c.head_dim, device=device, dtype=dtype)) for _ in range(c.num_layers)]

    h = torch.randn(n, c.hidden_size, device=device).to(dtype)
    o = torch.randn(n, c.num_heads, c.head_dim, device=device).to(dtype)
    pos, slots = torch.tensor([3, 4, 4], device=device), torch.tensor([7, 2, 9], device=device)
    ref_caches, got_caches = caches(), caches()
    h_ref = model.post_attention(0, h, o)
    q_ref, k_ref, _ = model.pre_attention(1, h_ref, pos, slots, ref_caches)
    h_got, counter = h.clone(), torch.zeros(1, dtype=torch.int32, device=device)
    q_out = torch.full_like(q_ref, float("nan"))
    q = model.next_layer(0, h_got, o, pos, slots, got_caches, q_out=q_out, layer_out=counter)
    assert q is q_out and counter.item() == 1
    assert_close(h_got, h_ref)   # (Triton's interpreter rounds the fused add to bfloat16 by truncation)
    assert_close(q, q_ref)
    assert_close(got_caches[1][0][slots], k_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_into_a_buffer(device, dtype):
    """The decode graphs' LM head writes float32 logits into their static buffer directly."""
    model = TreeModel.random("tiny", device=device, dtype=dtype)
    h = torch.randn(3, model.config.hidden_size, device=device).to(dtype)
    out = torch.full((3, model.config.vocab_size), float("nan"), device=device)
    assert model.logits(h, out=out) is out
    assert torch.equal(out, model.logits(h)) and model.logits(h).dtype == torch.float32
