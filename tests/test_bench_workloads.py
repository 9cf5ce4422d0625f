"""``treeattn bench workloads``' workload names and controllers (the timing itself needs a GPU)."""
import pytest

from treeattn.bench.workloads import DEFAULT_WORKLOADS, parse_workload
from treeattn.engine import BeamSearchController, SamplingController


def test_names_parse_to_controllers():
    for name in DEFAULT_WORKLOADS:
        wl = parse_workload(name, prompt_len=12, new_tokens=3)
        ctl = wl.controller(vocab=64)
        assert isinstance(ctl, BeamSearchController if name.startswith("beam") else SamplingController)
        assert (wl.hf_args() is not None) == (wl.kind != "registry")
    g = parse_workload("group-8x16")
    assert (g.prompts, g.n, g.prompt_len) == (8, 16, 1500)
    assert parse_workload("beam-8").prompt_len == 2000
    assert parse_workload("fewshot", new_tokens=5).extra == {"max_new_tokens": 5}


def test_rollout_and_best_of_n_sizes():
    r = parse_workload("rollout-4x8", prompt_len=10, new_tokens=20)
    assert r.registry == "rollout" and r.extra == dict(num_prompts=4, n=8, prompt_len=10, max_new_tokens=20)
    assert r.controller(vocab=64).n == 8
    b = parse_workload("best-of-16")
    assert (b.registry, b.extra["n"], b.extra["keep_every"]) == ("best-of-n", 16, 16)


@pytest.mark.parametrize("bad", ["beam-x", "group-8", "rollout-3", "best-of-x", "nonsense"])
def test_bad_names(bad):
    with pytest.raises(ValueError, match="workload"):
        parse_workload(bad)
