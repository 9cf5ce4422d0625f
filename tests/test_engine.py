"""Tree-decoding engine vs Hugging Face transformers on tiny random Llama / Qwen2 / Mistral models
(fp32, CPU, torch attention backend; one small case in the Triton interpreter)."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from treeattn import STRATEGIES  # noqa: E402
from treeattn.engine import (BeamSearchController, Callbacks, Sampler, SamplingController,  # noqa: E402
                             TreeEngine, TreeModel, periodic_branching)
from treeattn.engine.workloads import SpeculativeReplayController, ToTReplayController  # noqa: E402
from helpers import batched_vs_separate, check_leaves, hf_last_logits  # noqa: E402

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


def _save(hf_model, path):
    hf_model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, model dir): 2 layers, hidden 64, 4 heads / 1 KV head, Llama-3 RoPE scaling, no EOS."""
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, rope_theta=10000.0, initializer_range=0.2,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    return hf, _save(hf, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def model(tiny):
    return TreeModel.from_pretrained(tiny[1])


def test_prefill_logits_match_transformers(tiny, model):
    hf, _ = tiny
    prompt = list(range(3, 40))
    eng = TreeEngine(model, page_size=8, kv_tokens=1024)
    root = eng.tree.add_root()
    eng.prefill(root, prompt[:20])
    ours = eng.prefill(root, prompt[20:])          # a second prompt chunk over cached context
    assert (ours - hf_last_logits(hf, prompt)).abs().max().item() <= TOL


def test_beam_search_matches_transformers_generate(tiny, model):
    hf, _ = tiny
    prompt = [5, 17, 99, 3, 42, 7, 1, 200]
    eng = TreeEngine(model, page_size=4, kv_tokens=2048)
    ours = eng.run(BeamSearchController(prompt, num_beams=4, max_new_tokens=16))
    ref = hf.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4, do_sample=False,
                      max_new_tokens=16, length_penalty=1.0, early_stopping=False, output_scores=True,
                      return_dict_in_generate=True)
    assert ours["sequences"] == ref.sequences.tolist()
    np.testing.assert_allclose(ours["scores"], ref.sequences_scores.tolist(), atol=1e-4)
    eng.reset()
    assert eng.pool.num_free_pages == eng.pool.num_pages


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (0.5, True), (2.0, "never")])
def test_beam_search_with_eos_matches_transformers(tiny, model, length_penalty, early_stopping):
    hf, _ = tiny
    prompt = [5, 17, 99, 3, 42, 7, 1, 200]
    plain = hf.generate(torch.tensor([prompt]), num_beams=4, do_sample=False, max_new_tokens=16)
    eos = int(plain[0, len(prompt) + 3])           # a token beams do generate
    ref = hf.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=3, do_sample=False,
                      max_new_tokens=16, eos_token_id=eos, pad_token_id=eos, length_penalty=length_penalty,
                      early_stopping=early_stopping, output_scores=True, return_dict_in_generate=True)
    eng = TreeEngine(model, page_size=4, kv_tokens=2048)
    ours = eng.run(BeamSearchController(prompt, num_beams=4, max_new_tokens=16, eos_token_ids=[eos],
                                        length_penalty=length_penalty, early_stopping=early_stopping,
                                        num_return_sequences=3))
    for mine, theirs in zip(ours["sequences"], ref.sequences.tolist()):
        assert theirs[: len(mine)] == mine and set(theirs[len(mine):]) <= {eos}   # HF pads with EOS
    np.testing.assert_allclose(ours["scores"], ref.sequences_scores.tolist(), atol=1e-4)


def _branch_and_prune() -> Callbacks:
    """Branch every leaf in two every 4 steps (up to 12 leaves), prune the newest leaf every 7."""
    branching = periodic_branching(4, 2, 12)

    def prune(tree, node, step):
        return step % 7 == 6 and len(tree.active()) > 2 and node == tree.active()[-1]

    def horizon(tree, step):
        return min(4 - step % 4, 7 - (step + 1) % 7)

    return Callbacks(branch=branching.branch, prune=prune, horizon=horizon)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sampled_tree_leaf_logits_match_transformers(tiny, model, strategy):
    hf, _ = tiny
    prompts = [list(range(10, 47)), [7, 8, 9]]     # a forest: two prompts
    eng = TreeEngine(model, strategy=strategy, page_size=4, kv_tokens=4096)
    ctl = SamplingController(prompts, n=2, sampler=Sampler(temperature=0.8, top_k=50, seed=3),
                             max_new_tokens=30, callbacks=_branch_and_prune())
    leaves = eng.run(ctl)["leaves"]
    assert len(leaves) > 4 and all(len(leaf["tokens"]) >= 30 + 3 for leaf in leaves)
    check_leaves(hf, leaves)
    assert any(s.plan_ms == 0 for s in eng.stats), "decode windows were never used"
    eng.reset()
    eng.pool.check()
    assert eng.pool.num_free_pages == eng.pool.num_pages


