"""precompile: every kernel variant a plan can launch, compiled up front (in this process under
Triton's interpreter; worker processes on CUDA devices)."""
import dataclasses
import os

import pytest
import torch

from treeattn import precompile as pc
from treeattn.plan.lower.addressing import contig_configs, gathered_configs
from treeattn.plan.format import HeadConfig, launch_shapes
from treeattn.plan.select.profiles import H200
from treeattn.precompile import precompile


@pytest.fixture
def recorded(monkeypatch):
    """The variants launched, as keys, in place of the kernels."""
    calls = []
    monkeypatch.setattr(pc, "partial_attention", lambda q, k, v, plan, *a, merge_last=False, **kw: calls.append(
        ("attention", plan.launches, plan.num_direct, plan.has_mask, merge_last)))
    monkeypatch.setattr(pc, "merge_partials", lambda o, lse, qi, indptr, idx, out, lse_out, *, max_rows, pdl: calls.append(
        ("merge", o.shape[0], max_rows, lse_out is None)))
    return calls


def test_precompile_covers_every_variant(recorded):
    """Serving warms Triton up front: every launch shape a plan can use, with and without the
    tree mask, and every merge head-block, each launched once (recorded, not run)."""
    heads = HeadConfig(8, 2, 16, torch.float32)
    shapes = launch_shapes(heads, profile=H200)
    assert {s[0] for s in shapes} == {16, 32, 64, 128} and len(shapes) == 8
    # each shape gathers its slots or computes them (contig), a 3-stage contig one also with 2
    # stages, a tall one of long KV tiles also with the tall tile, a gathered 32-row one of long KV
    # tiles also with 2 warps; x2 for the direct-output variant (x3 for tiles of <= 32 rows, which
    # may also merge as a plan's last launch), x2 for the grid order, x2 for the mask split (masked
    # plan only), and tall ones unmasked also with the split tail; merge head blocks 1, 2, 4 (few
    # queries) with each of their 5 row tiles and 8 (the row loop), with and without LSE
    def count(rows):
        return sum(len(gathered_configs(*s, elem_bytes=4, profile=H200)) + len(contig_configs(*s, profile=H200))
                   for s in shapes if s[0] in rows)

    configs, tall, short = count((16, 32, 64, 128)), count((64, 128)), count((16, 32))
    assert configs == 2 * 4 + (1 + 2) * 4 + 1 + 1
    assert precompile(heads, page_size=16, device="cpu") == len(recorded) == len(set(map(repr, recorded))) == \
        (2 * 2 + 2 * 2 * 2) * configs + (2 + 2 * 2) * short + 2 * 2 * tall + 2 * (3 * 5 + 1)


def test_precompile_covers_the_sampling_kernel(recorded, monkeypatch):
    """With a vocabulary, the fused sampling kernel's 16 variants too (noise, per-row counter,
    per-row scale, the normaliser), each launched once; a batch of any size then uses one of
    them (the combine kernel's block is the vocabulary's, not the batch's). And beam search's
    candidate kernel for each candidate count."""
    monkeypatch.setattr(pc, "gumbel_argmax", lambda x, *, streams, counter, scale, stats: recorded.append(
        ("sample", streams is None, isinstance(counter, int), isinstance(scale, float), stats, x.shape[1])))
    monkeypatch.setattr(pc, "row_topk_candidates", lambda x, k: recorded.append(("topk", k, x.shape[1])))
    heads = HeadConfig(8, 2, 16, torch.float32)
    attention = precompile(heads, page_size=16, device="cpu")
    recorded.clear()
    assert precompile(heads, page_size=16, device="cpu", vocab=300) == attention + 16 + len(pc.TOPK_CANDIDATES)
    assert len({r for r in recorded if r[0] == "sample"}) == 16 and all(r[-1] == 300 for r in recorded[:16])
    assert {r for r in recorded if r[0] == "topk"} == {("topk", k, 300) for k in pc.TOPK_CANDIDATES}


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_precompile_variants_run(device, page_size):
    """The variants run on their dummy data, pages of one token included: on a GPU every one of
    them, compiled in worker processes first; under the interpreter every 8th, pages of one token
    and of 16 taking alternate halves of them (each variant's real launch takes ~0.5 s)."""
    heads = HeadConfig(8, 2, 16, torch.float32)
    total = sum(1 for _ in pc._variants(heads, page_size, device, False, False, profile=H200))
    if device.type == "cuda":
        assert precompile(heads, page_size=page_size, device=device, workers=min(8, os.cpu_count() or 1)) == total
        torch.cuda.synchronize()
    else:
        first = 0 if page_size == 1 else 8
        assert pc._launch_variants(heads, page_size, device, False, False, profile=H200,
                                   indices=range(first, total, 16)) == len(range(first, total, 16)) > 0


