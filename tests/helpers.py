"""Shared test helpers: random trees, error metrics, the plan-coverage invariant and the engine's
leaves against transformers; batched prefill against separate prefills."""
from __future__ import annotations

import contextlib
import datetime
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import strategies as st

from treeattn import DecodingTree, KVPool
from treeattn.plan import Plan
from treeattn.reference import visibility_mask
from treeattn.tree.topology import ranges
from treeattn.tree import tree_from_medusa

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float64: 1e-10}


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "output has NaN/inf"
    return ((out - ref).norm() / ref.norm()).item()


def random_parents(rng: np.random.Generator, n: int, roots: int = 1) -> np.ndarray:
    """A random forest on n nodes with ids in random order (parents need not precede children)."""
    roots = max(1, min(roots, n))
    parents = np.full(n, -1, dtype=np.int64)
    for i in range(roots, n):
        parents[i] = rng.integers(0, i)
    perm = rng.permutation(n)  # node i of the result is node perm[i] of the construction
    inv = np.argsort(perm)
    return np.where(parents[perm] < 0, -1, inv[np.maximum(parents[perm], 0)])


def random_tree(rng: np.random.Generator, n: int, max_len: int, *, roots: int = 1,
                inner_queries: bool = False) -> DecodingTree:
    """Random forest whose roots hold >= 1 token, with one query per leaf (prefix = all or, for a
    speculative-style tree, random prefixes and queries at inner nodes too)."""
    parents = random_parents(rng, n, roots)
    lengths = rng.integers(0, max_len + 1, n)
    lengths[parents < 0] = np.maximum(lengths[parents < 0], 1)
    if not inner_queries:
        return DecodingTree.from_parents(parents, lengths)
    nodes = rng.integers(0, n, size=int(rng.integers(1, 2 * n + 1)))
    prefix = np.array([rng.integers(0, lengths[v] + 1) for v in nodes])
    tree = DecodingTree.from_parents(parents, lengths)
    path = tree.topology.path_tokens[nodes] + prefix
    prefix = np.where(path == 0, lengths[nodes], prefix)  # every query must see something
    keep = tree.topology.path_tokens[nodes] + prefix > 0
    return tree.with_queries(nodes[keep], prefix[keep])


@st.composite
def forests(draw, max_nodes: int = 300, max_len: int = 300, inner_queries: bool | None = None):
    seed = draw(st.integers(0, 2**32 - 1))
    n = draw(st.integers(1, max_nodes))
    roots = draw(st.integers(1, max(1, min(n, 4))))
    max_l = draw(st.integers(0, max_len))
    inner = draw(st.booleans()) if inner_queries is None else inner_queries
    return random_tree(np.random.default_rng(seed), n, max_l, roots=roots, inner_queries=inner)


def planned_coverage(tree: DecodingTree, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """(query, token position in tree.kv_indices) for every KV token the plan lets each query see,
    after the tree mask; sorted. Slots are unique per token in these tests."""
    kv = plan.kv_indices.cpu().numpy().astype(np.int64)
    start = plan.work_kv_start.cpu().numpy().astype(np.int64)
    end = plan.work_kv_end.cpu().numpy().astype(np.int64)
    indptr = plan.work_row_indptr.cpu().numpy().astype(np.int64)
    row_q = plan.row_q_indices.cpu().numpy().astype(np.int64)
    row_work = np.repeat(np.arange(start.size), np.diff(indptr))
    pos = ranges(start[row_work], end[row_work])
    q = np.repeat(row_q, (end - start)[row_work])
    if plan.has_mask:
        # as the kernel does: only the launches flagged masked apply the tree mask, each unit from
        # its mask start (the kernel may start earlier, at a tile boundary: those entries are
        # visible anyway, which this checks)
        work_masked = np.zeros(start.size, dtype=bool)
        for ln in plan.launches:
            work_masked[ln.work_start:ln.work_end] = ln.masked
        mask_start = plan.work_mask_start.cpu().numpy().astype(np.int64)
        masked = np.repeat(work_masked[row_work], (end - start)[row_work])
        masked &= pos >= np.repeat(mask_start[row_work], (end - start)[row_work])
        lo, hi, p = plan.tree_mask.cpu().numpy()[pos, :3].T
        p = p + pos
        qp = plan.query_pos.cpu().numpy()[q]
        qpre = plan.query_prefix.cpu().numpy()[q]
        vis = ~masked | ((lo <= qp) & (qp < hi) & ((lo < qp) | (p < qpre)))
        q, pos = q[vis], pos[vis]
    slot_to_token = np.empty(int(tree.kv_indices.max()) + 1, dtype=np.int64)
    slot_to_token[tree.kv_indices] = np.arange(tree.kv_indices.size)
    tok = slot_to_token[kv[pos]]
    order = np.lexsort((tok, q))
    return q[order], tok[order]


def expected_coverage(tree: DecodingTree) -> tuple[np.ndarray, np.ndarray]:
    q, tok = np.nonzero(visibility_mask(tree))
    return q.astype(np.int64), tok.astype(np.int64)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, world: int, args: tuple, out_dir, *, timeout: float) -> list:
    """Run ``worker(rank, *args)`` on ``world`` processes, killing them after ``timeout`` seconds;
    returns what each rank saved to ``out_dir/rank{r}.pt``."""
    ctx = mp.spawn(worker, args=args, nprocs=world, join=False)
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    while not ctx.join(timeout=1.0):
        if datetime.datetime.now() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"job with {world} ranks ({worker.__name__}) timed out")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