def test_sampling_with_eos_finishes_and_frees_leaves(tiny, model):
    hf, _ = tiny
    eng = TreeEngine(model, page_size=4, kv_tokens=2048)
    eos = list(range(0, 256, 9))
    leaves = eng.run(SamplingController([list(range(1, 10))], n=6, sampler=Sampler(temperature=2.0, seed=0),
                                        max_new_tokens=40, eos_token_ids=eos))["leaves"]
    finished = [leaf for leaf in leaves if leaf["finished"]]
    assert finished and all(leaf["tokens"][-1] in eos for leaf in finished)
    check_leaves(hf, leaves)
    assert all(leaf["node"] not in eng.tree for leaf in finished)      # pruned: KV freed


def test_decode_windows_without_callbacks_match(tiny, model):
    hf, _ = tiny
    eng = TreeEngine(model, strategy="flatten", page_size=4, kv_tokens=4096, window=8)
    leaves = eng.run(SamplingController([list(range(1, 30))], n=3, sampler=Sampler(seed=5),
                                        max_new_tokens=20))["leaves"]
    check_leaves(hf, leaves)
    assert sum(s.plan_ms > 0 for s in eng.stats) == 3      # 20 steps in windows of 8


def test_next_windows_are_planned_in_the_background(tiny, model, monkeypatch):
    """Windows after the first are planned on the planning thread while the one before runs
    (TreeEngine.plan_ahead): same logits, one plan on the caller's thread. With EOS, the leaves a
    prune point keeps are announced once the finished flags land, so those windows are too."""
    hf, _ = tiny
    eng = TreeEngine(model, strategy="flatten", page_size=4, kv_tokens=4096, window=8)
    calls = []
    plan = eng.planner.plan
    monkeypatch.setattr(eng.planner, "plan", lambda *a, **k: calls.append(1) or plan(*a, **k))
    leaves = eng.run(SamplingController([list(range(1, 30))], n=3, sampler=Sampler(seed=5),
                                        max_new_tokens=20))["leaves"]
    check_leaves(hf, leaves)
    assert len(calls) == 1 and sum(s.plan_ms > 0 for s in eng.stats) == 3
    eng.reset()
    calls.clear()
    ctl = SamplingController([list(range(1, 12)), [5, 6, 7]], n=3, sampler=Sampler(seed=1), max_new_tokens=24,
                             eos_token_ids=[3], prune_every=4, forced_lengths=[[2, 9, 30], [5, 14, 30]])
    leaves = eng.run(ctl)["leaves"]
    check_leaves(hf, leaves)
    assert sum(leaf["finished"] for leaf in leaves) >= 4 and len(calls) == 1     # 6 windows of 4 steps
    eng.reset()
    eng.pool.check()
    assert eng.pool.num_free_pages == eng.pool.num_pages


def test_warm_up_leaves_the_engine_empty(model):
    """The warm-up a GPU engine runs at creation (a tiny beam search and sampling run) leaves no
    sequence, result, statistic or page behind."""
    eng = TreeEngine(model, page_size=4, kv_tokens=1024)
    eng._warm_model()
    assert eng.tree.num_nodes == 0 and not eng.tree.results and not eng.stats
    eng.pool.check()
    assert eng.pool.num_free_pages == eng.pool.num_pages


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path (CPU tensors); on a GPU host "
                    "test_cuda_engine_matches_transformers runs the kernels")
def test_triton_interpreter_decode(tiny, model):
    hf, _ = tiny
    eng = TreeEngine(model, strategy="auto", page_size=4, kv_tokens=1024, backend="triton")
    ctl = SamplingController([list(range(1, 20))], n=2, sampler=Sampler(seed=2), max_new_tokens=4,
                             callbacks=periodic_branching(2, 2, 4))
    check_leaves(hf, eng.run(ctl)["leaves"])