def test_indices_launch_those_variants(recorded, monkeypatch):
    """A worker launches the variants whose numbers it takes, no others, each as it would be
    launched in order (the variants are listed before the first launch)."""
    monkeypatch.setattr(pc, "gumbel_argmax", lambda x, *, streams, counter, scale, stats: recorded.append(
        ("sample", streams is None, isinstance(counter, int), isinstance(scale, float), stats, x.shape[1])))
    monkeypatch.setattr(pc, "row_topk_candidates", lambda x, k: recorded.append(("topk", k, x.shape[1])))
    heads = HeadConfig(32, 8, 128, torch.bfloat16)
    everything = pc.precompile(heads, page_size=16, device="cpu", pdl=True, tma=True, profile=H200, vocab=300)
    full = list(recorded)
    assert everything == len(full) == len(set(full))
    recorded.clear()
    picked = [5, 0, 3, 20, everything - 1, 40]
    assert pc._launch_variants(heads, 16, torch.device("cpu"), True, True, profile=H200, vocab=300,
                               indices=iter(picked)) == len(picked)
    assert recorded == [full[i] for i in picked]


@pytest.mark.parametrize("workers", [1, 3, 7])
def test_the_work_queue_gives_each_variant_to_one_worker(recorded, monkeypatch, workers):
    """The workers, started with the queue's read end, take every variant exactly once between
    them, whichever of them reads next (here: the stand-in processes take one record each in
    turn, some stopping early), and are told the launch mode."""
    heads = HeadConfig(32, 8, 128, torch.bfloat16)
    count = 20
    procs = []

    class Proc:
        returncode = 0

        def __init__(self, args, *, pass_fds, **kw):
            fd, = pass_fds
            assert f"--queue-fd={fd}" in args and "--no-merge-last" in args and "--pdl" in args
            self.fd = os.dup(fd)  # (the parent closes its copy once they started)
            self.queue = pc._taken(self.fd)
            self.taken = []
            procs.append(self)

        def communicate(self):
            return "", ""

    monkeypatch.setattr(pc.subprocess, "Popen", Proc)
    pc._compile_in_workers.__wrapped__(heads, 16, torch.device("cuda", 0), True, True, workers, False, None, H200,
                                       count)
    live = list(procs)
    while live:
        for p in list(live):
            if (len(p.taken) == 3 and p is not procs[0]) or (i := next(p.queue, None)) is None:
                live.remove(p)
            else:
                p.taken.append(i)
    assert len(procs) == workers
    assert sorted(i for p in procs for i in p.taken) == list(range(count))
    for p in procs:
        os.close(p.fd)


def test_worker_reads_its_arguments(monkeypatch):
    """A worker process gets the planner's profile (as JSON), the vocabulary and the work queue,
    and launches the variants it takes from the queue."""
    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(pc, "_launch_variants", lambda *a, indices, **kw: seen.append((a, kw, list(indices))))
    profile = dataclasses.replace(H200, num_sms=100, tile_tall_tma=(64, 4, 2))
    queue, feed = os.pipe()
    for i in (4, 1, 300):
        os.write(feed, i.to_bytes(4, "little"))
    os.close(feed)
    pc.main(["--heads=8,2,16", "--dtype=bfloat16", "--page-size=16", "--device=cpu", "--pdl", "--vocab=300",
             f"--profile={profile.to_json()}", f"--queue-fd={queue}"])
    os.close(queue)
    (args, kw, taken), = seen
    assert args == (HeadConfig(8, 2, 16, torch.bfloat16), 16, torch.device("cpu"), True, False)
    assert kw == dict(profile=profile, merge_last=True, vocab=300) and taken == [4, 1, 300]


def test_workers_compile_only_on_cuda(recorded, monkeypatch):
    """On the CPU (Triton's interpreter) ``workers`` starts no process."""
    monkeypatch.setattr(pc, "_compile_in_workers", lambda *a: pytest.fail("started workers on the CPU"))
    heads = HeadConfig(8, 2, 16, torch.float32)
    assert precompile(heads, page_size=16, device="cpu", workers=4) == len(recorded) > 0


