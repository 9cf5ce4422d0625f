"""Qwen3 and Gemma 3 (and sliding-window Mistral / Qwen2) against transformers on tiny random
models whose paths outgrow their sliding window: per-leaf logits of a branching tree, greedy
generation, beam search and speculative verification, fp32 on CPU; and the configs the engine
refuses, before any weight is read."""
import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from treeattn.engine import (Sampler, SamplingController, TreeEngine, TreeModel,  # noqa: E402
                             periodic_branching)
from treeattn.engine.config import ModelConfig, load_config  # noqa: E402
from treeattn.engine.workloads import SpeculativeReplayController  # noqa: E402
from helpers import batched_vs_separate, check_leaves, hf_last_logits  # noqa: E402

TOL = 1e-4
WINDOW = 8

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, initializer_range=0.2, eos_token_id=None,
              bos_token_id=None, pad_token_id=None, sliding_window=WINDOW)


def _hf(arch: str):
    if arch == "qwen3":        # layer 0 full, layer 1 sliding (from max_window_layers on)
        cfg = transformers.Qwen3Config(num_hidden_layers=2, use_sliding_window=True, max_window_layers=1,
                                       tie_word_embeddings=False, **COMMON)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "gemma3":     # local layers with their own RoPE base, a global one with linear scaling
        cfg = transformers.Gemma3TextConfig(
            num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24, rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}, **COMMON)
        cls = transformers.Gemma3ForCausalLM
    elif arch == "mistral":    # every layer sliding
        cfg = transformers.MistralConfig(num_hidden_layers=2, **COMMON)
        cls = transformers.MistralForCausalLM
    else:
        cfg = transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=True, max_window_layers=1, **COMMON)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    hf = cls(cfg)
    with torch.no_grad():     # random norms (Gemma's start at 0: 1 + w) and biases too
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.normal_(0, 0.3)
    return hf.eval()


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def pair(request, tmp_path_factory):
    """(transformers model, TreeModel) of one architecture."""
    hf = _hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, TreeModel.from_pretrained(path)


def test_config_reads_the_architecture(pair):
    _, m = pair
    c = m.config
    assert c.qk_norm and c.sliding_window == WINDOW
    if c.arch == "gemma3_text":
        assert c.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
        assert c.local_rope_theta == 100.0 and c.rope_scaling["factor"] == 2.0
        assert c.sm_scale == 24 ** -0.5 and c.hidden_act == "gelu_pytorch_tanh" and c.tie_word_embeddings
    else:
        assert c.arch == "qwen3" and c.layer_types == ("full_attention", "sliding_attention")


def counted(planner) -> list:
    """Record the trees ``planner`` plans."""
    trees, plan = [], planner.plan

    def spy(tree, **kw):
        trees.append(tree)
        return plan(tree, **kw)
    planner.plan = spy
    return trees


@pytest.mark.parametrize("prompts", [[[3, 1, 4, 1, 5]], [[3, 1, 4, 1, 5], list(range(30, 43))]])
def test_branching_tree_past_the_window_matches_transformers(pair, prompts):
    """Samples that branch every 3 steps (leaves 3 windows long), of a prompt shorter than the
    window (paths cross it inside a decode window), alone and with one longer than the window."""
    hf, m = pair
    eng = TreeEngine(m, page_size=4, kv_tokens=2048)
    full, sliding = counted(eng.planner), counted(eng.sliding_planner)
    ctl = SamplingController(prompts, n=2, sampler=Sampler(seed=0), max_new_tokens=12,
                             callbacks=periodic_branching(3, 2, 8))
    check_leaves(hf, eng.run(ctl)["leaves"])
    steps = [s for s in eng.stats if s.kind == "decode"]
    assert len(full) == 4 and len(steps) == 12      # decode windows of 3 steps (branching) are kept
    longest = max(len(p) for p in prompts) + np.arange(len(steps))   # the longest path of each step
    assert len(sliding) == int((longest >= WINDOW).sum())             # ... sliding layers plan per step
    assert all(t.visible_tokens.max() == WINDOW for t in sliding)


def test_prefill_over_context_past_the_window(pair):
    hf, m = pair
    prompt = list(range(7, 27))
    eng = TreeEngine(m, page_size=4, kv_tokens=512)
    root = eng.tree.add_root()
    eng.prefill(root, prompt[:11])
    ours = eng.prefill(root, prompt[11:])        # its first tokens' windows reach into the context
    assert (ours - hf_last_logits(hf, prompt)).abs().max().item() <= TOL


def test_greedy_generate_and_beam_search_match_transformers(pair):
    hf, m = pair
    prompt = [5, 17, 99, 3, 42, 7]
    eng = TreeEngine(m, page_size=4, kv_tokens=2048)
    out = eng.generate([prompt], temperature=0, max_new_tokens=10)[0].samples[0].token_ids
    ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10)
    assert out == ref[0, len(prompt):].tolist()
    beams = eng.beam_search(prompt, num_beams=3, max_new_tokens=8)
    ref = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                      max_new_tokens=8, length_penalty=1.0, early_stopping=False, output_scores=True,
                      return_dict_in_generate=True)
    assert beams.sequences == ref.sequences[:, len(prompt):].tolist()
    np.testing.assert_allclose(beams.scores, ref.sequences_scores.tolist(), atol=1e-4)


