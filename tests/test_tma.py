"""Tensor-descriptor (TMA) loads (``Launch.tma``): taken only by tall contig launches over long
units where the device has TMA, kept by the lazy update, and the kernel's descriptor loads give
the reference output (Triton's interpreter runs them on CPU), across layers, page sizes and
stale NaNs past a unit's end; caches whose layout rules descriptors out fall back to pointers."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import TOL, rel_l2, scratch_medusa

from treeattn import DecodingTree, HeadConfig, TreeAttention
from treeattn.launchers import _tma_descriptors
from treeattn.plan.lower.addressing import tma_launches, tma_loads, tma_pays
from treeattn.plan.select.estimate import estimate_items
from treeattn.plan.select.cost import CostModel
from treeattn.plan.strategies.node import node_items
from treeattn.plan.strategies.paths import paths_variants
from treeattn.plan.format import Launch
from treeattn.plan.select.profiles import H200
from treeattn.reference import reference_attention
from treeattn.tree import tree_from_spec

HQ, HKV, D = 8, 2, 32
TILE_TALL_CONTIG, TILE_TALL_TMA, TMA_MIN_TOKENS = H200.tile_tall_contig, H200.tile_tall_tma, H200.tma_min_tokens


def test_tma_loads_needs_the_device_16_bit_caches_and_a_small_head_dim():
    on = CostModel(tma=True)
    assert tma_loads(HeadConfig(32, 8, 128, torch.float16), on)
    assert tma_loads(HeadConfig(32, 8, 64, torch.bfloat16), on)
    assert not tma_loads(HeadConfig(32, 8, 128, torch.float32), on)  # 3 stages overflow shared memory
    assert not tma_loads(HeadConfig(32, 8, 256, torch.float16), on)
    assert not tma_loads(HeadConfig(32, 8, 96, torch.float16), on)  # (not a power of two)
    assert not tma_loads(HeadConfig(32, 8, 128, torch.float16), CostModel())
    assert TreeAttention(device="cpu").cost.tma is False  # None: CUDA devices of cc >= 9 only


def test_tma_launches_rule():
    """Tall contig launches at ``tile_tall_contig`` over units averaging the most tokens of
    ``tma_min_tokens`` take the TMA tile and the split tail (with 4 waves of programs); shorter units,
    gathered or other launches are kept."""
    long_units = TMA_MIN_TOKENS[-1][1]
    tall = dict(zip(("block_n", "num_warps", "num_stages"), TILE_TALL_CONTIG))
    launches = (Launch(128, work_start=0, work_end=2, contig=True, masked=False, **tall),
                Launch(128, work_start=2, work_end=4, contig=True, masked=False, **tall),
                Launch(128, work_start=4, work_end=6, contig=False, masked=False, **tall),
                Launch(64, 64, 6, 8, 4, 3, contig=True))
    length = np.array([long_units, long_units + 1, long_units, long_units - 2] + [5000] * 4)
    start = np.arange(8) * 10000
    out = tma_launches(launches, start, start + length, 8, profile=dataclasses.replace(H200, num_sms=4))
    assert out[0] == dataclasses.replace(launches[0], block_n=TILE_TALL_TMA[0], num_warps=TILE_TALL_TMA[1],
                                         num_stages=TILE_TALL_TMA[2], split_tail=True, tma=True)
    assert out[1:] == launches[1:]  # mean 0.5 tokens short; gathered; not the tall tile


def test_tma_launches_take_shorter_units_with_fewer_waves():
    """Each (waves, tokens) of ``tma_min_tokens``: a tall contig launch of at most ``waves`` x SMs
    programs takes the TMA tile from ``tokens`` on, and not a token shorter nor on one SM less."""
    tall = dict(zip(("block_n", "num_warps", "num_stages"), TILE_TALL_CONTIG))
    launch = (Launch(128, work_start=0, work_end=3, contig=True, masked=False, **tall),)  # 24 programs
    start = np.arange(3) * 10000
    for waves, tokens in TMA_MIN_TOKENS:
        num_sms = int(np.ceil(24 / waves))
        for length, sms, tma in ((tokens, num_sms, True), (tokens - 1, num_sms, False), (tokens, num_sms - 1, False)):
            profile = dataclasses.replace(H200, num_sms=sms)
            got = tma_launches(launch, start, start + length, 8, profile=profile)[0].tma
            assert got is tma and bool(tma_pays(24, float(length), profile=profile)) is tma, (waves, tokens, length, sms)


def tall_tree(page_size: int, gap: int = 0) -> DecodingTree:
    """A 2100-token root read by 32 leaves of 5 tokens (32 queries x GQA 4: one 128-row tile), the
    leaves ``gap`` slots after the root."""
    root = 2100
    lengths = [root] + [5] * 32
    kv = np.concatenate([np.arange(root), root + gap + np.arange(5 * 32)])
    return DecodingTree.from_parents([-1] + [0] * 32, lengths, query_nodes=list(range(1, 33)), kv_indices=kv,
                                     page_size=page_size)


def inputs(tree: DecodingTree, dtype, *, num_slots: int | None = None, layers: int = 1):
    slots = num_slots or tree.num_tokens
    pages = -(-slots // tree.page_size)
    q = torch.randn(tree.num_queries, HQ, D, dtype=torch.float64)
    k = torch.randn(layers, pages, tree.page_size, HKV, D, dtype=torch.float64)
    v = torch.randn_like(k)
    return q, k, v


def tma_attention(device) -> TreeAttention:
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    return TreeAttention(device=device, backend="triton", cost=CostModel(tma=True))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tma_kernel_matches_reference(device, dtype, page_size):
    """The root's launch loads through descriptors; slots between the root and the leaves hold
    NaN, which the unit's partial last tile (pointer loads, masked) must not read."""
    tree = tall_tree(page_size, gap=40)
    attn = tma_attention(device)
    plan = attn.plan(tree, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=dtype, strategy="node")
    assert [ln.tma for ln in plan.launches].count(True) == 1
    q, k, v = inputs(tree, dtype, num_slots=2100 + 40 + 160)
    for t in (k, v):
        t.view(-1, HKV, D)[2100:2140] = float("nan")
    ref = reference_attention(q, k[0], v[0], tree)[0]
    args = [t.to(device, dtype) for t in (q, k[0], v[0])]
    assert _tma_descriptors(args[1], args[2], 0, TILE_TALL_TMA[0]) is not None  # (no pointer fallback)
    out = attn.run(*args, plan)
    assert rel_l2(out, ref) <= TOL[dtype]
    pointers = dataclasses.replace(plan, launches=tuple(dataclasses.replace(ln, tma=False) for ln in plan.launches))
    assert rel_l2(attn.run(*args, pointers), ref) <= TOL[dtype]


