"""Device profiles: what the cost model and the lowering rules know of a GPU.

A :class:`DeviceProfile` holds the device's facts (SM count, shared memory, L2, HBM bandwidth)
and every constant fitted or measured on it that :class:`~treeattn.plan.select.cost.CostModel`
rates plans with or that decides how a plan is lowered (the lowering rules' tiles and
thresholds, persistent launches, the fold of the merge into the last launch). :func:`profile_for`
picks one for a device: a user profile written by ``treeattn calibrate``, else a built-in one,
else an approximation. Without a GPU it is :data:`H200`, so plans made on a CPU are those the
H200 runs.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["DeviceProfile", "H100", "H200", "BUILTIN_PROFILES", "FITTED_CONSTANTS", "builtin_profile", "device_facts",
           "fit_constants", "fit_rates", "load_profile", "profile_for", "profile_path", "save_profile", "scale_rates"]


@dataclass(frozen=True)
class DeviceProfile:
    """One device's facts and fitted constants (defaults: an NVIDIA H200, measured there).

    The rate constants were fitted on CUDA-graph latencies of every strategy over the 96
    kernel-suite cases and every ``paths`` variant of them, measured on an H200; the thresholds
    were each set by A/B timings of the plans they choose between, on an H200 unless noted.
    They only steer choices: every profile gives correct plans.
    """

    #: the device's name as CUDA reports it (``torch.cuda.get_device_properties(d).name``)
    name: str = "NVIDIA H200"
    # -- device facts
    num_sms: int = 132
    #: shared memory one block may opt in to, and the L2 cache, in bytes (as CUDA reports them)
    smem_per_block: int = 232448
    l2_bytes: int = 60 * 2**20
    #: bytes per second the whole GPU streams from HBM (measured copy bandwidth; 4.8e12 nominal)
    bandwidth: float = 4.25e12
    # -- attention kernel rates
    #: KV bytes per second and tile FLOP/s of one program on its own (its gather loop is
    #: latency-bound; a lone program's 4 warps keep only part of the SM busy)
    program_bandwidth: float = 18.3e9
    program_flops: float = 3.09e12
    #: SM time of one program's fixed work (index, query and output round trips)
    program_overhead_s: float = 0.891e-6
    #: KV bytes per second one SM streams when full of programs (shared KV mostly hits L2)
    sm_bandwidth: float = 84.3e9
    #: tile FLOP/s of one SM (QK^T and PV over the padded block_m x block_n tile), and for query
    #: tiles of fewer than 64 rows (Triton issues Hopper's warpgroup MMA from 64 rows; shorter
    #: tiles take the older MMA: with its own rate the refit picked within 5% of the fastest on
    #: 92/96 suite cases instead of 84/96)
    sm_flops: float = 1.97e12
    sm_flops_small: float = 1.545e12
    #: extra cost of a masked KV tile (the tree mask's loads and compares; a masked item's tiles
    #: before its mask starts run unmasked, where the planner knows them: ``WorkItems.mask_lead``)
    mask_cost: float = 0.22
    #: exponent of the soft maximum of a launch's SM time and its longest program
    overlap_exponent: float = 55.8
    #: one kernel launch (CUDA-graph node: ramp-up and tail; the fit puts it at zero, the fixed
    #: and merge terms absorbing it) and one merge step (one partial row on the longest query's
    #: chain, latency-bound)
    launch_overhead_s: float = 0.0
    merge_step_s: float = 0.402e-6
    #: the merge step of few queries' merges, which load a query's rows as one tile
    #: (:func:`~treeattn.plan.lower.merge_config.merge_tiled`), with ``pdl``: merge_step_s less
    #: what the tile saved a row against the row loop in one-call graph replay on an H100
    #: (median 0.11 us over 28 plans of 6-18 rows a query); with PDL back to back, the plans this
    #: rate chooses ran 0.80-0.97x the time of those the row loop's rate chose
    merge_tile_step_s: float = 0.29e-6
    #: what a direct plan (no merge launch) saves beyond the fitted merge term: a merge launch
    #: takes 7-14 us under graph replay even for one query; any value in 6-10 us made the same
    #: choices over the kernel suite. Kept below fixed_overhead_s
    direct_saving_s: float = 6e-6
    #: the same with ``pdl``, where the merge launch and its wait overlap the attention launches:
    #: 1-3 us picked within 5% of the fastest on 90/96 suite cases (worst 1.117x), 6 us on 86/96
    #: (worst 1.255x)
    direct_saving_pdl_s: float = 2e-6
    #: a plan whose longest program takes at least this long on its own runs its launches tallest
    #: query tile first: under graph replay with side streams the first launch's programs are
    #: dispatched first, so a long program of a tall launch queued last ran alone after the others
    tall_first_s: float = 10e-6
    #: the lone-program rates that rule times programs with (those the cost model had when the
    #: rule was measured; the fitted ``program_*`` rates rank plans)
    tall_first_bandwidth: float = 34.5e9
    tall_first_flops: float = 1.61e12
    #: how much faster than the fitted rates a TMA launch over runs of slots moves its tiles'
    #: bytes and does its programs' fixed work (its MMAs run at the fitted rates): 3.0x made the
    #: suite's worst TMA choice 1.15x faster and changed no other suite or Medusa choice
    tma_speedup: float = 3.0
    #: the same for every plan (query and output traffic, graph replay); reported, not choosing
    fixed_overhead_s: float = 7.06e-6
    # -- lowering thresholds
    #: the smallest GQA group whose plans let their last launch merge
    #: (:attr:`~treeattn.plan.format.Plan.merge_last`) rather than launch the merge: the fold was
    #: faster on 15 of 20 suite plans of group 8 and slower on 29 of 36 of groups 1 and 4
    merge_last_min_group: int = 8
    #: a plan's persistent tall launch (:func:`~treeattn.plan.lower.addressing.persistent_tall`)
    #: runs over at most this share of the SMs, gathered or through TMA (a TMA program fills its
    #: SM, a gathered one leaves room for a leaf program), where the leaf launches read this many
    #: KV entries x KV heads or more (256 MB at head_dim 128 in 16 bits)
    persist_share_gathered: float = 0.72
    persist_share_tma: float = 0.5
    persist_min_leaf_entries: int = 1 << 19
    # -- planned KV tiles (block_n, num_warps, num_stages) and grid order
    #: (:func:`~treeattn.plan.lower.build.build_plan`, PAT's tile selector, which the cost model
    #: mirrors) items of more than ``short_item_tokens`` KV tokens take ``tile_long``, the others
    #: ``tile_short``: short items waste less of a small tile, long ones pipeline deeper (measured
    #: over the kernel suite). Heads wider than 128 take ``tile_long_head256`` for long items (a
    #: 64-token tile of their K and V takes 64 KB of shared memory a stage in 16 bits)
    short_item_tokens: int = 48
    tile_short: tuple[int, int, int] = (32, 4, 2)
    tile_long: tuple[int, int, int] = (64, 4, 3)
    tile_long_head256: tuple[int, int, int] = (32, 4, 2)
    #: launches whose items average this many KV tokens or more, each of one query tile, run a
    #: unit's KV heads side by side in the grid (:attr:`~treeattn.plan.format.Launch.heads_inner`:
    #: programs reading the same tokens share DRAM pages; the grid-order sweep's threshold, 1.004 /
    #: 1.001 / 1.004x geomean at 32/32, 32/8, 64/8 heads)
    heads_inner_min_tokens: int = 512
    # -- lowering tiles (block_n, num_warps, num_stages) and thresholds
    #: (:func:`~treeattn.plan.lower.addressing.contig_launches`) unmasked contig launches of the
    #: tallest query tiles over long KV tiles, up to this many waves of programs (the most
    #: measured), take ``tile_tall_contig``: 32-token tiles keep three stages in flight in the
    #: shared memory two 64-token ones fill (1.04-1.29x faster on 45 of the suite's 47 such launches)
    tile_tall_contig: tuple[int, int, int] = (32, 4, 3)
    tall_contig_waves: float = 6.0
    #: (:func:`~treeattn.plan.lower.addressing.tma_launches`) those load K/V through tensor
    #: descriptors at ``tile_tall_tma`` where their units average, for some ``(waves, tokens)``
    #: here, ``tokens`` or more with at most ``waves`` x SMs programs (1.12-1.49x on long units;
    #: the wide tile's pipeline start cost up to 1.2x over short ones). Waves beyond
    #: ``tall_contig_waves`` add nothing: only launches at ``tile_tall_contig`` qualify
    tile_tall_tma: tuple[int, int, int] = (128, 8, 3)
    tma_min_tokens: tuple[tuple[float, int], ...] = ((0.75, 384), (1.0, 1024), (6.0, 2048))
    #: gathered launches of the tallest query tiles over long KV tiles, 16-bit caches: at 64-token
    #: tiles the kernel spills; 32-token tiles in 7 stages 1.043x geomean on an H100
    tile_tall_gathered: tuple[int, int, int] = (32, 4, 7)
    #: gathered launches of tiles of this many rows over long KV tiles, with this many waves of
    #: programs or more, run this many warps a program (1.03-1.12x on the suite's twelve)
    gathered_narrow_rows: int = 32
    gathered_narrow_waves: float = 6.0
    gathered_narrow_warps: int = 2
    #: contig launches of more than three programs a SM keep their planned pipeline depth where
    #: their units average this many tokens or more (else one stage less)
    deep_pipeline_min_tokens: int = 1024
    #: (:func:`~treeattn.plan.lower.addressing.split_tails`) unmasked launches of query tiles of
    #: this many rows or more take the select-free softmax step where no unit ends in a partial KV
    #: tile, or where their units average this many KV tiles or more
    split_tail_rows: int = 64
    split_tail_tiles: int = 32
    #: (:func:`~treeattn.plan.lower.addressing.persistent_tall`) the largest launch of query tiles
    #: of ``persist_rows`` rows or more may run persistent where the shorter tiles' launches read
    #: ``persist_min_leaf_ratio`` times its KV (counted for 128-row tiles) at GQA groups of
    #: ``persist_min_group`` or more; over part of the SMs where it is TMA or they read
    #: ``persist_partition_ratio`` times its KV, else over one program a SM from
    #: ``persist_min_waves`` waves of programs
    persist_rows: int = 64
    persist_min_leaf_ratio: float = 2.0
    persist_partition_ratio: float = 3.5
    persist_min_waves: float = 1.5
    persist_min_group: int = 4
    #: (:func:`~treeattn.plan.lower.addressing.beside_persistent`) beside a persistent gathered
    #: launch, at GQA groups of ``beside_min_group`` or more, contig launches of shorter tiles over
    #: 64-token KV tiles take ``tile_beside`` (1.004-1.026x at 64/8 on an H200)
    tile_beside: tuple[int, int, int] = (32, 4, 3)
    beside_min_group: int = 8

    def long_tile(self, head_dim: int) -> tuple[int, int, int]:
        """The KV tile of long items at ``head_dim``: ``tile_long``, ``tile_long_head256`` for heads
        wider than 128."""
        return self.tile_long if head_dim <= 128 else self.tile_long_head256

    def to_json(self, *, provenance: dict | None = None) -> str:
        """The profile as a JSON object (with a ``provenance`` object where given)."""
        data = dataclasses.asdict(self)
        if provenance:
            data["provenance"] = provenance
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str = "profile") -> DeviceProfile:
        """The profile a :meth:`to_json` text holds. Constants it leaves out keep the H200's
        values; an unknown key or a value of the wrong type or range (a negative number, a tile
        that is not ``[block_n, num_warps, num_stages]`` with powers of two) raises ValueError
        naming ``source``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        data = {k: v for k, v in data.items() if k != "provenance"}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(types))
        if unknown:
            raise ValueError(f"{source}: unknown profile keys {unknown}")
        values = {}
        for key, value in data.items():
            kind = types[key]
            if kind == _TILE:
                values[key] = _tile(value, f"{source}: {key}")
            elif kind == _WAVES_TOKENS:
                values[key] = _waves_tokens(value, f"{source}: {key}")
            else:
                values[key] = _scalar(value, kind, f"{source}: {key}")
        if values.get("num_sms", 1) < 1:
            raise ValueError(f"{source}: num_sms must be >= 1, got {values['num_sms']}")
        return cls(**values)