@pytest.mark.parametrize("strategy", ["auto", "paths", "sequence"])
def test_speculative_verification_matches_transformers(tiny, model, strategy):
    hf, _ = tiny
    parents = [-1, -1, 0, 0, 1, 2]                 # two first-level drafts, three more below
    ctl = SpeculativeReplayController(parents, [3, 1, 2, 4], list(range(20, 30)), sampler=Sampler(seed=1),
                                      vocab_size=256)
    eng = TreeEngine(model, page_size=4, kv_tokens=1024, strategy=strategy)
    seen = []
    orig = eng.verify

    def spy(node, root, par, drafts):
        logits = orig(node, root, par, drafts)
        seen.append((eng.tree.tokens(node), drafts.tolist(), logits, eng.planner.last_patched))
        c, st = len(seen[-1][0]), eng.stats[-1]     # the root token sees c tokens, draft i c + depth
        assert (st.visible_tokens, st.unique_tokens) == (c + 6 * c + 1 + 1 + 2 + 2 + 2 + 3, c + 6)
        return logits

    eng.verify = spy
    out = eng.run(ctl)
    assert out["accepted"] == 3 + 1 + 2 + 4 and ctl.chain == [0, 2, 5]
    # the context only grew at its tail and the drafts kept their scratch slots: after the first
    # verify the planner patches its last plan (PAT's lazy update) instead of planning again
    assert [s[3] for s in seen] == [False, True, True, True]
    # the drafts' scratch slots and the padding slot sit at the top of the pool: the verified
    # sequence's slots stay one run, which the kernels read with affine addresses
    slots = eng.kv.own_slots(ctl.ctx)
    assert (np.diff(slots) == 1).all() and slots[0] == 0
    for ctx, drafts, logits, _ in seen:
        assert (logits[0] - hf_last_logits(hf, ctx)).abs().max() <= TOL
        for i in range(len(parents)):
            path, at = [], i
            while at >= 0:
                path.append(drafts[at])
                at = parents[at]
            assert (logits[1 + i] - hf_last_logits(hf, ctx + path[::-1])).abs().max() <= TOL
    assert (eng.logits_of(ctl.ctx) - hf_last_logits(hf, out["tokens"])).abs().max() <= TOL


def test_tot_replay_200_steps_leaks_no_pages(model):
    ctl = ToTReplayController.from_template("sorting", prompt=list(range(64)), vocab_size=256, scale=0.05,
                                            sampler=Sampler(seed=0))
    assert ctl.total_steps() > 200
    eng = TreeEngine(model, page_size=16, kv_tokens=8192)
    start = eng.pool.num_free_pages

    def check(step, stats):
        eng.pool.check()

    eng.run(ctl, max_steps=200, on_step=check)
    assert ctl.thoughts > 30 and eng.pool.num_free_pages < start
    eng.reset()
    eng.pool.check()
    assert eng.pool.num_free_pages == eng.pool.num_pages == start


def test_tot_replay_follows_the_template(model):
    ctl = ToTReplayController([-1, 0, 0, 0, 2, 2], [5, 3, 4, 2, 2, 1], list(range(5)), sampler=Sampler(seed=0))
    eng = TreeEngine(model, page_size=4, kv_tokens=512)
    out = eng.run(ctl)
    assert len(eng.stats) == ctl.total_steps() == 4 + 2
    assert sorted((t["template_node"], len(t["tokens"])) for t in out["thoughts"]) == \
        [(1, 3), (2, 4), (3, 2), (4, 2), (5, 1)]
    assert eng.pool.num_free_pages == eng.pool.num_pages   # the replay pruned everything at its end


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_qwen2_and_mistral_checkpoints(tmp_path, arch):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=True, **common)
        hf = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.MistralConfig(sliding_window=None, **common)
        hf = transformers.MistralForCausalLM(cfg)
    torch.manual_seed(1)
    for p in hf.parameters():       # random biases too (Qwen2 has q/k/v biases)
        p.data.normal_(0, 0.2)
    hf.eval()
    m = TreeModel.from_pretrained(_save(hf, tmp_path / arch))
    assert m.config.arch == arch and m.config.qkv_bias == (arch == "qwen2")
    eng = TreeEngine(m, page_size=4, kv_tokens=1024)
    ctl = SamplingController([list(range(1, 20))], n=2, sampler=Sampler(seed=0), max_new_tokens=8,
                             callbacks=periodic_branching(3, 2, 8))
    check_leaves(hf, eng.run(ctl)["leaves"])


def test_sharded_checkpoint_loads(tmp_path, tiny, model):
    hf, _ = tiny
    path = tmp_path / "sharded"
    hf.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    sharded = TreeModel.from_pretrained(path)
    for a, b in zip(sharded.weights.layers, model.weights.layers):
        assert torch.equal(a.qkv, b.qkv) and torch.equal(a.gate_up, b.gate_up)


def test_cuda_graph_runner_logic(tiny, model, monkeypatch):
    """The piecewise-graph runner (buffers, bucket padding, pad slot, attention between the
    segments) with each 'graph' replaced by a direct call of its segment (CPU has no CUDA graphs)."""
    from treeattn.engine.graphs import DecodeGraphs

    class Direct:
        def __init__(self, fn):
            self.replay = fn

    def capture(self, m):
        if m > self._cap:
            self._alloc(max(m, 2 * self._cap))
        self._bufs["meta"][m: 2 * m].fill_(self.kv.pad_slot)
        return [Direct(f) for f in self._segments(m)]

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    hf, _ = tiny
    eng = TreeEngine(model, strategy="greedy", page_size=4, kv_tokens=2048)
    eng.graphs = DecodeGraphs(model, eng.kv)
    eng.prepare_graphs([3])
    ctl = SamplingController([list(range(1, 25)), [9, 9, 9]], n=3, sampler=Sampler(seed=4), max_new_tokens=9,
                             callbacks=periodic_branching(3, 2, 40))
    check_leaves(hf, eng.run(ctl)["leaves"])        # 6, 12, then 24 leaves: buckets 8, 12, 24
    assert not eng.graphs.disabled and eng.graphs.max_diff < 1e-5 and eng.graphs._checked == {4, 8, 12, 24}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy,max_inflight", [("auto", None), ("auto", 2), ("sequence", None), ("flatten", 1)])
