"""Device profiles: JSON round trip, the choice of profile for a device, the cost model reading the
profile's constants, ``treeattn calibrate``'s fit (fed synthetic timings) and its CLI without a GPU."""
import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from treeattn import TreeAttention
from treeattn.plan import CostModel, HeadConfig, make_plan
from treeattn.plan.select import profiles
from treeattn.plan.select.estimate import estimate_items
from treeattn.plan.select.profiles import (
    H100,
    H200,
    DeviceProfile,
    fit_constants,
    fit_rates,
    load_profile,
    profile_for,
    profile_path,
    save_profile,
    scale_rates,
)
from treeattn.plan.strategies.node import plan_node
from treeattn.tree import tree_from_spec

HEADS = HeadConfig(32, 8, 128, torch.float16)


def test_json_round_trip(tmp_path):
    odd = dataclasses.replace(H100, sm_flops=1.23e12, merge_last_min_group=4, name="Some GPU/x",
                              tile_tall_tma=(64, 4, 2), tma_min_tokens=((2.0, 512),), persist_min_group=2,
                              tile_long=(128, 8, 2), heads_inner_min_tokens=256)
    path = save_profile(odd, tmp_path / "a" / "p.json", provenance={"torch": torch.__version__})
    assert load_profile(path) == odd  # (tiles come back as tuples: profiles stay hashable)
    assert hash(load_profile(path)) == hash(odd)
    assert json.loads(path.read_text())["provenance"] == {"torch": torch.__version__}
    # constants left out keep the H200's; ints given for floats are taken
    assert DeviceProfile.from_json('{"num_sms": 8, "bandwidth": 1000}') == dataclasses.replace(
        H200, num_sms=8, bandwidth=1000.0)


@pytest.mark.parametrize("text,problem", [("{", "not JSON"), ("[]", "JSON object"),
                                          ('{"sm_flop": 1.0}', "unknown profile keys"),
                                          ('{"num_sms": 1.5}', "num_sms must be a int"),
                                          ('{"num_sms": 0}', "num_sms must be >= 1"),
                                          ('{"mask_cost": -1}', "mask_cost must be >= 0"),
                                          ('{"name": 3}', "name must be a str"),
                                          ('{"tile_beside": [32, 4]}', r"tile_beside must be \[block_n"),
                                          ('{"tile_beside": [48, 4, 3]}', "power of two"),
                                          ('{"tile_long": [64, 3, 3]}', "tile_long: block_n must be a power"),
                                          ('{"tma_min_tokens": [[1, -5]]}', "tokens must be >= 0"),
                                          ('{"tma_min_tokens": [1, 2]}', "pairs")])
def test_bad_profiles_are_refused_naming_the_problem(tmp_path, text, problem):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem) as e:
        load_profile(path)
    assert str(path) in str(e.value)
    with pytest.raises(ValueError, match="cannot read the device profile"):
        load_profile(tmp_path / "missing.json")


def test_cpu_gets_the_h200_profile():
    assert profile_for("cpu") == H200
    assert TreeAttention(device="cpu").cost.profile == H200
    if not torch.cuda.is_available():
        assert profile_for() == H200 and CostModel().profile == H200


