"""``treeattn calibrate``: measure this GPU and write its device profile
(:class:`~treeattn.plan.select.profiles.DeviceProfile`), which
:func:`~treeattn.plan.select.profiles.profile_for` then gives every cost model on it.

It reads the SM count, L2 and shared memory from the device's properties, times a large copy
(the HBM bandwidth) and an empty kernel (the launch floor, reported: the fitted constants absorb
it), and times the attention kernel under CUDA-graph replay on a few synthetic plans, from
bandwidth-bound (one query per KV head, long items) to compute-bound (GQA group 8, tall query
tiles), fitting the profile's memory and compute rates to them
(:func:`~treeattn.plan.select.profiles.fit_rates`). The other constants keep the built-in
profile's values. A few seconds on an H200.

With ``--cross-validate``, it measures nothing (no GPU needed): it reads ``treeattn bench
kernels`` results that time every strategy and reports, for each family of trees left out in
turn, ``auto``'s regret there with the profile's fitted constants refitted on the other families
(:mod:`treeattn.plan.select.crossval`).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import sys

import torch
import triton
import triton.language as tl

from treeattn.cli.args import add_log_level, existing_file, prepare_output

#: (kernel-suite tree, query heads, KV heads, strategy): bandwidth-bound to compute-bound plans
#: ``(tree, query heads, KV heads, strategy, H200 microseconds)``: the synthetic plans calibrate
#: times, with their CUDA-graph latency on the H200 whose suite the built-in constants were fitted
#: on. A device's prediction is that latency times the model's ratio between the device's profile
#: and the H200's, so an H200 calibrates to factors near 1 (the model's absolute error on these
#: plans, up to 2x, cancels) and another GPU is rated against what an H200 really ran.
CASES = (("1,16_4096,32", 32, 32, "node", 69.30), ("1,64_8192,32", 32, 32, "sequence", 1248.2),
         ("1,4,16_2048,256,64", 32, 8, "node", 33.98), ("1,64_2048,32", 64, 8, "node", 40.86),
         ("1,256_1024,32", 64, 8, "node", 45.50))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="measure this GPU and write its device profile (CUDA)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where to write the JSON profile (default: the per-device path profile_for reads); "
                        "with --cross-validate, the JSON report (default: none)")
    p.add_argument("--device", default="cuda", help="the CUDA device to measure, e.g. cuda:1")
    cv = p.add_argument_group("cross-validation (CPU, measures nothing)")
    cv.add_argument("--cross-validate", nargs="+", type=existing_file, default=None, metavar="RESULTS",
                    help="bench kernels JSON files timing every strategy: leave each family of trees out, refit "
                         "the profile's constants on the others, report auto's regret on it")
    cv.add_argument("--objective", default="regret", choices=["regret", "latency"],
                    help="what the refit minimises on the other families: the log regret of auto's choices, "
                         "or the squared log error of every strategy's estimate (default: regret)")
    cv.add_argument("--refit", type=_constants_arg, default=None, metavar="NAME,...",
                    help="the profile constants refitted (default: the fitted rate constants, "
                         "treeattn.plan.select.profiles.FITTED_CONSTANTS)")
    add_log_level(p)
    p.set_defaults(func=calibrate_command)


def _constants_arg(text: str) -> tuple:
    """Comma-separated positive float constants of :class:`DeviceProfile`."""
    import argparse

    from treeattn.plan.select.profiles import H200, DeviceProfile

    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    floats = [f.name for f in dataclasses.fields(DeviceProfile) if f.type == "float" and getattr(H200, f.name) > 0]
    bad = [n for n in names if n not in floats]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"not refittable: {', '.join(bad) or '(none given)'}; expected comma-"
                                         f"separated positive float constants of the profile: {', '.join(floats)}")
    return names


def calibrate_command(args) -> int:
    from treeattn.plan.select.profiles import profile_path, save_profile

    if args.cross_validate:
        return cross_validate_command(args)

    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        return _fail(f"bad --device {args.device!r}: {e}")
    if device.type != "cuda" or not torch.cuda.is_available():
        return _fail("calibrate measures a CUDA device, and none is available" if not torch.cuda.is_available()
                     else f"calibrate measures a CUDA device, got --device {args.device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        return _fail(f"--device {args.device}: this host has {torch.cuda.device_count()} CUDA devices")
    torch.cuda.set_device(device)
    profile, report = calibrate(device)
    path = save_profile(profile, args.out or profile_path(profile.name), provenance=report)
    print(f"wrote the profile of {profile.name} to {path}: {profile.bandwidth / 1e12:.2f} TB/s, "
          f"{profile.num_sms} SMs, memory rates x{report['fit']['memory_scale']:.3f}, "
          f"compute rates x{report['fit']['compute_scale']:.3f} (rms log error "
          f"{report['fit']['rms_log_error_before']:.3f} -> {report['fit']['rms_log_error_after']:.3f})")
    return 0


def cross_validate_command(args) -> int:
    """``treeattn calibrate --cross-validate``: print (and with ``--out`` write) the report of
    :func:`~treeattn.plan.select.crossval.cross_validate`."""
    from treeattn.plan.select.crossval import cross_validate, timed_cases
    from treeattn.plan.select.profiles import FITTED_CONSTANTS

    out = prepare_output(args.out, "--out")
    results = []
    for path in args.cross_validate:
        with open(path) as f:
            try:
                results.append(json.load(f))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not JSON ({e})") from None
    report = cross_validate(timed_cases(results), objective=args.objective, names=args.refit or FITTED_CONSTANTS)
    report["results"] = list(args.cross_validate)

    def cell(score: dict) -> str:
        return f"{score['within_5pct']:3d}/{score['cases']:<3d} worst {score['worst']:.3f}x"

    print(f"auto within 5% of the fastest strategy, each family left out (refit: {args.objective}):")
    print(f"{'family':18s} {'as is':>24s} {'refit on the others':>24s}  refit factors != 1")
    for family, r in [*report["families"].items(), ("all", report["all"])]:
        moved = ", ".join(f"{k} x{v:.2f}" for k, v in r.get("fit", {}).get("factors", {}).items() if v != 1.0)
        print(f"{family:18s} {cell(r['as_is']):>24s} {cell(r['refit']):>24s}  {moved}")
    if report["run_choices_differ"]:
        print(f"{len(report['run_choices_differ'])} cases choose otherwise than their run did: the plans changed "
              f"since, so their timings are of other plans")
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {out}")
    return 0


def _fail(message: str) -> int:
    print(f"treeattn calibrate: error: {message}", file=sys.stderr)
    return 2


def calibrate(device: torch.device) -> tuple:
    """The fitted profile of CUDA ``device`` (the current device) and its provenance: device,
    library versions, date, the measured bandwidth and launch floor, each case's time and the
    fit's report."""
    from treeattn.bench.timing import copy_bandwidth, provenance
    from treeattn.plan.select.profiles import H200, builtin_profile, device_facts, fit_rates

    base = dataclasses.replace(builtin_profile(device_facts(device)), bandwidth=copy_bandwidth())
    cases, timed = [], []
    for spec, hq, hkv, strategy, h200_us in CASES:
        measured, model = _time_case(spec, hq, hkv, strategy, base)
        at_h200 = model(H200)

        def predict(profile, model=model, at_h200=at_h200, ref=h200_us * 1e-6):
            return ref * model(profile) / at_h200
        cases.append((measured, predict))
        timed.append({"tree": spec, "heads": f"{hq}/{hkv}", "strategy": strategy, "measured_us": measured * 1e6,
                      "predicted_us": predict(base) * 1e6})
    profile, fit = fit_rates(base, cases)
    for row, (_, predict) in zip(timed, cases):
        row["fitted_us"] = predict(profile) * 1e6
    report = {**provenance(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "copy_bandwidth": base.bandwidth, "launch_floor_s": _launch_floor(), "cases": timed, "fit": fit}
    return profile, report


def _time_case(spec: str, hq: int, hkv: int, strategy: str, base) -> tuple:
    """Graph-replay seconds of one fp16 plan of ``spec`` (page size 1) at ``hq``/``hkv`` heads
    (head_dim 128) in the wrapper's default launch mode, and ``predict(profile)``: the cost model's
    seconds for the same work items under another profile."""
    from treeattn import TreeAttention
    from treeattn.bench.timing import capture
    from treeattn.plan import PLANNERS, HeadConfig, make_plan
    from treeattn.plan.select.estimate import estimate_items
    from treeattn.tree import tree_from_spec

    tree = tree_from_spec(spec)
    heads = HeadConfig(hq, hkv, 128, torch.float16)
    wrapper = TreeAttention(device="cuda")
    cost = dataclasses.replace(wrapper.cost, profile=base)
    items, _ = PLANNERS[strategy](tree, heads, cost)  # (what make_plan builds the plan of)
    plan = make_plan(tree, heads, strategy=strategy, device="cuda", cost=cost)
    # a wrapper whose workspace holds the plan's partial results (plan() would size it; make_plan does not)
    wrapper = TreeAttention(torch.empty(max(plan.workspace_bytes() // 4, 1), dtype=torch.float32, device="cuda"),
                            device="cuda")
    q = torch.randn(tree.num_queries, hq, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(tree.num_tokens, 1, hkv, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    out = torch.empty_like(q)
    graph = capture(wrapper, plan, q, k, v, out)
    seconds = triton.testing.do_bench(graph.replay, return_mode="median") * 1e-3

    def predict(profile) -> float:
        return estimate_items(tree, items, heads, dataclasses.replace(cost, profile=profile))["total"]

    return seconds, predict


@triton.jit
def _empty_kernel(x):
    tl.debug_barrier()


def _launch_floor(launches: int = 100) -> float:
    """Seconds an empty kernel takes a launch, replayed in a CUDA graph of ``launches`` of them
    (no host overhead: the GPU's own floor between dependent kernels)."""
    from treeattn.bench.timing import capture_graph

    x = torch.empty(1, device="cuda")

    def launch_all():
        for _ in range(launches):
            _empty_kernel[(1,)](x)

    graph = capture_graph(launch_all)
    return triton.testing.do_bench(graph.replay, return_mode="median") * 1e-3 / launches
