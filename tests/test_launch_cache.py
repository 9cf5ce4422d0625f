"""Launching a plan's compiled kernels directly (``ops.launch_cache``) gives what Triton's own
launch path gives, and keys every input Triton specialises on."""
import os

import numpy as np
import pytest
import torch

from helpers import rel_l2
from treeattn import TreeAttention, reference_attention
from treeattn.launchers import launch_cache
from treeattn.tree import tree_from_medusa, tree_from_spec

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")


def _inputs(tree, hq, hkv, d, dtype, device, offset=0):
    """q (a view ``offset`` elements into its storage), k and v caches of page size 1."""
    q = torch.randn(tree.num_queries * hq * d + offset, device=device, dtype=dtype)[offset:]
    k = torch.randn(int(tree.kv_indices.max()) + 1, 1, hkv, d, device=device, dtype=dtype)
    return q.view(tree.num_queries, hq, d), k, torch.randn_like(k)


def _kept_kernels(plan):
    """The kept kernels of every call of ``plan`` so far (attention launches and merges)."""
    found = []
    for key, value in launch_cache(plan).items():
        if isinstance(key, tuple) and key[0] != "tma":
            launches, merge = value
            found += [entry[0] for entry in launches] + ([merge[0]] if merge else [])
    return found


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's CPU interpreter")
def test_nothing_is_kept_under_the_interpreter():
    tree = tree_from_spec("1,4_40,6")
    w = TreeAttention(device="cpu", backend="triton")
    plan = w.plan(tree, num_qo_heads=4, num_kv_heads=2, head_dim=16, strategy="node")
    q, k, v = _inputs(tree, 4, 2, 16, torch.float32, "cpu")
    w.run(q, k, v, plan)
    assert launch_cache(plan) == {}