def paged_copy(tree, k, v, page_size, rng):
    """Scatter contiguous K/V into a shuffled paged pool; returns (tree over the pool, k, v caches)."""
    pool = KVPool(num_pages=tree.num_tokens // page_size + tree.num_nodes + 4, page_size=page_size,
                  num_kv_heads=k.shape[1], head_dim=k.shape[2], dtype=k.dtype)
    n_slots = pool.num_slots
    slots = rng.permutation(n_slots)[: tree.num_tokens]
    kc, vc = pool.k_cache(0), pool.v_cache(0)
    kc.view(-1, *k.shape[1:])[torch.as_tensor(slots)] = k
    vc.view(-1, *v.shape[1:])[torch.as_tensor(slots)] = v
    paged = type(tree).from_parents(tree.parents, tree.lengths, query_nodes=tree.query_nodes,
                                    query_prefix=tree.query_prefix, kv_indices=slots,
                                    page_size=page_size, num_slots=n_slots)
    return paged, kc, vc


def paged_case(tree, hq: int, hkv: int, head_dim: int, rng, page_size: int = 4):
    """Random fp32 queries and K/V for ``tree`` scattered into a shuffled paged pool
    (:func:`paged_copy`): ``(q, paged tree, k cache, v cache, float64 reference output)``."""
    from treeattn import reference_attention

    q = torch.randn(tree.num_queries, hq, head_dim)
    k = torch.randn(tree.num_tokens, hkv, head_dim)
    v = torch.randn(tree.num_tokens, hkv, head_dim)
    paged, kc, vc = paged_copy(tree, k, v, page_size, rng)
    o_ref, _ = reference_attention(q.double(), kc.double(), vc.double(), paged)
    return q, paged, kc, vc, o_ref


def scratch_medusa(size: int, ctx: int, scratch: int) -> DecodingTree:
    """A Medusa tree over a ``ctx``-token context in slots ``0..ctx-1`` with its drafts from slot
    ``scratch`` on (the engine's layout: the drafts' scratch pages away from the context)."""
    base = tree_from_medusa(size, context_len=ctx)
    kv = base.kv_indices.copy()
    kv[ctx:] += scratch - ctx
    return DecodingTree.from_parents(base.parents, base.lengths, kv_indices=kv, query_nodes=base.query_nodes,
                                     query_prefix=base.query_prefix)


def save_tiny_llama(path, *, vocab: int = 256, seed: int = 0, tokenizer: bool = False, **config):
    """A tiny random transformers Llama (2 layers, hidden 64, 4 query / 1 KV heads, no EOS) saved in
    ``path``, with a word-level ``tokenizer.json`` of tokens ``t0 .. t{vocab-1}`` when asked;
    ``config``: other ``LlamaConfig`` values. Returns the transformers model."""
    import transformers

    cfg = transformers.LlamaConfig(**{**dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.2, eos_token_id=None,
        bos_token_id=None, pad_token_id=None, tie_word_embeddings=False), **config})
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        import tokenizers

        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
        tok.save(str(path / "tokenizer.json"))
    return hf


def hf_last_logits(hf, tokens) -> torch.Tensor:
    """A transformers model's logits after the last of ``tokens``."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1]


def check_leaves(hf, leaves, tol: float = 1e-4) -> None:
    """Every leaf's logits (an engine run's result) equal ``hf``'s after its tokens within ``tol``."""
    assert leaves
    for leaf in leaves:
        err = (hf_last_logits(hf, leaf["tokens"]) - leaf["logits"].cpu()).abs().max().item()
        assert err <= tol, f"leaf {leaf['node']} ({len(leaf['tokens'])} tokens): max abs diff {err}"


def batched_vs_separate(model, *, page_size: int = 4, hf=None, tol: float = 1e-5) -> None:
    """Three prefills in one :meth:`TreeEngine.batched_prefill` pass equal the same prefills run one
    at a time (last-token logits within ``tol``, every new token's K/V) and, with ``hf``, its
    logits: a root prompt of two chunks, one below a cached prompt, one below the first one's
    chain (its context is written in the same pass); every path is longer than 8 tokens (a
    sliding window of 8 reaches into the contexts)."""
    from treeattn.engine import TreeEngine

    cached, root, below, after = list(range(40, 53)), [list(range(3, 11)), [99, 98, 97]], [7, 8, 9, 10], [5, 6, 1, 2, 4]
    runs = []
    for batched in (True, False):
        eng = TreeEngine(model, page_size=page_size, kv_tokens=512)
        top = eng.prefill_chain(None, [cached])[-1]
        calls, prefill = [], model.prefill
        model.prefill = lambda *a, **kw: (calls.append(a[0].shape[0]), prefill(*a, **kw))[1]
        try:
            with eng.batched_prefill() if batched else contextlib.nullcontext():
                a = eng.prefill_chain(None, root)
                b = eng.prefill_chain(top, [below])
                c = eng.prefill_chain(a[-1], [after])
                assert not batched or not calls                  # queued, not run
        finally:
            del model.prefill
        assert calls == ([20] if batched else [11, 4, 5])
        nodes = [a[-1], b[-1], c[-1]]
        slots = np.concatenate([eng.tree.path_slots(n) for n in nodes])
        kv = torch.stack([torch.stack((k[slots], v[slots])) for k, v in eng.kv.caches])
        runs.append((eng.logits_for(nodes), kv, [eng.tree.path_slots(n).tolist() for n in nodes]))
    (lb, kb, sb), (ls, ks, ss) = runs
    assert sb == ss                                              # same slots, same pool
    assert (lb - ls).abs().max().item() <= tol and (kb - ks).abs().max().item() <= tol
    if hf is not None:
        paths = [sum(root, []), cached + below, sum(root, []) + after]
        for got, toks in zip(lb, paths):
            assert (got - hf_last_logits(hf, toks)).abs().max().item() <= 1e-4