#: the annotations of tile and (waves, tokens) fields, as ``dataclasses.fields`` gives them
_TILE = "tuple[int, int, int]"
_WAVES_TOKENS = "tuple[tuple[float, int], ...]"


def _scalar(value, kind: str, what: str):
    """A JSON value as a profile field of type ``kind`` (str, int, float >= 0); ValueError naming
    ``what`` otherwise."""
    want = {"str": str, "int": int, "float": (int, float)}[kind]
    if isinstance(value, bool) or not isinstance(value, want):
        raise ValueError(f"{what} must be a {kind}, got {value!r}")
    if kind != "str" and value < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return float(value) if kind == "float" else value


def _tile(value, what: str) -> tuple:
    """A JSON ``[block_n, num_warps, num_stages]`` as a tile: the first two powers of two (the
    kernel's tiles and Triton's warps), block_n 16 or more, stages 1 or more."""
    if not (isinstance(value, list) and len(value) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in value)):
        raise ValueError(f"{what} must be [block_n, num_warps, num_stages] of positive ints, got {value!r}")
    block_n, num_warps, _ = value
    if block_n < 16 or block_n & (block_n - 1) or num_warps & (num_warps - 1):
        raise ValueError(f"{what}: block_n must be a power of two >= 16 and num_warps a power of two, "
                         f"got {value!r}")
    return tuple(value)