@pytest.mark.slow
def test_failed_worker_raises_naming_it():
    """A worker that cannot compile (here: no CUDA device) fails the call with its error, not a hang."""
    if torch.cuda.is_available():
        pytest.skip("the workers would compile")
    with pytest.raises(RuntimeError, match=r"precompile worker \d of 2 failed"):
        pc._compile_in_workers(HeadConfig(8, 2, 16, torch.float16), 16, torch.device("cuda", 0), False, False, 2,
                               True, None, H200, 100)


def test_workers_get_the_current_cuda_device(monkeypatch):
    """``device="cuda"`` reaches the workers as the current device's index (each worker compiles
    for the device it is told)."""
    seen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(pc, "_compile_in_workers", lambda heads, page, device, *a: seen.append(device))
    monkeypatch.setattr(pc, "_variants", lambda *a, **kw: iter(()))
    precompile(HeadConfig(8, 2, 16, torch.float16), page_size=16, device="cuda", workers=2, profile=H200)
    precompile(HeadConfig(8, 2, 16, torch.float16), page_size=16, device="cuda:1", workers=2, profile=H200)
    assert seen == [torch.device("cuda", 3), torch.device("cuda", 1)]


def test_tree_attention_precompiles_its_own_launch_mode(monkeypatch):
    """``TreeAttention.precompile`` compiles the variants its plans take: its PDL and TMA choice
    and its cost model's profile, and nothing with the torch backend."""
    import treeattn.api
    from treeattn import TreeAttention

    seen = []
    monkeypatch.setattr(treeattn.api, "precompile", lambda heads, **kw: seen.append((heads, kw)) or 7)
    kw = dict(num_qo_heads=8, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, page_size=16)
    assert TreeAttention(backend="torch").precompile(**kw) == 0
    assert TreeAttention(backend="triton").precompile(**kw, workers=3) == 7
    # merging last launches from the cost model's GQA group on (8 by default): not at 8/2
    assert TreeAttention(backend="triton").precompile(**{**kw, "num_qo_heads": 16}) == 7
    common = dict(page_size=16, device=torch.device("cpu"), pdl=False, tma=False, vocab=None, profile=H200)
    assert seen == [(HeadConfig(8, 2, 16, torch.bfloat16), dict(common, merge_last=False, workers=3)),
                    (HeadConfig(16, 2, 16, torch.bfloat16), dict(common, merge_last=True, workers=0))]


def test_without_merging_last_launches_no_merging_variant(recorded, monkeypatch):
    """``merge_last=False`` (plans whose GQA group never folds) leaves out exactly the variants
    whose launch merges, and the workers are told so."""
    heads = HeadConfig(32, 8, 128, torch.bfloat16)
    everything = pc.precompile(heads, page_size=16, device="cpu", pdl=True, tma=True, profile=H200)
    merging = sum(1 for c in recorded if c[0] == "attention" and c[4])
    recorded.clear()
    assert pc.precompile(heads, page_size=16, device="cpu", pdl=True, tma=True, profile=H200, merge_last=False) \
        == everything - merging and merging > 0
    assert not any(c[0] == "attention" and c[4] for c in recorded)
    argv = []

    class Proc:
        returncode = 0

        def __init__(self, args, **kw):
            argv.append(args)

        def communicate(self):
            return "", ""

    monkeypatch.setattr(pc.subprocess, "Popen", Proc)
    pc._compile_in_workers.__wrapped__(heads, 16, torch.device("cuda", 0), True, True, 2, False, None,
                                       H200, 3)  # (uncached)
    assert len(argv) == 2 and all("--no-merge-last" in a and f"--profile={H200.to_json()}" in a for a in argv)


def test_persistent_configs_include_the_tma_tall_tile():
    """With PDL and TMA at a GQA group of 4+, precompile compiles the TMA tall tile persistent too
    (:func:`~treeattn.plan.lower.addressing.persistent_tall` runs it over part of the SMs), the gathered
    tall launches at their persistent tile, and no contig launch that computes its addresses
    without TMA; without PDL, none."""
    heads = HeadConfig(32, 8, 128, torch.float16)
    configs = pc.launch_configs(heads, profile=H200, tma=True, pdl=True)
    persistent = {c for c in configs if pc.persists(heads, c, profile=H200, pdl=True)}
    assert (128, *H200.tile_tall_tma, True, True) in persistent
    assert (128, *H200.tile_tall_gathered, False, False) in persistent
    assert not any(contig and not tma for *_, contig, tma in persistent)
    assert not any(pc.persists(heads, c, profile=H200, pdl=False) for c in configs)