@pytest.mark.slow
def test_tma_reads_the_layer_given_on_the_device(device):
    """Stacked caches of 3 layers, the layer index a device tensor: the descriptors' rows run
    through every layer's slots."""
    tree = tall_tree(16)
    attn = tma_attention(device)
    plan = attn.plan(tree, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.float16, strategy="node")
    assert any(ln.tma for ln in plan.launches)
    q, k, v = inputs(tree, torch.float16, layers=3)
    k16, v16 = k.to(device, torch.float16), v.to(device, torch.float16)
    assert _tma_descriptors(k16[0], v16[0], k16[0].numel(), TILE_TALL_TMA[0]) is not None
    for layer in (2, 1):
        out = attn.run(q.to(device, torch.float16), k16[0], v16[0], plan,
                       layer=torch.tensor([layer], dtype=torch.int32, device=device), layer_stride=k16[0].numel())
        assert rel_l2(out, reference_attention(q, k[layer], v[layer], tree)[0]) <= TOL[torch.float16]


@pytest.mark.slow
def test_tma_falls_back_to_pointers_where_the_layout_rules_descriptors_out(device):
    """Heads not adjacent (a slice of wider rows), K and V strided differently, or layers not a
    whole number of slots apart: no descriptors, the same output."""
    tree = tall_tree(1)
    attn = tma_attention(device)
    plan = attn.plan(tree, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.float16, strategy="node")
    assert any(ln.tma for ln in plan.launches)
    q, k, v = inputs(tree, torch.float16)
    q16, k16, v16 = (t.to(device, torch.float16) for t in (q, k[0], v[0]))
    wide = torch.randn(*k.shape[1:-1], 2 * D, dtype=torch.float64)
    wide[..., :D] = k[0]
    k_sliced = wide.to(device, torch.float16)[..., :D]
    assert _tma_descriptors(k_sliced, k_sliced, 0, 128) is None
    assert _tma_descriptors(k16, v16, 0, 128) is not None
    assert _tma_descriptors(k16, v16, HKV * D + D, 128) is None
    v_gaps = torch.empty(v.shape[1], 2, HKV, D, dtype=torch.float16, device=device)[:, :1]  # a free slot after each
    v_gaps.copy_(v16)
    assert _tma_descriptors(k16, v_gaps, 0, 128) is None
    ref = reference_attention(q, k[0], v[0], tree)[0]
    assert rel_l2(attn.run(q16, k_sliced, v16, plan), ref) <= TOL[torch.float16]
    assert rel_l2(attn.run(q16, k16, v_gaps, plan), ref) <= TOL[torch.float16]