def _waves_tokens(value, what: str) -> tuple:
    """A JSON list of ``[waves, tokens]`` pairs (numbers >= 0, tokens an int) as a tuple of pairs."""
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list of [waves, tokens] pairs, got {value!r}")
    out = []
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ValueError(f"{what} must be a list of [waves, tokens] pairs, got {pair!r} in it")
        out.append((_scalar(pair[0], "float", f"{what}'s waves"), _scalar(pair[1], "int", f"{what}'s tokens")))
    return tuple(out)


#: NVIDIA H200 SXM (141 GB): the constants above.
H200 = DeviceProfile()
#: NVIDIA H100 SXM (80 GB). No constant was fitted on it separately: it shares the H200 fit, and
#: only the device facts differ (3.35 TB/s nominal HBM bandwidth, 50 MB of L2).
H100 = DeviceProfile(name="NVIDIA H100 80GB HBM3", bandwidth=3.35e12, l2_bytes=50 * 2**20)
BUILTIN_PROFILES = (H200, H100)

def profile_path(device_name: str) -> Path:
    """Where ``treeattn calibrate`` writes the profile of ``device_name`` by default:
    ``$XDG_CACHE_HOME/treeattn/profiles/<name>.json`` (``~/.cache`` without it), the name's
    characters other than letters, digits, ``.``, ``_`` and ``-`` made ``_``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "treeattn" / "profiles" / (re.sub(r"[^A-Za-z0-9._-]+", "_", device_name) + ".json")


def load_profile(path) -> DeviceProfile:
    """The profile in the JSON file ``path`` (:meth:`DeviceProfile.from_json`); ValueError naming
    the file when it cannot be read or is no profile."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read the device profile {path}: {e.strerror}") from None
    return DeviceProfile.from_json(text, source=str(path))