def test_cuda_engine_matches_transformers(tiny, strategy, max_inflight):
    """The GPU path: Triton kernels, piecewise CUDA graphs (checked against eager), asynchronous
    decode windows (with and without a bound on the queued steps), speculative verification and
    beam search, all in fp32 against transformers."""
    hf, path = tiny
    m = TreeModel.from_pretrained(path, device="cuda", dtype=torch.float32)
    eng = TreeEngine(m, strategy=strategy, page_size=16, kv_tokens=8192, max_inflight=max_inflight)
    assert eng.graphs is not None
    eng.prepare_graphs([4, 8])
    ctl = SamplingController([list(range(10, 47)), [7, 8, 9]], n=2, sampler=Sampler(seed=3), max_new_tokens=24,
                             callbacks=periodic_branching(8, 2, 8))
    check_leaves(hf, eng.run(ctl)["leaves"])
    assert not eng.graphs.disabled and eng.graphs.max_diff < 1e-4
    eng.reset()
    spec = SpeculativeReplayController([-1, -1, 0, 0, 1, 2], [3, 1, 2, 4], list(range(20, 30)),
                                       sampler=Sampler(seed=1), vocab_size=256)
    out = eng.run(spec)
    assert (eng.logits_of(spec.ctx).cpu() - hf_last_logits(hf, out["tokens"])).abs().max() <= TOL
    eng.reset()
    prompt = [5, 17, 99, 3, 42, 7, 1, 200]
    ours = eng.run(BeamSearchController(prompt, num_beams=4, max_new_tokens=16))
    ref = hf.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4, do_sample=False,
                      max_new_tokens=16)
    assert ours["sequences"] == ref.tolist()
    eng.reset()
    context, tail = list(range(3, 40)), [11, 12, 13, 14, 15]      # a prefill after cached tokens
    node = eng.prefill_chain(eng.prefill_chain(None, [context])[-1], [tail])[-1]
    assert (eng.logits_of(node).cpu() - hf_last_logits(hf, context + tail)).abs().max() <= TOL
    eng.reset()
    assert eng.pool.num_free_pages == eng.pool.num_pages


def test_max_inflight_must_be_positive(model):
    with pytest.raises(ValueError, match="max_inflight"):
        TreeEngine(model, page_size=4, kv_tokens=256, max_inflight=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_survive_a_bigger_bucket(tiny):
    """A bucket bigger than the captured ones reallocates the static buffers and the graph
    memory pool (as a server's first 1-token step followed by a 40-sequence batch does)."""
    hf, path = tiny
    m = TreeModel.from_pretrained(path, device="cuda", dtype=torch.float32)
    eng = TreeEngine(m, strategy="auto", page_size=16, kv_tokens=8192)
    eng.prepare_graphs([1])
    eng.prepare_graphs([40])
    ctl = SamplingController([list(range(10, 47))], n=40, sampler=Sampler(seed=3), max_new_tokens=6)
    check_leaves(hf, eng.run(ctl)["leaves"])
    assert not eng.graphs.disabled and eng.graphs.max_diff < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["flatten", "sequence"])
def test_triton_decode_windows_match_transformers(tiny, strategy):
    """Decode windows plan several steps at once and lower each query's prefix after planning, so
    the tree mask hides the slots reserved for later steps. With the Triton kernels (the
    interpreter on CPU) every launch reading such a slot must apply the mask, also those whose
    queries saw their items whole at planning time (a per-launch mask flag once skipped them: 0.09
    off)."""
    hf, path = tiny
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = TreeModel.from_pretrained(path, device=dev, dtype=torch.float32)
    eng = TreeEngine(m, strategy=strategy, page_size=16, kv_tokens=2048, backend="triton")
    ctl = SamplingController([list(range(10, 47)), [7, 8, 9]], n=2, sampler=Sampler(seed=3), max_new_tokens=24,
                             callbacks=periodic_branching(8, 2, 8))
    check_leaves(hf, eng.run(ctl)["leaves"])
    assert eng.planner.last_reason  # planned at least once


def test_batched_prefill_equals_separate_prefills_and_transformers(tiny, model):
    batched_vs_separate(model, hf=tiny[0])