def test_speculative_verification_past_the_window(pair):
    hf, m = pair
    parents = [-1, -1, 0, 0, 1, 2]
    ctl = SpeculativeReplayController(parents, [3, 1, 2], list(range(20, 30)), sampler=Sampler(seed=1),
                                      vocab_size=256)
    eng = TreeEngine(m, page_size=4, kv_tokens=1024)
    out = eng.run(ctl)
    assert (eng.logits_of(ctl.ctx) - hf_last_logits(hf, out["tokens"])).abs().max() <= TOL


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sliding_mistral_and_qwen2_run_past_their_window(tmp_path, arch):
    hf = _hf(arch)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    m = TreeModel.from_pretrained(tmp_path)
    assert m.config.sliding_window == WINDOW
    eng = TreeEngine(m, page_size=4, kv_tokens=1024)
    ctl = SamplingController([list(range(1, 12))], n=2, sampler=Sampler(seed=0), max_new_tokens=6,
                             callbacks=periodic_branching(3, 2, 4))
    check_leaves(hf, eng.run(ctl)["leaves"])


def test_multimodal_gemma3_checkpoint_runs_its_language_model(tmp_path):
    """A gemma3 (multimodal) directory: text_config plus weights under language_model.model.*
    (transformers v4's layout) and vision weights the engine ignores."""
    from safetensors.torch import load_file, save_file

    hf = _hf("gemma3")
    hf.save_pretrained(tmp_path / "text", safe_serialization=True)
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "text_config": text, "vision_config": {"model_type": "siglip_vision_model"},
         "eos_token_id": [1, 106]}))
    tensors = {"language_model." + k: v for k, v in load_file(tmp_path / "text" / "model.safetensors").items()}
    tensors["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(4)
    save_file(tensors, tmp_path / "mm" / "model.safetensors")
    m = TreeModel.from_pretrained(tmp_path / "mm")
    assert m.config.language_model and m.config.eos_token_ids == (1, 106)
    eng = TreeEngine(m, page_size=4, kv_tokens=512)
    prompt = list(range(3, 15))
    assert (eng.prefill(eng.tree.add_root(), prompt) - hf_last_logits(hf, prompt)).abs().max() <= TOL


GEMMA3_1B = {   # google/gemma-3-1b-it's config.json (transformers v4 layout)
    "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None, "bos_token_id": 2,
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
    "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
    "sliding_window_pattern": 6, "vocab_size": 262144}


def test_v4_gemma3_configs():
    c = ModelConfig.from_hf(GEMMA3_1B)
    assert c.layer_types.count("full_attention") == 4 and c.layer_types[5] == "full_attention"
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling, c.sliding_window) == (1e6, 1e4, None, 512)
    # the multimodal 4B: a text_config holding only what differs from the defaults
    mm = ModelConfig.from_hf({"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}})
    assert (mm.num_heads, mm.num_kv_heads, mm.head_dim, mm.vocab_size) == (8, 4, 256, 262208)
    assert mm.rope_scaling == {"factor": 8.0, "rope_type": "linear"} and mm.local_rope_theta == 1e4
    assert mm.language_model and mm.eos_token_ids == (1, 106)


@pytest.mark.parametrize("change, match", [
    ({"model_type": "qwen3_moe"}, "unsupported model_type 'qwen3_moe'"),
    ({"num_experts": 128}, "mixture-of-experts layers \\(num_experts=128\\)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling type 'yarn' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma3"}, "only the Gemma 3 language model is supported"),
    ({"layer_types": ["full_attention", "chunked_attention"], "use_sliding_window": True},
     "layer_types must give one of"),
])
def test_unsupported_configs_are_refused_before_the_weights(tmp_path, change, match):
    cfg = {"model_type": "qwen3", "num_hidden_layers": 2, **{k: v for k, v in COMMON.items() if v is not None}}
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))    # no weights at all: refused first
    with pytest.raises(ValueError, match=match):
        load_config(tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
@pytest.mark.parametrize("strategy", ["auto", "sequence"])
def test_cuda_engine_past_the_window_matches_transformers(tmp_path, arch, strategy):
    """The GPU path: Triton kernels, fused layers, piecewise CUDA graphs with one attention graph
    per plan (full and sliding-window layers), decode windows, fp32 against transformers."""
    hf = _hf(arch)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    m = TreeModel.from_pretrained(tmp_path, device="cuda", dtype=torch.float32)
    eng = TreeEngine(m, strategy=strategy, page_size=16, kv_tokens=4096)
    assert eng.graphs is not None and eng._attn_graph is not None
    eng.prepare_graphs([2, 4, 8])
    ctl = SamplingController([[3, 1, 4, 1, 5], list(range(30, 43))], n=2, sampler=Sampler(seed=0),
                             max_new_tokens=20, callbacks=periodic_branching(4, 2, 8))
    check_leaves(hf, eng.run(ctl)["leaves"])
    assert not eng.graphs.disabled and eng.graphs.max_diff < 1e-4 and eng._attn_graph is not None
    eng.reset()
    prompt = [5, 17, 99, 3, 42, 7]
    beams = eng.beam_search(prompt, num_beams=3, max_new_tokens=12)
    ref = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                      max_new_tokens=12)
    assert beams.sequences == ref[:, len(prompt):].tolist()


def test_batched_prefill_past_the_window_equals_separate_prefills(pair):
    hf, m = pair
    batched_vs_separate(m, hf=hf)