def save_profile(profile: DeviceProfile, path, *, provenance: dict | None = None) -> Path:
    """Write ``profile`` (with ``provenance``) to the JSON file ``path``, making its folder;
    returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json(provenance=provenance) + "\n")
    return path


def device_facts(device) -> dict:
    """The facts of CUDA ``device`` a profile holds: ``name``, ``num_sms``, ``smem_per_block``
    (shared memory a block may opt in to) and ``l2_bytes``, from
    ``torch.cuda.get_device_properties``."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return dict(name=props.name, num_sms=props.multi_processor_count,
                smem_per_block=props.shared_memory_per_block_optin, l2_bytes=props.L2_cache_size)


def builtin_profile(facts: dict) -> DeviceProfile:
    """The built-in profile of the device named ``facts["name"]`` (:data:`BUILTIN_PROFILES`), else
    the H200's constants; either with the device's own ``facts`` (:func:`device_facts`)."""
    base = next((p for p in BUILTIN_PROFILES if p.name == facts["name"]), H200)
    return dataclasses.replace(base, **facts)


def profile_for(device=None) -> DeviceProfile:
    """The profile that plans for ``device`` are rated with (None: the current CUDA device where
    there is one).

    On a CUDA device, the first of: the file ``$TREEATTN_PROFILE`` names; the device's profile
    that ``treeattn calibrate`` wrote (:func:`profile_path`); the built-in profile of that name
    (:data:`BUILTIN_PROFILES`); else the H200's constants with the device's own SM count, L2 and
    shared memory (an approximation: its rates were not measured there). Elsewhere (CPU, no GPU):
    :data:`H200`, so plans made there are bit for bit those the H200 runs. A profile file that
    cannot be read or holds no profile raises ValueError naming it.
    """
    import torch

    if device is None:
        if not torch.cuda.is_available():
            return H200
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return H200
    facts = device_facts(device)
    chosen = os.environ.get("TREEATTN_PROFILE")
    path = Path(chosen) if chosen else profile_path(facts["name"])
    if chosen or path.is_file():
        return _load_cached(str(path), path.stat().st_mtime_ns if path.is_file() else 0)
    return builtin_profile(facts)


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int) -> DeviceProfile:
    # (keyed by modification time: every CostModel() reads the profile, a rewritten file is read again)
    return load_profile(path)


