"""Device timing: copy bandwidth, eager and CUDA-graph latency of ``TreeAttention.run``, and the
provenance every result file carries."""
from __future__ import annotations

import os
import platform
import subprocess
import time

import torch


def provenance() -> dict:
    """Device, library versions and git commit (``TREEATTN_COMMIT`` overrides ``git``)."""
    import triton

    commit = os.environ.get("TREEATTN_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "commit": commit}


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes per second (read + written) of a large device-to-device copy."""
    import triton

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return nbytes / (ms * 1e-3)


def time_run(wrapper, plan, q, k_cache, v_cache, out) -> tuple[float, float]:
    """Median microseconds of ``wrapper.run`` eagerly and as a CUDA-graph replay (L2 flushed
    between runs by ``do_bench``)."""
    import triton

    def run():
        wrapper.run(q, k_cache, v_cache, plan, out=out)

    eager = triton.testing.do_bench(run, return_mode="median") * 1e3
    graph = capture(wrapper, plan, q, k_cache, v_cache, out)
    replay = triton.testing.do_bench(graph.replay, return_mode="median") * 1e3
    return eager, replay


def host_us(fn, n: int = 50, *, sleep_cycles: int = 2_000_000_000) -> float:
    """Microseconds of host time a call of ``fn`` while the GPU sleeps (``sleep_cycles`` clock
    cycles, ~1 s by default: longer than the ``n`` calls take), so the calls only queue. Keep
    ``n`` times the kernels a call launches under CUDA's pending-launch queue (~1000), or the host
    ends up waiting for the GPU."""
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


def host_profile(fn, n: int = 50, top: int = 16) -> list[str]:
    """cProfile of ``n`` calls of ``fn`` while the GPU sleeps: the ``top`` functions by own time,
    as printed lines."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue().splitlines()


def graph_us(fn, *, warmup: int = 10, rep: int = 40) -> float:
    """Median microseconds of a CUDA-graph replay of one call of ``fn`` (``do_bench``, L2
    flushed between replays)."""
    import triton

    fn()
    graph = capture_graph(fn)
    return triton.testing.do_bench(graph.replay, return_mode="median", warmup=warmup, rep=rep) * 1e3


def layer_us(fn, *, calls: int = 8, sweep_bytes: int = 128 << 20) -> float:
    """Microseconds a call of ``fn`` adds to a CUDA graph where it runs ``calls`` times, each time
    after a kernel that writes ``sweep_bytes`` (twice an H200's L2): attention as a decode graph
    runs it, once a layer, after kernels that streamed the layer's weights through L2. The graph
    of sweeps and calls less the graph of the sweeps alone (``do_bench`` medians), over ``calls``;
    a lone call's graph replay adds the graph's own launch, which a decode graph pays once a step."""
    import triton

    buf = torch.empty(sweep_bytes, dtype=torch.uint8, device="cuda")

    def sweeps(with_calls: bool):
        for _ in range(calls):
            buf.zero_()
            if with_calls:
                fn()

    fn()
    both, alone = capture_graph(lambda: sweeps(True)), capture_graph(lambda: sweeps(False))
    t_both = triton.testing.do_bench(both.replay, return_mode="median")
    t_alone = triton.testing.do_bench(alone.replay, return_mode="median")
    return (t_both - t_alone) * 1e3 / calls


def capture(wrapper, plan, q, k_cache, v_cache, out) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one ``run`` into ``out``."""
    return capture_graph(lambda: wrapper.run(q, k_cache, v_cache, plan, out=out))


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of ``fn`` (without autograd), after a warm-up call on the
    capture's side stream. Collectives inside ``fn`` are captured too: every rank captures
    together."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    torch.cuda.synchronize()
    return graph


def roofline_us(tree_tokens: int, requests: int, hq: int, hkv: int, head_dim: int, bandwidth: float,
                elem_bytes: int = 2) -> float:
    """The anchors' roofline: each unique KV token and each query/output row moved once."""
    return (2 * tree_tokens * hkv * head_dim + 2 * requests * hq * head_dim) * elem_bytes / bandwidth * 1e6