@cuda
@pytest.mark.parametrize("strategy", ["node", "paths", "sequence"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_direct_launches_match_tritons_path(strategy, dtype):
    tree = tree_from_medusa(32, context_len=300) if strategy == "paths" else tree_from_spec("1,8,32_300,40,9")
    w = TreeAttention(device="cuda")
    plan = w.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=128, dtype=dtype, strategy=strategy)
    q, k, v = _inputs(tree, 8, 2, 128, dtype, "cuda")
    first = w.run(q, k, v, plan, return_lse=True)  # Triton's path; keeps the compiled kernels
    kept = len(_kept_kernels(plan))
    assert kept == len(plan.launches) + (plan.merge_q_indices.numel() > 0)
    again = w.run(q, k, v, plan, return_lse=True)  # the kept kernels
    assert len(_kept_kernels(plan)) == kept
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # other tensors of the same kind reuse them; a misaligned q is another specialisation
    for offset, more in ((0, 0), (1, 1)):
        q2, k2, v2 = _inputs(tree, 8, 2, 128, dtype, "cuda", offset)
        out = w.run(q2, k2, v2, plan, return_lse=True)[0]  # (without the LSE: other kernels)
        assert len(_kept_kernels(plan)) == kept * (1 + more)
        assert rel_l2(out, reference_attention(q2, k2, v2, tree)[0]) <= 1e-2


@cuda
def test_a_patched_plan_keeps_its_own_kernels():
    tree = tree_from_spec("1,8_300,9")
    w = TreeAttention(device="cuda")
    plan = w.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=128, strategy="node")
    counts = np.zeros(tree.num_nodes, dtype=np.int64)
    counts[tree.query_nodes] = 1
    grown = tree.append(counts, tree.num_tokens + np.arange(tree.num_queries))
    q = torch.randn(tree.num_queries, 8, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(grown.num_tokens, 1, 2, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    w.run(q, k, v, plan)
    w.run(q, k, v, plan)
    patched = w.update(plan, grown)
    assert launch_cache(plan) and "_launch_cache" not in patched.__dict__
    for _ in range(2):
        out = w.run(q, k, v, patched)
        assert rel_l2(out, reference_attention(q, k, v, grown)[0]) <= 1e-2


@cuda
def test_repeated_calls_launch_packed_arguments():
    """A repeat of a call (same buffers) takes its packed launches and writes what the checked
    path wrote, reading the buffers' current contents; other buffers and bad inputs take the
    checked path."""
    tree = tree_from_spec("1,8,32_300,40,9")
    w = TreeAttention(device="cuda")
    plan = w.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.float16, strategy="node")
    q, k, v = _inputs(tree, 8, 2, 128, torch.float16, "cuda")
    out = torch.empty_like(q)
    w.run(q, k, v, plan, out=out)
    first = out.clone()
    assert len(w._views[plan][3]) == 1
    out.fill_(float("nan"))
    w.run(q, k, v, plan, out=out)
    assert torch.equal(out, first) and len(w._views[plan][3]) == 1
    q.mul_(0.5)
    w.run(q, k, v, plan, out=out)
    other = torch.empty_like(out)
    w.run(q, k, v, plan, out=other)  # (another output buffer: the checked path, then its own record)
    assert torch.equal(out, other) and not torch.equal(out, first) and len(w._views[plan][3]) == 2
    with pytest.raises(ValueError, match="queries"):
        w.run(q[:-1], k, v, plan, out=out[:-1])


class _FakeCompiled:
    """A compiled kernel's ``kernel[grid]`` runner, recording its calls (no C launcher: it is
    launched through that runner)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a: self.calls.append((grid, a))


def test_kept_kernels_run_their_runner_with_addresses_and_their_constexprs():
    from treeattn.compiled import KeptKernel

    fake = _FakeCompiled()
    kept = KeptKernel(fake, (3, 2, 1), ("BLOCK", 64))
    assert not kept.direct
    kept.launch(None, (0x1000, 5, 0.5))
    kept.launch(7, (0x2000, 6, 0.5))  # (a stream: still the runner)
    assert fake.calls == [((3, 2, 1), (0x1000, 5, 0.5, "BLOCK", 64)), ((3, 2, 1), (0x2000, 6, 0.5, "BLOCK", 64))]


def test_kept_kernels_call_the_c_launcher_in_its_argument_order():
    """Grid, stream, then the options of :data:`~treeattn.compiled.C_LAUNCH_FORMAT` (function,
    cooperative, PDL, the two scratch buffers, kernel metadata, launch metadata, the two hooks),
    then the kernel's arguments and constexprs; no stream (a launch hook set): the runner."""
    from treeattn.compiled import C_LAUNCH_FORMAT, KeptKernel

    fake = _FakeCompiled()
    kept = KeptKernel(fake, (3, 2, 1), ("BLOCK", 64))
    calls = []
    kept.c_launch = lambda *a: calls.append(a)
    kept.options = ("function", False, True, None, None, (4, 1, 0), None, None, None)
    assert len(kept.grid) + 1 + len(kept.options) == len(C_LAUNCH_FORMAT)
    kept.launch(0xBEEF, (0x1000, 5, 0.5))
    kept.launch(None, (0x2000, 6, 0.5))
    assert calls == [(3, 2, 1, 0xBEEF, "function", False, True, None, None, (4, 1, 0), None, None, None,
                      0x1000, 5, 0.5, "BLOCK", 64)]
    assert fake.calls == [((3, 2, 1), (0x2000, 6, 0.5, "BLOCK", 64))]


@cuda
@pytest.mark.parametrize("spec", ["1,8,32_300,40,9", "1,1024_2048,32", "1,8,512_32,2048,256"])
def test_c_launches_match_the_runner_and_tritons_path(spec, monkeypatch):
    """Where this Triton's C launcher has the known layout, kept kernels launch through it (TMA
    plans included, their descriptors expanded once); a launch hook sends them through the
    runner, which calls it; all three paths give the same bits."""
    from triton import knobs

    from treeattn.compiled import C_LAUNCH_FORMAT
    from treeattn.plan.lower.addressing import tma_loads

    tree = tree_from_spec(spec)
    w = TreeAttention(device="cuda")
    plan = w.plan(tree, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    q, k, v = _inputs(tree, 32, 8, 128, torch.bfloat16, "cuda")
    first = w.run(q, k, v, plan, return_lse=True)  # Triton's path
    kept = _kept_kernels(plan)
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    if getattr(driver, "_BASE_ARGS_FORMAT", None) == C_LAUNCH_FORMAT:
        assert kept and all(kernel.direct for kernel in kept)
    direct = w.run(q, k, v, plan, return_lse=True)
    calls = []
    hook = lambda metadata: calls.append(metadata)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        hooked = w.run(q, k, v, plan, return_lse=True)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(calls) == len(kept)
    for a, b, c in zip(first, direct, hooked):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert rel_l2(first[0], reference_attention(q, k, v, tree)[0]) <= 1e-2
    if any(l.tma for l in plan.launches) and torch.cuda.get_device_capability()[0] >= 9:
        assert tma_loads(plan.heads, w.cost)
        assert any(key[0] == "tma" for key in launch_cache(plan) if isinstance(key, tuple))


@cuda
def test_the_c_launch_runs_on_the_current_stream():
    """Kept launches on a side stream queue behind that stream's work: had they gone to another
    stream, the zero fill queued before them would land last."""
    tree = tree_from_spec("1,8,32_300,40,9")
    w = TreeAttention(device="cuda")
    plan = w.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=128)
    q, k, v = _inputs(tree, 8, 2, 128, torch.float16, "cuda")
    want = w.run(q, k, v, plan)
    out = torch.empty_like(want)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        out.zero_()
        w.run(q, k, v, plan, out=out)
    stream.synchronize()
    assert torch.equal(out, want)


class _CudaLooking(torch.Tensor):
    """A CPU tensor that the launchers take for a CUDA one (``is_cuda``)."""

    @property
    def is_cuda(self):
        return True


class _RecordedKernel:
    """Stands in for a kept kernel: Triton's arguments of the call that kept it, then every
    launch's arguments."""

    direct = False

    def __init__(self, args):
        self.args, self.launched = args, []

    def launch(self, stream, args):
        self.launched.append(args)


def _assembled_on_cpu(monkeypatch, kernel_type) -> tuple:
    """The launch path that only runs on CUDA, assembled on the CPU: ``(launchers module, the
    kernels it keeps (``kernel_type`` each, in keeping order), plan, (q, k, v, o_part,
    lse_part))`` for a node plan of two launches or more and a merge."""
    import treeattn.launchers as ops

    kept = []
    monkeypatch.setattr(ops, "_keep", lambda kernel, grid, args, kwargs: kept.append(kernel_type(args)) or kept[-1])
    monkeypatch.setattr(ops, "check_triton_device", lambda t: None)
    monkeypatch.setattr(ops, "launch_stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    tree = tree_from_spec("1,4,8_300,40,9")
    w = TreeAttention(device="cpu", backend="triton")
    plan = w.plan(tree, num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, strategy="node")
    assert len(plan.launches) >= 2 and plan.merge_q_indices.numel()
    q, k, v = _inputs(tree, 4, 2, 16, torch.float32, "cpu")
    return ops, kept, plan, (q.as_subclass(_CudaLooking), k, v, *w.partial_buffers(plan))


@pytest.mark.parametrize("with_lse_and_layer", [False, True])
def test_kept_launches_take_the_addresses_of_tritons_arguments(monkeypatch, with_lse_and_layer):
    """A call's kept attention launches and merge take, position by position, the device
    addresses of the tensors that Triton's path was given for them, and the same scalars."""
    ops, kept, plan, (q, k, v, o_part, lse_part) = _assembled_on_cpu(monkeypatch, _RecordedKernel)
    out = torch.empty(q.shape)
    extra = {}
    if with_lse_and_layer:
        extra = dict(lse_out=torch.empty(q.shape[:2]), layer=torch.zeros(1, dtype=torch.int32), layer_stride=0)
    for _ in range(2):  # Triton's path (keeping the kernels), then the kept launches
        ops.partial_attention(q, k, v, plan, o_part, lse_part, sm_scale=0.25, out=out, merge=True, **extra)
    assert len(kept) == len(plan.launches) + 1  # (the merge last)
    for kernel in kept:
        want = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in kernel.args)
        assert kernel.launched == [want]


class _CLaunchedKernel(_RecordedKernel):
    """A recorded kernel with a C launcher: grid, options and constexprs of its own, and every
    C launch's arguments."""

    direct = True

    def __init__(self, args):
        super().__init__(args)
        self.grid, self.options, self.tail, self.c_launched = (len(args), 1, 1), ("function", True), ("BLOCK",), []
        self.c_launch = lambda *a: self.c_launched.append(a)


def test_packed_launches_pass_what_kept_launches_pass(monkeypatch):
    """A repeat of a call launches its packed arguments (:func:`~treeattn.launchers.pack_launches`):
    each C launch gets the grid, the stream, the options, the kept launch's arguments (the
    tensors' addresses) and the constexprs, in the kept launches' order, the merge last."""
    ops, kept, plan, (q, k, v, o_part, lse_part) = _assembled_on_cpu(monkeypatch, _CLaunchedKernel)
    out = torch.empty(q.shape)
    args = (q, k, v, plan, o_part, lse_part)
    assert ops.partial_attention(*args, sm_scale=0.25, out=out, merge=True)[0] is not None  # (keeps)
    kept_call = ops.partial_attention(*args, sm_scale=0.25, out=out, merge=True)  # kept launches
    packed = ops.pack_launches(*kept_call, k, v, 0, ops.launch_cache(plan))
    assert len(packed) == len(kept) == len(plan.launches) + 1
    ops.launch_packed(packed, 0xBEEF)
    ops.launch_packed(packed, 0xCAFE)
    for kernel in kept:
        assert len(kernel.launched) == 1
        want = (*kernel.grid, *kernel.options, *kernel.launched[0], *kernel.tail)
        assert kernel.c_launched == [want[:3] + (s,) + want[3:] for s in (0xBEEF, 0xCAFE)]
    kept[-1].direct = False  # (a kernel without a C launcher: nothing is packed)
    assert ops.pack_launches(*kept_call, k, v, 0, ops.launch_cache(plan)) is None


def test_a_launch_hook_sends_kept_kernels_through_the_runner():
    from triton import knobs

    from treeattn.compiled import _hook_set, launch_stream

    assert not _hook_set(None) and _hook_set(print)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert _hook_set(knobs.runtime.launch_enter_hook)
        assert launch_stream(0) is None  # (no stream: the runner, which calls the hook)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not _hook_set(knobs.runtime.launch_enter_hook)