#: the rates :func:`fit_rates` scales: bytes per second, and FLOP/s
MEMORY_RATES = ("program_bandwidth", "sm_bandwidth", "tall_first_bandwidth")
COMPUTE_RATES = ("program_flops", "sm_flops", "sm_flops_small", "tall_first_flops")


def scale_rates(profile: DeviceProfile, memory: float, compute: float) -> DeviceProfile:
    """``profile`` with its :data:`MEMORY_RATES` times ``memory`` and :data:`COMPUTE_RATES` times
    ``compute``."""
    return dataclasses.replace(profile, **{k: getattr(profile, k) * memory for k in MEMORY_RATES},
                               **{k: getattr(profile, k) * compute for k in COMPUTE_RATES})


def fit_rates(profile: DeviceProfile, cases: list, *, span: float = 4.0) -> tuple[DeviceProfile, dict]:
    """``profile`` with its memory and compute rates scaled (:func:`scale_rates`, each by a factor
    within ``1 / span`` to ``span``) to best predict measured latencies, and the fit's report.

    ``cases``: ``(measured_s, predict)`` pairs, ``predict(profile)`` giving the model's seconds
    for that case under a profile. The factors minimise the squared log error of the predictions,
    found on a log grid refined three times around its best point (the model is not linear in
    the rates: a launch's time is a soft maximum of its SM time and its longest program). Raises
    ValueError for no cases or a measured time that is not positive.
    """
    if not cases:
        raise ValueError("fit_rates needs at least one measured case")
    measured = np.array([m for m, _ in cases], dtype=np.float64)
    if not np.all(np.isfinite(measured) & (measured > 0)):
        raise ValueError(f"measured times must be positive seconds, got {measured.tolist()}")

    def error(log_mem: float, log_comp: float) -> float:
        p = scale_rates(profile, float(np.exp(log_mem)), float(np.exp(log_comp)))
        predicted = np.array([predict(p) for _, predict in cases], dtype=np.float64)
        return float(np.sum((np.log(predicted) - np.log(measured)) ** 2))

    center, half = (0.0, 0.0), float(np.log(span))
    for _ in range(4):
        grid = np.linspace(-half, half, 9)
        best = min((error(center[0] + a, center[1] + b), center[0] + a, center[1] + b)
                   for a in grid for b in grid)
        center, half = best[1:], half / 4
    memory, compute = (float(np.exp(x)) for x in center)
    before = error(0.0, 0.0)
    return scale_rates(profile, memory, compute), {
        "memory_scale": memory, "compute_scale": compute, "cases": len(cases),
        "rms_log_error_before": float(np.sqrt(before / len(cases))),
        "rms_log_error_after": float(np.sqrt(best[0] / len(cases)))}