def test_update_keeps_the_tma_tile(device):
    """A 2100-token node read by 32 queries grows by a token right after its last slot: the
    patched plan's launch keeps reading a run, through descriptors, and matches the reference."""
    grown_len = 2101
    tree = DecodingTree.from_parents([-1], [2100], query_nodes=[0] * 32, page_size=16, num_slots=2112)
    grown = DecodingTree.from_parents([-1], [grown_len], query_nodes=[0] * 32, page_size=16, num_slots=2112)
    attn = tma_attention(device)
    plan = attn.plan(tree, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.float16, strategy="node")
    assert any(ln.tma for ln in plan.launches)
    updated = attn.update(plan, grown)
    assert updated.num_work == plan.num_work and [ln.tma for ln in updated.launches] == [ln.tma for ln in plan.launches]
    assert all(ln.split_tail for ln in updated.launches if ln.tma)
    q, k, v = inputs(grown, torch.float16, num_slots=2112)
    ref = reference_attention(q, k[0], v[0], grown)[0]
    assert rel_l2(attn.run(*[t.to(device, torch.float16) for t in (q, k[0], v[0])], updated), ref) <= TOL[torch.float16]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16])
def test_lead_chunks_on_runs_take_tma_as_rated(device, dtype):
    """A Medusa tree of 64 drafts over a 2500-token context in consecutive slots, its drafts in
    scratch slots: ``paths``' lead chunks are known runs, so with TMA the cost model rates their
    launch of fewer programs than SMs at ``tma_speedup`` and ``auto`` takes chunks loaded through
    descriptors, which match the reference; without TMA the same items are rated at pointer rates."""
    tree = scratch_medusa(64, 2500, 3072)
    heads = HeadConfig(HQ, HKV, D, dtype)
    tma, pointers = CostModel(side_streams=True, tma=True), CostModel(side_streams=True)
    rated = [(estimate_items(tree, items, heads, tma)["attention"], estimate_items(tree, items, heads, pointers)["attention"])
             for items, _ in paths_variants(tree, heads, tma) if items.unmasked_runs]
    assert rated and any(a < b for a, b in rated) and all(a <= b for a, b in rated)
    attn = TreeAttention(device=device, backend="triton", cost=tma)
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    plan = attn.plan(tree, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=dtype)
    assert plan.strategy == "paths" and any(ln.tma for ln in plan.launches), plan.reason
    q, k, v = inputs(tree, dtype, num_slots=3072 + 512)
    ref = reference_attention(q, k[0], v[0], tree)[0]
    assert rel_l2(attn.run(*(t.to(device, dtype) for t in (q, k[0], v[0])), plan), ref) <= TOL[dtype]


def test_node_items_are_runs_where_every_node_is_one():
    """``node``'s items are marked as reading runs where every node's slots are one run, so with
    TMA ``auto`` rates the root's tall launch through TMA (it then takes ``node`` on this suite
    tree, 1.06x faster than ``greedy`` on an H100); a
    node whose slots are out of order leaves them unmarked."""
    heads = HeadConfig(64, 8, 128, torch.float16)
    tree = tree_from_spec("1,8,512_32,2048,256")
    assert node_items(tree).unmasked_runs
    plan = TreeAttention(device="cpu", cost=CostModel(tma=True)).plan(
        tree_from_spec("1,8,512_32,2048,256"), num_qo_heads=64, num_kv_heads=8, head_dim=128, dtype=torch.float16)
    assert plan.strategy == "node" and any(ln.tma for ln in plan.launches), plan.reason
    kv = tree.kv_indices.copy()
    kv[[1, 2]] = kv[[2, 1]]  # the root's second and third slots swapped
    shuffled = DecodingTree.from_parents(tree.parents, tree.lengths, kv_indices=kv, query_nodes=tree.query_nodes,
                                         query_prefix=tree.query_prefix)
    assert not node_items(shuffled).unmasked_runs
    assert estimate_items(shuffled, node_items(shuffled), heads, CostModel(tma=True))["total"] > \
        estimate_items(tree, node_items(tree), heads, CostModel(tma=True))["total"]

