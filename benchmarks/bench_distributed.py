"""Multi-GPU decode benchmark: Tree Attention vs Ring Attention vs one GPU (issue 5).

For each total context length and query count (queries sharing one context), the context's KV is
split into contiguous per-rank slices and every method computes the same decode attention:

* ``tree``: :class:`treeattn.distributed.ShardedAttention` ("tree"): local treeattn kernels, one max
  all-reduce and one packed fp32 sum all-reduce (the paper's Alg. 3);
* ``ring``: the same wrapper with "ring": KV shards passed around the ring, online softmax;
* ``single``: rank 0 alone runs :class:`treeattn.TreeAttention` over the whole context.

Reported per case: median latency (CUDA events per iteration; for the sharded methods the maximum
over ranks of each rank's median; ``--graphs`` methods, by default tree and single, are timed as a
CUDA-graph replay of the whole call, collectives included, as a decode loop runs them, and keep
their eager time as ``latency_ms_eager``), bytes communicated (recorded from the collectives issued:
:class:`treeattn.distributed.CommStats`) against eqs. 10 and 14, peak memory
(``torch.cuda.max_memory_allocated`` during one call, plus the resident KV and queries) against
eqs. 8 and 9, and the error of tree / ring against the single-GPU output. Writes JSON (``--out``,
rewritten after every case) and a PNG (``--plot``).

2 GPUs (about 2 minutes on 2 x H200)::

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py \\
        --out benchmarks/results/distributed_h200x2.json --plot benchmarks/results/distributed_h200x2.png

Without torchrun the script spawns ``--world-size`` processes itself. CPU logic check (gloo, fp32,
tiny contexts, torch backend; a few seconds)::

    python benchmarks/bench_distributed.py --cpu-smoke --out /tmp/dist_smoke.json --plot /tmp/dist_smoke.png
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    from treeattn import TreeAttention
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from treeattn import TreeAttention
from treeattn.bench.timing import capture_graph
from treeattn.distributed import (
    CommStats,
    ShardedAttention,
    comm_volume,
    peak_memory,
    plan_sequence_shard,
    run_local,
)

# NVLink SHARP (NVLS) and multicast stay off; set before NCCL initialises, inherited by spawned ranks.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

K = 1024
GPU_CONTEXTS = [128 * K, 256 * K, 512 * K, 1024 * K, 2048 * K, 4096 * K]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default=",".join(str(c) for c in GPU_CONTEXTS),
                    help="total context lengths in tokens (comma-separated; K/M suffixes allowed)")
    ap.add_argument("--batches", default="1,64", help="queries sharing the context")
    ap.add_argument("--heads", default="32/8", help="query heads / KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--methods", default="tree,ring,single")
    ap.add_argument("--strategy", default="auto", help="local planner")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--target-s", type=float, default=0.25, help="timed seconds per measurement")
    ap.add_argument("--min-reps", type=int, default=5)
    ap.add_argument("--max-reps", type=int, default=100)
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="skip the remaining cases once this much time has passed")
    ap.add_argument("--world-size", type=int, default=2, help="processes to spawn without torchrun")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="gloo on CPU, fp32, tiny contexts, torch backend: checks the logic")
    ap.add_argument("--graphs", default="tree,single",
                    help="methods also timed as a CUDA-graph replay (CUDA only; empty: none). Their "
                         "latency is the replay's; the eager time is kept as latency_ms_eager")
    ap.add_argument("--out", default=None, help="JSON path (rank 0 writes it)")
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        if "--contexts" not in (argv if argv is not None else sys.argv):
            args.contexts = "1000,4096"
        if "--batches" not in (argv if argv is not None else sys.argv):
            args.batches = "1,4"
        if "--heads" not in (argv if argv is not None else sys.argv):
            args.heads = "8/2"
        if "--head-dim" not in (argv if argv is not None else sys.argv):
            args.head_dim = 32
        args.dtype = "fp32"
        args.target_s, args.min_reps, args.max_reps, args.warmup = 0.02, 3, 10, 1
    args.context_list = [_tokens(x) for x in args.contexts.split(",") if x]
    args.batch_list = [int(x) for x in args.batches.split(",") if x]
    args.hq, args.hkv = (int(x) for x in args.heads.split("/"))
    args.method_list = [m for m in args.methods.split(",") if m]
    args.graph_list = [] if args.cpu_smoke else [m for m in args.graphs.split(",") if m]
    return args


def _tokens(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": K, "M": K * K}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


# ------------------------------------------------------------------------------------ timing
class Timer:
    """Fixed-count timing that all ranks run in lockstep (the count is agreed by an all-reduce,
    so collectives inside ``fn`` never deadlock)."""

    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _agree_max(self, x: float, collective: bool) -> float:
        if not collective:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def __call__(self, fn, *, collective: bool) -> dict:
        a = self.args
        for _ in range(a.warmup):
            fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        self.sync()
        est = self._agree_max((time.perf_counter() - t0) / 3, collective)
        reps = int(min(a.max_reps, max(a.min_reps, math.ceil(a.target_s / max(est, 1e-7)))))
        if collective:
            dist.barrier()
        times = []
        if self.cuda:
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
            for s, e in ev:
                s.record()
                fn()
                e.record()
            self.sync()
            times = [s.elapsed_time(e) for s, e in ev]
        else:
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        med = statistics.median(times)
        return {"ms": self._agree_max(med, collective), "ms_this_rank": med, "reps": reps,
                "ms_min": min(times)}


def timed(timer: Timer, fn, *, collective: bool, graph: bool) -> dict:
    """``timer(fn)``; with ``graph`` also the replay of a captured ``fn``, which becomes ``ms``
    (the eager median is kept as ``ms_eager``)."""
    eager = timer(fn, collective=collective)
    if not graph:
        return dict(eager, mode="eager")
    g = capture_graph(fn)
    replay = timer(g.replay, collective=collective)
    return dict(replay, mode="cuda_graph", ms_eager=eager["ms"])


def measure_memory(fn, device: torch.device) -> int | None:
    """Bytes allocated on top of what was live before one call of ``fn`` (CUDA only)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------ one case