#: the constants fitted to measured latencies of every strategy (the others were set by A/B timings
#: of the plans they choose between); :func:`fit_constants` refits these by default
FITTED_CONSTANTS = ("program_bandwidth", "program_flops", "program_overhead_s", "sm_bandwidth", "sm_flops",
                    "sm_flops_small", "mask_cost", "merge_step_s", "fixed_overhead_s")


def fit_constants(profile: DeviceProfile, loss, names=FITTED_CONSTANTS, *, span: float = 4.0, rounds: int = 2,
                  points: int = 7) -> tuple[DeviceProfile, dict]:
    """``profile`` with each constant of ``names`` multiplied by a factor within ``1 / span`` to
    ``span`` to minimise ``loss(profile)`` (a float), and the fit's report: the factors and the
    loss before and after.

    Coordinate descent: each round tries every constant in turn at ``points`` factors on a log
    grid around its current one, keeping a factor only where the loss drops (so a loss flat in
    a constant leaves it as it was), and the next round's grid is half as wide. No gradient is
    needed: the cost model is not smooth in its constants (a launch's time is a soft maximum, a
    choice among plans a step).

    Raises
    ------
    ValueError
        For a name that is not a positive float constant of the profile (a factor cannot move a
        zero).
    """
    floats = {f.name for f in dataclasses.fields(DeviceProfile) if f.type == "float"}
    bad = [n for n in names if n not in floats or not getattr(profile, n) > 0]
    if bad:
        raise ValueError(f"cannot fit {bad}: fitted names must be positive float constants of the profile, "
                         f"e.g. {list(FITTED_CONSTANTS)}")
    names = list(names)

    def scaled(logf) -> DeviceProfile:
        return dataclasses.replace(profile, **{n: getattr(profile, n) * float(np.exp(f)) for n, f in zip(names, logf)})

    logf = np.zeros(len(names))
    before = best = float(loss(profile))
    half = limit = float(np.log(span))
    for _ in range(rounds):
        for i in range(len(names)):
            center = logf[i]
            for step in np.linspace(-half, half, points):
                if step == 0.0:
                    continue  # (the current factor: its loss is ``best``)
                trial = logf.copy()
                trial[i] = np.clip(center + step, -limit, limit)
                e = float(loss(scaled(trial)))
                if e < best:
                    best, logf = e, trial
        half /= 2
    return scaled(logf), {"factors": {n: float(np.exp(f)) for n, f in zip(names, logf)},
                          "loss_before": before, "loss_after": best}