def test_profile_path_sanitises_the_device_name(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert profile_path("NVIDIA H100 80GB HBM3") == tmp_path / "treeattn" / "profiles" / "NVIDIA_H100_80GB_HBM3.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert profile_path("a/b").parent.parent.parent.name == ".cache" and profile_path("a/b").name == "a_b.json"


def _fake_cuda(monkeypatch, name, sms=132, smem=232448, l2=60 * 2**20):
    """profile_for on a pretend CUDA device with these properties."""
    props = SimpleNamespace(name=name, multi_processor_count=sms, shared_memory_per_block_optin=smem,
                            L2_cache_size=l2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


def test_profile_selection_by_name_file_and_env(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TREEATTN_PROFILE", raising=False)
    _fake_cuda(monkeypatch, "NVIDIA H200")
    assert profile_for("cuda:0") == H200
    _fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3", l2=50 * 2**20)
    assert profile_for("cuda:0") == H100
    # an unknown device: the H200's constants with its own facts
    _fake_cuda(monkeypatch, "Future GPU", sms=200, smem=300_000, l2=96 * 2**20)
    unknown = profile_for("cuda:0")
    assert unknown == dataclasses.replace(H200, name="Future GPU", num_sms=200, smem_per_block=300_000,
                                          l2_bytes=96 * 2**20)
    # the calibrated profile of the device's name wins over both
    mine = dataclasses.replace(unknown, sm_flops=9e12)
    save_profile(mine, profile_path("Future GPU"))
    assert profile_for("cuda:0") == mine
    # and $TREEATTN_PROFILE over that
    other = save_profile(dataclasses.replace(H100, program_flops=1e12), tmp_path / "other.json")
    monkeypatch.setenv("TREEATTN_PROFILE", str(other))
    assert profile_for("cuda:0").program_flops == 1e12
    monkeypatch.setenv("TREEATTN_PROFILE", str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="nope.json"):
        profile_for("cuda:0")


def test_cost_model_reads_the_profiles_constants():
    tree = tree_from_spec("1,4,16_2048,256,64")
    items, _ = plan_node(tree, HEADS, CostModel(profile=H200))
    base = estimate_items(tree, items, HEADS, CostModel(profile=H200))
    # twice the rates and half the overheads: the attention part takes half as long
    fast = dataclasses.replace(scale_rates(H200, 2.0, 2.0), program_overhead_s=H200.program_overhead_s / 2,
                               bandwidth=H200.bandwidth * 2)
    quick = estimate_items(tree, items, HEADS, CostModel(profile=fast))
    assert quick["attention"] == pytest.approx(base["attention"] / 2, rel=1e-9)
    slow_merge = estimate_items(tree, items, HEADS, CostModel(profile=dataclasses.replace(
        H200, merge_step_s=H200.merge_step_s * 10)))
    assert slow_merge["merge"] > base["merge"] and slow_merge["attention"] == base["attention"]
    fixed = estimate_items(tree, items, HEADS, CostModel(profile=dataclasses.replace(H200, fixed_overhead_s=0.0)))
    assert fixed["total"] == pytest.approx(base["total"] - H200.fixed_overhead_s, rel=1e-12)
    # the SM count sizes the balance split and the lowering
    assert CostModel(profile=dataclasses.replace(H200, num_sms=10)).balance_slots == 15
    assert CostModel(profile=H200).balance_slots == 198


def test_plans_follow_the_profiles_sm_count():
    tree = tree_from_spec("1,32,512_512,1024,256")
    heads = HeadConfig(64, 8, 128, torch.float16)
    h200 = make_plan(tree, heads, cost=CostModel(tma=True, pdl=True, profile=H200))
    assert [ln.programs for ln in h200.launches] == [0, 132]  # persistent over one program a SM
    small = make_plan(tree, heads, cost=CostModel(tma=True, pdl=True, profile=dataclasses.replace(H200, num_sms=100)))
    assert small.launches[-1].programs in (0, 100)


def test_plans_follow_the_profiles_lowering_tiles_and_thresholds():
    """The lowering takes its tiles and thresholds from the cost model's profile, and precompile
    compiles what that profile's plans launch: the root of ``1,20_100,5`` (one 128-row launch over
    a run of 100 slots, 32-token tiles: 3 and a partial one) takes the profile's tall contig tile,
    and the split tail once ``split_tail_tiles`` tiles fit in its unit."""
    from treeattn.precompile import launch_configs

    tree, heads = tree_from_spec("1,20_100,5"), HeadConfig(8, 2, 32, torch.float16)
    odd = dataclasses.replace(H200, tile_tall_contig=(16, 2, 2), split_tail_tiles=3)

    def tall(profile):
        plan = make_plan(tree, heads, strategy="node", cost=CostModel(profile=profile))
        return [(ln.block_n, ln.num_warps, ln.num_stages, ln.contig, ln.split_tail)
                for ln in plan.launches if ln.block_m == 128]

    assert tall(H200) == [(*H200.tile_tall_contig, True, False)]
    assert tall(odd) == [(16, 2, 2, True, True)]
    assert (128, 16, 2, 2, True, False) in launch_configs(heads, profile=odd)
    assert (128, 16, 2, 2, True, False) not in launch_configs(heads, profile=H200)


def test_plans_follow_the_profiles_kv_tiles():
    """Items take the profile's KV tiles, in the plan and in the cost model's rating, and precompile
    compiles them: ``4_100`` (four 100-token items of 16-row tiles, gathered) takes ``tile_long``,
    and ``tile_short`` once ``short_item_tokens`` reaches 100."""
    from treeattn.plan.select.launches import launch_features
    from treeattn.precompile import launch_configs

    tree, heads = tree_from_spec("4_100"), HeadConfig(8, 2, 32, torch.float16)
    wide = dataclasses.replace(H200, tile_long=(128, 8, 2))

    def tiles(profile):
        cost = CostModel(profile=profile, target_programs=1)  # (no KV split)
        plan = make_plan(tree, heads, strategy="sequence", cost=cost)
        rated = launch_features(np.full(4, 100), np.ones(4, dtype=np.int64), heads, profile=profile)
        assert rated[:, 1].tolist() == [ln.block_n for ln in plan.launches]
        return [(ln.block_n, ln.num_warps, ln.num_stages) for ln in plan.launches]

    assert tiles(H200) == [H200.tile_long]
    assert tiles(wide) == [(128, 8, 2)]
    assert tiles(dataclasses.replace(wide, short_item_tokens=100)) == [H200.tile_short]
    assert (16, 128, 8, 2, False, False) in launch_configs(heads, profile=wide)
    assert (16, 128, 8, 2, False, False) not in launch_configs(heads, profile=H200)


def _cases():
    """(tree, strategy, heads) of bandwidth- to compute-bound plans, like calibrate's."""
    out = []
    for spec, heads in (("1,16_4096,32", HeadConfig(32, 32, 128, torch.float16)),
                        ("1,4,16_2048,256,64", HEADS),
                        ("1,64_2048,32", HeadConfig(64, 8, 128, torch.float16)),
                        ("1,256_1024,32", HeadConfig(64, 8, 128, torch.float16))):
        tree = tree_from_spec(spec)
        cost = CostModel(profile=H200)
        items, _ = plan_node(tree, heads, cost)
        out.append(lambda p, tree=tree, items=items, heads=heads, cost=cost: estimate_items(
            tree, items, heads, dataclasses.replace(cost, profile=p))["total"])
    return out


def test_fit_recovers_the_rates_of_synthetic_timings():
    """Timings made by a profile whose memory rates are 0.7x and compute rates 1.3x the H200's
    give those factors back (to the grid's resolution) and predict the timings."""
    true = scale_rates(H200, 0.7, 1.3)
    cases = [(predict(true), predict) for predict in _cases()]
    fitted, report = fit_rates(H200, cases)
    assert report["memory_scale"] == pytest.approx(0.7, rel=0.03)
    assert report["compute_scale"] == pytest.approx(1.3, rel=0.06)
    assert report["rms_log_error_after"] < 0.01 < report["rms_log_error_before"]
    for measured, predict in cases:
        assert predict(fitted) == pytest.approx(measured, rel=0.02)
    # the rest of the profile is the base's
    assert dataclasses.replace(fitted, **{k: getattr(H200, k) for k in
                                          profiles.MEMORY_RATES + profiles.COMPUTE_RATES}) == H200


def test_fit_refuses_bad_timings():
    with pytest.raises(ValueError, match="at least one"):
        fit_rates(H200, [])
    with pytest.raises(ValueError, match="positive"):
        fit_rates(H200, [(0.0, _cases()[0])])
    with pytest.raises(ValueError, match="positive"):
        fit_rates(H200, [(float("nan"), _cases()[0])])


def test_fit_constants_moves_only_the_constants_the_loss_depends_on():
    """A loss of the log distance of two constants from 2x and 0.5x their H200 values: coordinate
    descent finds them within its grid (span 4, 7 points halving: 1/27 of ln 4 after three rounds),
    and a constant the loss ignores keeps its value."""
    def loss(p):
        return (np.log(p.sm_bandwidth / (2 * H200.sm_bandwidth)) ** 2
                + np.log(p.mask_cost / (0.5 * H200.mask_cost)) ** 2)

    fitted, report = fit_constants(H200, loss, ("sm_bandwidth", "mask_cost", "merge_step_s"), rounds=3)
    assert fitted.sm_bandwidth == pytest.approx(2 * H200.sm_bandwidth, rel=0.06)
    assert fitted.mask_cost == pytest.approx(0.5 * H200.mask_cost, rel=0.06)
    assert report["factors"]["merge_step_s"] == 1.0 and fitted.merge_step_s == H200.merge_step_s
    assert report["loss_after"] < 0.01 < report["loss_before"]
    with pytest.raises(ValueError, match="launch_overhead_s"):  # zero: no factor moves it
        fit_constants(H200, loss, ("launch_overhead_s",))
    with pytest.raises(ValueError, match="num_sms"):
        fit_constants(H200, loss, ("num_sms",))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error path of a host without a GPU")
def test_calibrate_without_a_gpu_fails_in_one_line(capsys):
    from treeattn.cli.main import main

    assert main(["calibrate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("treeattn calibrate: error:") and "CUDA" in err[0]
    assert main(["calibrate", "--device", "cpu", "--out", "x.json"]) == 2


def test_scale_rates_touches_only_the_rates():
    scaled = scale_rates(H200, 2.0, 3.0)
    assert scaled.sm_bandwidth == 2 * H200.sm_bandwidth and scaled.sm_flops == 3 * H200.sm_flops
    assert scaled.bandwidth == H200.bandwidth and scaled.num_sms == H200.num_sms
    assert np.isclose(scaled.tall_first_flops, 3 * H200.tall_first_flops)