def shard_bounds(n: int, world: int) -> list[int]:
    return [(r * n) // world for r in range(world + 1)]


def make_inputs(context: int, batch: int, args, rank: int, world: int, device, dtype):
    """Rank 0 draws the whole context's KV and the queries and sends every rank its slice (so the
    shards are consistent by construction). Returns ``(q, k_local, v_local, k_full, v_full)``;
    the full tensors are ``None`` except on rank 0, whose local slice is a view of them."""
    bounds = shard_bounds(context, world)
    n_local = bounds[rank + 1] - bounds[rank]
    hkv, d = args.hkv, args.head_dim
    q = torch.empty((batch, args.hq, d), dtype=dtype, device=device)
    k_full = v_full = None
    if rank == 0:
        g = torch.Generator(device=device).manual_seed(1_000_003 * context + batch)
        q.normal_(generator=g)
        k_full = torch.empty((context, hkv, d), dtype=dtype, device=device).normal_(generator=g)
        v_full = torch.empty((context, hkv, d), dtype=dtype, device=device).normal_(generator=g)
        for r in range(1, world):
            if bounds[r + 1] > bounds[r]:
                dist.send(k_full[bounds[r]:bounds[r + 1]].contiguous(), r)
                dist.send(v_full[bounds[r]:bounds[r + 1]].contiguous(), r)
        k_loc, v_loc = k_full[:n_local], v_full[:n_local]
    else:
        k_loc = torch.empty((n_local, hkv, d), dtype=dtype, device=device)
        v_loc = torch.empty_like(k_loc)
        if n_local:
            dist.recv(k_loc, 0)
            dist.recv(v_loc, 0)
    dist.broadcast(q, src=0)
    return q, k_loc, v_loc, k_full, v_full


def _keep(holder: dict, fn, **kwargs) -> None:
    holder["out"] = fn(**kwargs)


def run_case(context: int, batch: int, args, rank: int, world: int, device, dtype, backend,
             timer: Timer) -> dict:
    bounds = shard_bounds(context, world)
    n_local = bounds[rank + 1] - bounds[rank]
    hq, hkv, d = args.hq, args.hkv, args.head_dim
    elem = torch.empty((), dtype=dtype).element_size()
    q, k_loc, v_loc, k_full, v_full = make_inputs(context, batch, args, rank, world, device, dtype)
    row = {"context": context, "batch": batch, "n_local": [bounds[r + 1] - bounds[r] for r in range(world)],
           "methods": {}}
    outs = {}
    for method in [m for m in args.method_list if m in ("tree", "ring")]:
        sa = ShardedAttention(method, device=device, backend=backend, strategy=args.strategy)
        t_plan = time.perf_counter()
        plan = sa.plan(n_local, num_queries=batch, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                       dtype=dtype)
        t_plan = time.perf_counter() - t_plan
        stats = CommStats()
        call = functools.partial(sa.run, q, k_loc, v_loc, plan)
        holder = {}
        extra = measure_memory(functools.partial(_keep, holder, call, stats=stats), device)
        outs[method] = holder["out"]
        timing = timed(timer, call, collective=True,
                       graph=device.type == "cuda" and method in args.graph_list)
        wire = [0.0] * world
        dist.all_gather_object(wire, {"wire_elements": stats.wire_elements(),
                                      "wire_bytes": stats.wire_bytes(), "recorded": stats.summary(),
                                      "peak_extra_bytes": extra})
        formula = comm_volume(method, world, num_queries=batch, num_qo_heads=hq, num_kv_heads=hkv,
                              head_dim=d, num_tokens=context, kv_bytes=elem)
        if method == "tree":
            measured = wire[0]["wire_elements"]
            expected = formula["per_rank_elements"]  # eq. 14
        else:
            measured = sum(w["wire_elements"] for w in wire)
            expected = formula["total_elements"]  # (p - 1) x eq. 10
        mem_formula = peak_memory(method, world, num_tokens=context, num_queries=batch,
                                  num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, elem_bytes=elem)
        workspace = max([lp.plan.workspace_bytes() for lp in plan.local.values() if lp.plan] or [0])
        resident = nbytes(q) + 2 * max(row["n_local"]) * hkv * d * elem + workspace
        peaks = [w["peak_extra_bytes"] for w in wire]
        # eq. 8 holds one incoming shard; with p >= 3 the overlapped ring double-buffers
        formula_bytes = (mem_formula["ring_double_buffered_elements"] * elem
                         if method == "ring" and world >= 3 else mem_formula["bytes"])
        measured_peak = None if peaks[0] is None else resident + max(peaks)
        local_plan = next(iter(plan.local.values())).plan
        row["methods"][method] = {
            "latency_ms": timing["ms"], "timing_mode": timing["mode"],
            "latency_ms_eager": timing.get("ms_eager", timing["ms"]),
            "latency_ms_per_rank_median": timing["ms_this_rank"],
            "latency_ms_min_rank0": timing["ms_min"], "reps": timing["reps"],
            "plan_s": t_plan, "local_strategy": None if local_plan is None else local_plan.strategy,
            "comm": {"measured_elements": measured, "formula_elements": expected,
                     "ratio": measured / expected if expected else None,
                     "formula": formula, "per_rank": wire},
            "memory": {"measured_peak_bytes": measured_peak, "peak_extra_bytes_per_rank": peaks,
                       "resident_bytes": resident, "formula_bytes": formula_bytes,
                       "ratio": None if measured_peak is None else measured_peak / formula_bytes,
                       "formula": mem_formula},
        }
    if "single" in args.method_list:
        if rank == 0:
            w = TreeAttention(device=device, backend=backend)
            lp = plan_sequence_shard(w, context, num_queries=batch, num_qo_heads=hq, num_kv_heads=hkv,
                                     head_dim=d, dtype=dtype, strategy=args.strategy)
            kc, vc = k_full.unsqueeze(1), v_full.unsqueeze(1)
            call = functools.partial(run_local, w, q, kc, vc, lp)
            holder = {}
            extra = measure_memory(functools.partial(_keep, holder, call), device)
            timing = timed(timer, call, collective=False,
                           graph=device.type == "cuda" and "single" in args.graph_list)
            mem_formula = peak_memory("tree", 1, num_tokens=context, num_queries=batch, num_qo_heads=hq,
                                      num_kv_heads=hkv, head_dim=d, elem_bytes=elem)
            resident = nbytes(q, k_full, v_full) + lp.plan.workspace_bytes()
            single = holder["out"][0]
            row["methods"]["single"] = {
                "latency_ms": timing["ms"], "timing_mode": timing["mode"],
                "latency_ms_eager": timing.get("ms_eager", timing["ms"]),
                "reps": timing["reps"], "latency_ms_min": timing["ms_min"],
                "local_strategy": lp.plan.strategy,
                "memory": {"measured_peak_bytes": None if extra is None else resident + extra,
                           "resident_bytes": resident, "formula_bytes": mem_formula["bytes"]}}
            for m, o in outs.items():
                row["methods"][m]["rel_l2_vs_single"] = rel_l2(o, single)
            del w, lp, kc, vc, single
        dist.barrier()
    lat = {m: r["latency_ms"] for m, r in row["methods"].items()}
    if "tree" in lat and "ring" in lat:
        row["speedup_tree_vs_ring"] = lat["ring"] / lat["tree"]
    if "tree" in lat and "single" in lat:
        row["speedup_tree_vs_single"] = lat["single"] / lat["tree"]
    return row


# ------------------------------------------------------------------------------------ report
def evaluate_targets(rows: list[dict]) -> dict:
    def check(name, rule, keep):
        fails, n = [], 0
        for r in rows:
            if keep(r):
                n += 1
                ok, what = rule(r)
                if not ok:
                    fails.append({"context": r["context"], "batch": r["batch"], "value": what})
        return {"name": name, "cases": n, "pass": (not fails) if n else None, "failures": fails}

    return {
        "tree_vs_ring_2x_from_256K": check(
            "tree >= 2x faster than ring at every context >= 256K",
            lambda r: (r.get("speedup_tree_vs_ring", 0) >= 2.0, r.get("speedup_tree_vs_ring")),
            lambda r: r["context"] >= 256 * K and "speedup_tree_vs_ring" in r),
        "tree_vs_single_1.7x_from_1M": check(
            "sharded tree >= 1.7x faster than one GPU at contexts >= 1M",
            lambda r: (r.get("speedup_tree_vs_single", 0) >= 1.7, r.get("speedup_tree_vs_single")),
            lambda r: r["context"] >= 1024 * K and "speedup_tree_vs_single" in r),
        "tree_volume_within_10pct_of_eq14": check(
            "measured tree volume within 10% of eq. 14",
            lambda r: (abs(r["methods"]["tree"]["comm"]["ratio"] - 1) <= 0.10,
                       r["methods"]["tree"]["comm"]["ratio"]),
            lambda r: "tree" in r["methods"]),
        "peak_memory_within_10pct_of_eqs8_9": check(
            "measured peak memory of tree and ring within 10% of eqs. 9 and 8",
            lambda r: (all(abs(r["methods"][m]["memory"]["ratio"] - 1) <= 0.10
                           for m in ("tree", "ring") if m in r["methods"]),
                       {m: r["methods"][m]["memory"]["ratio"] for m in ("tree", "ring")
                        if m in r["methods"]}),
            lambda r: any(r["methods"][m]["memory"]["ratio"] is not None
                          for m in ("tree", "ring") if m in r["methods"])),
    }


def meta(args, world: int, device, backend: str) -> dict:
    m = {"script": "benchmarks/bench_distributed.py", "world_size": world, "backend": backend,
         "dist_backend": dist.get_backend(), "dtype": args.dtype, "num_qo_heads": args.hq,
         "num_kv_heads": args.hkv, "head_dim": args.head_dim, "strategy": args.strategy,
         "torch": torch.__version__, "triton": _triton_version(), "python": platform.python_version(),
         "commit": os.environ.get("TREEATTN_COMMIT"), "host": socket.gethostname(),
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
         "cpu_smoke": args.cpu_smoke}
    if device.type == "cuda":
        m["device"] = torch.cuda.get_device_name(device)
        m["cuda"] = torch.version.cuda
        try:
            m["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - informational only
            m["nccl"] = None
    else:
        m["device"] = platform.processor() or "cpu"
    return m


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def plot(path: str, doc: dict) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    rows = doc["cases"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches) + 2, figsize=(5 * (len(batches) + 2), 4))
    for ax, b in zip(axes, batches):
        sub = [r for r in rows if r["batch"] == b]
        for m, style in (("tree", "o-"), ("ring", "s--"), ("single", "^:")):
            pts = [(r["context"], r["methods"][m]["latency_ms"]) for r in sub if m in r["methods"]]
            if pts:
                ax.plot(*zip(*pts), style, label=m if m != "single" else "one GPU")
        ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="latency (ms)",
               title=f"{b} quer{'y' if b == 1 else 'ies'}, {doc['meta']['world_size']} ranks")
        ax.legend()
    ax = axes[-2]
    for m, style in (("tree", "o"), ("ring", "s")):
        pts = [(r["context"], r["methods"][m]["comm"]["measured_elements"],
                r["methods"][m]["comm"]["formula_elements"]) for r in rows
               if m in r["methods"] and r["batch"] == batches[-1]]
        if pts:
            x, meas, form = zip(*pts)
            ax.plot(x, meas, style, label=f"{m} measured")
            ax.plot(x, form, "k:", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="elements communicated",
           title=f"volume, {batches[-1]} queries (dotted: eq. 14 / eq. 10)")
    ax.legend()
    ax = axes[-1]
    for m, style in (("tree", "o"), ("ring", "s"), ("single", "^")):
        pts = [(r["context"], r["methods"][m]["memory"]["measured_peak_bytes"],
                r["methods"][m]["memory"]["formula_bytes"]) for r in rows
               if m in r["methods"] and r["batch"] == batches[-1]
               and r["methods"][m]["memory"]["measured_peak_bytes"] is not None]
        if pts:
            x, meas, form = zip(*pts)
            ax.plot(x, [v / 2**30 for v in meas], style, label=f"{m} measured")
            ax.plot(x, [v / 2**30 for v in form], "k:", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="peak GiB per GPU",
           title="peak memory (dotted: eqs. 8 / 9)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "measured on CUDA only", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ------------------------------------------------------------------------------------ driver
def worker(args) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.cpu_smoke:
        device, backend = torch.device("cpu"), "torch"
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --cpu-smoke")
        device, backend = torch.device("cuda", local_rank), "auto"
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=600))
    dtype = DTYPES[args.dtype]
    timer = Timer(args, device)
    doc = {"meta": meta(args, world, device, backend), "cases": [], "skipped": []}
    t0 = time.perf_counter()
    try:
        for context in args.context_list:
            for batch in args.batch_list:
                flag = torch.tensor([1.0 if time.perf_counter() - t0 < args.budget_s else 0.0],
                                    device=device)
                dist.broadcast(flag, src=0)
                if flag.item() == 0.0:
                    doc["skipped"].append({"context": context, "batch": batch, "why": "time budget"})
                    continue
                row = run_case(context, batch, args, rank, world, device, dtype, backend, timer)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if rank == 0:
                    doc["cases"].append(row)
                    doc["meta"]["elapsed_s"] = time.perf_counter() - t0
                    doc["targets"] = evaluate_targets(doc["cases"])
                    lat = {m: round(r["latency_ms"], 4) for m, r in row["methods"].items()}
                    print(f"context {context:>8} batch {batch:>3}: ms {lat}  tree/ring "
                          f"{row.get('speedup_tree_vs_ring', float('nan')):.2f}x  tree/single "
                          f"{row.get('speedup_tree_vs_single', float('nan')):.2f}x", flush=True)
                    if args.out:
                        write_json(args.out, doc)
        if rank == 0:
            for t in doc.get("targets", {}).values():
                verdict = {True: "PASS", False: "MISS", None: "N/A "}[t["pass"]]
                print(f"target {verdict}: {t['name']} ({t['cases']} cases)"
                      + (f" failures {t['failures']}" if t["failures"] else ""), flush=True)
            if args.plot and doc["cases"]:
                why = plot(args.plot, doc)
                doc["meta"]["plot"] = args.plot if why is None else f"not written: {why}"
            if args.out:
                write_json(args.out, doc)
    finally:
        dist.destroy_process_group()


def launch(worker, args, world_size: int) -> None:
    """Run ``worker(args)`` on every rank: in this process under torchrun, else in
    ``world_size`` spawned processes (NCCL multicast off, as :data:`NCCL_ENV` says)."""
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(world_size, port, worker, args), nprocs=world_size)


def _spawned(rank: int, world: int, port: int, worker, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    worker(args)


def main(argv=None) -> int:
    args = parse_args(argv)
    launch(worker, args, args.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
