"""``treeattn bench workloads``: the tree workloads users run, end to end on one model.

Per workload (beam search, n-sampling over one prompt, groups of prompts x samples, and any
workload of :data:`treeattn.engine.workloads.WORKLOADS` given by name) and per strategy
(``auto`` and ``sequence`` by default), three runs of the same decode:

* **wall**: steps back to back, as a user runs them; ``wall_ms`` is the host clock from a
  synchronised step ``warmup`` to the end of decoding, over the steps in between. The same run
  counts the host synchronisations PyTorch reports inside the loop
  (``torch.cuda.set_sync_debug_mode("warn")``): ``syncs`` should be 0.
* **gpu**: a few *isolated* steps, each issued behind a GPU sleep long enough for the host to
  enqueue the whole step first; CUDA events around it give its pure GPU time, ``gpu_ms``.
* the **floor** of a step: the bytes a step must move (the model's weights, the unique KV tokens
  the step's queries see, the float32 logits) at the copy bandwidth measured in the same run.

transformers' ``generate`` runs the same shapes (same model config, same prompt lengths and new
tokens, no EOS) for beam search and sampling; its ms/step is the wall time over new tokens.
Engines are created once per strategy (every kernel variant compiled then: ``compile_s``), and
the first workload is run twice to report the first run against the second.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from treeattn.bench.e2e import _sleep_cycles
from treeattn.engine.beam import BeamSearchController
from treeattn.engine.controller import SamplingController
from treeattn.engine.sampling import Sampler
from treeattn.engine.workloads import WORKLOADS, WorkloadSpec, build_workload, random_prompt

__all__ = ["Workload", "DEFAULT_WORKLOADS", "parse_workload", "bench_workloads", "plot_workloads"]


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: ``kind`` beam | sample | registry (``registry``: a :data:`WORKLOADS`
    name, built by :func:`build_workload` with ``extra`` as :class:`WorkloadSpec` fields)."""

    name: str
    kind: str
    prompt_len: int = 1500
    prompts: int = 1
    n: int = 1
    new_tokens: int = 64
    extra: dict = field(default_factory=dict)
    registry: str | None = None

    def controller(self, vocab: int, seed: int = 0):
        prompts = [random_prompt(self.prompt_len, vocab, seed + i) for i in range(self.prompts)]
        if self.kind == "beam":
            return BeamSearchController(prompts[0], num_beams=self.n, max_new_tokens=self.new_tokens)
        if self.kind == "sample":
            return SamplingController(prompts, n=self.n, max_new_tokens=self.new_tokens,
                                      sampler=Sampler(temperature=1.0, seed=seed))
        spec = WorkloadSpec(self.registry or self.name, vocab_size=vocab, seed=seed, **self.extra)
        return build_workload(spec)[0]

    def hf_args(self) -> dict | None:
        """transformers ``generate`` arguments of the same decode, or None."""
        if self.kind == "beam":
            return dict(num_beams=self.n, do_sample=False, early_stopping=False)
        if self.kind == "sample":
            return dict(do_sample=True, num_return_sequences=self.n, top_k=0, top_p=1.0)
        return None


def parse_workload(text: str, *, prompt_len: int | None = None, new_tokens: int | None = None) -> Workload:
    """``beam-K``, ``sample-N`` (one prompt), ``group-PxN`` (P prompts x N samples),
    ``rollout-PxN`` (RL group rollouts ending by EOS at log-normal lengths, pruned as they finish),
    ``best-of-N`` (the best half by running log-probability kept every 16 steps), or a registry
    name (:data:`WORKLOADS`)."""
    kw = {k: v for k, v in (("prompt_len", prompt_len), ("new_tokens", new_tokens)) if v is not None}
    try:
        if text.startswith("rollout-"):
            p, n = text[8:].split("x")
            wl = Workload(text, "registry", prompts=int(p), n=int(n), **({"new_tokens": 128} | kw))
            return replace(wl, registry="rollout", extra=dict(
                num_prompts=wl.prompts, n=wl.n, prompt_len=wl.prompt_len, max_new_tokens=wl.new_tokens))
        if text.startswith("best-of-"):
            wl = Workload(text, "registry", n=int(text[8:]), **({"new_tokens": 128} | kw))
            return replace(wl, registry="best-of-n", extra=dict(
                n=wl.n, prompt_len=wl.prompt_len, max_new_tokens=wl.new_tokens, keep_every=16))
        if text.startswith("beam-"):
            return Workload(text, "beam", n=int(text[5:]), **({"prompt_len": 2000} | kw))
        if text.startswith("sample-"):
            return Workload(text, "sample", n=int(text[7:]), **kw)
        if text.startswith("group-"):
            p, n = text[6:].split("x")
            return Workload(text, "sample", prompts=int(p), n=int(n), **kw)
    except ValueError:
        raise ValueError(f"bad workload {text!r}: expected beam-K, sample-N, group-PxN, rollout-PxN or "
                         "best-of-N") from None
    if text in WORKLOADS:
        extra = {"prompt_len": prompt_len} if prompt_len is not None else {}
        if new_tokens is not None:
            extra["max_new_tokens"] = new_tokens
        return Workload(text, "registry", extra=extra)
    raise ValueError(f"unknown workload {text!r}: expected beam-K, sample-N, group-PxN, rollout-PxN, best-of-N "
                     f"or one of {WORKLOADS}")


DEFAULT_WORKLOADS = ("beam-4", "beam-8", "beam-16", "sample-16", "sample-64", "group-8x16", "rollout-8x16",
                     "best-of-16")


class _SyncCounter:
    """Counts the synchronisations ``torch.cuda.set_sync_debug_mode("warn")`` reports while on."""

    def __init__(self):
        self.count, self.sites = 0, {}
        self._ctx = None

    def on(self):
        self._ctx = warnings.catch_warnings(record=True)
        self._log = self._ctx.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def off(self):
        if self._ctx is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        for w in self._log:
            if "synchroniz" in str(w.message):
                self.count += 1
                site = f"{w.filename}:{w.lineno}"
                self.sites[site] = self.sites.get(site, 0) + 1
        self._ctx.__exit__(None, None, None)
        self._ctx = None


class _Stop:
    """Wraps a controller so that its ``result`` runs outside the measured loop."""

    def __init__(self, ctl, before_result):
        self.ctl, self.before_result = ctl, before_result

    def __getattr__(self, name):
        return getattr(self.ctl, name)

    def start(self, engine):
        return self.ctl.start(engine)

    def step(self, engine, step):
        return self.ctl.step(engine, step)

    def result(self, engine):
        self.before_result()
        return self.ctl.result(engine)


def _kv_bytes_per_token(engine) -> int:
    c = engine.model.config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.finfo(engine.model.dtype).bits // 8


def _weight_bytes(model) -> int:
    return int(model.config.num_parameters()) * torch.finfo(model.dtype).bits // 8


def _run_wall(engine, wl: Workload, warmup: int) -> dict:
    """Back-to-back steps; the wall clock from a synchronised step ``warmup`` to the end."""
    engine.reset()
    sync = _SyncCounter()
    mark = {}

    def on_step(step, stats):
        if step == warmup:
            torch.cuda.synchronize()
            mark["t0"], mark["steps0"] = time.perf_counter(), len(engine.stats)
            sync.on()

    def before_result():
        sync.off()
        torch.cuda.synchronize()
        mark["t1"], mark["steps1"] = time.perf_counter(), len(engine.stats)

    t = time.perf_counter()
    engine.run(_Stop(wl.controller(engine.model.config.vocab_size), before_result), on_step=on_step)
    total = time.perf_counter() - t
    steps = mark.get("steps1", 0) - mark.get("steps0", 0)
    stats = engine.stats[mark.get("steps0", 0): mark.get("steps1", 0)]
    return {"wall_ms": (mark["t1"] - mark["t0"]) * 1e3 / max(steps, 1) if steps else math.nan,
            "steps": steps, "run_s": total, "syncs": sync.count, "sync_sites": sync.sites,
            "queries": float(np.mean([s.queries for s in stats])) if stats else 0.0,
            "unique_tokens": float(np.mean([s.unique_tokens for s in stats])) if stats else 0.0,
            "visible_tokens": float(np.mean([s.visible_tokens for s in stats])) if stats else 0.0,
            "plan_ms": float(np.mean([s.plan_ms for s in stats])) if stats else 0.0,
            "strategies": sorted({s.strategy for s in stats})}


def _run_isolated(engine, wl: Workload, probes: set, cycles: int) -> list:
    """GPU milliseconds of steps ``probes``, each run alone behind a GPU sleep."""
    engine.reset()
    out, pending = [], {}

    def on_step(step, stats):
        if step in pending:
            b = torch.cuda.Event(enable_timing=True)
            b.record()
            pending[step] = (pending[step], b)
        if step + 1 in probes:
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            a = torch.cuda.Event(enable_timing=True)
            a.record()
            pending[step + 1] = a

    engine.run(wl.controller(engine.model.config.vocab_size), on_step=on_step)
    torch.cuda.synchronize()
    for v in pending.values():
        if isinstance(v, tuple):
            out.append(v[0].elapsed_time(v[1]))
    return out


def _hf_model(config, device, dtype):
    import transformers

    if config.arch != "llama":
        raise ValueError(f"the transformers comparison builds Llama models; got {config.arch!r}")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, rope_scaling=config.rope_scaling,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=0)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(hf_cfg).to(dtype).eval()
    return hf


def _run_hf(hf, wl: Workload, vocab: int, device) -> dict:
    args = wl.hf_args()
    prompts = torch.tensor([random_prompt(wl.prompt_len, vocab, i) for i in range(wl.prompts)], device=device)
    kw = dict(max_new_tokens=wl.new_tokens, pad_token_id=0, **args)   # (no EOS: every run is full length)
    with torch.no_grad():
        hf.generate(prompts, **(kw | dict(max_new_tokens=2)))     # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(prompts, **kw)
        torch.cuda.synchronize()
    s = time.perf_counter() - t
    return {"run_s": s, "ms_per_step": s * 1e3 / wl.new_tokens}


def bench_workloads(model, workloads, strategies=("auto", "sequence"), *, transformers_baseline: bool = True,
                    warmup: int = 4, probes: int = 6, kv_tokens: int = 1 << 17, page_size: int = 16,
                    progress=None) -> dict:
    """Run :func:`bench_workloads`' measurements (module docstring) on a CUDA ``model``.

    Parameters
    ----------
    model : TreeModel
        On a CUDA device.
    workloads : sequence of Workload
    strategies : sequence of str
    transformers_baseline : bool
        Also time transformers' ``generate`` on beam and sampling workloads.
    progress : callable ``(message)``, optional

    Returns
    -------
    dict: provenance, copy bandwidth, per strategy the engine's compile time and first/second run,
    and per workload and strategy the measurements.
    """
    from treeattn.bench.timing import copy_bandwidth, provenance
    from treeattn.engine.engine import TreeEngine

    if model.device.type != "cuda":
        raise ValueError("bench workloads needs a model on a CUDA device")
    say = progress or (lambda msg: None)
    bw = copy_bandwidth()
    cycles = _sleep_cycles(model.device, 40.0)
    weights = _weight_bytes(model)
    vocab = model.config.vocab_size
    result = {"provenance": provenance(), "copy_bandwidth": bw, "weight_bytes": weights,
              "model": {"arch": model.config.arch, "layers": model.config.num_layers,
                        "heads": f"{model.config.num_heads}/{model.config.num_kv_heads}",
                        "dtype": str(model.dtype).replace("torch.", "")},
              "engines": {}, "workloads": {}}
    for strategy in strategies:
        say(f"engine {strategy}: compiling kernels")
        t = time.perf_counter()
        engine = TreeEngine(model, strategy=strategy, kv_tokens=kv_tokens, page_size=page_size)
        compile_s = time.perf_counter() - t
        first = second = None
        for i, wl in enumerate(workloads):
            say(f"{wl.name} / {strategy}")
            row = _run_wall(engine, wl, warmup)
            if i == 0:
                first = row["run_s"]
                row = _run_wall(engine, wl, warmup)
                second = row["run_s"]
            n_steps = row["steps"] + warmup
            picks = set(np.linspace(warmup + 1, max(warmup + 1, n_steps - 2), probes).astype(int).tolist())
            gpu = _run_isolated(engine, wl, picks, cycles)
            row["gpu_ms"] = float(np.median(gpu)) if gpu else math.nan
            row["gpu_ms_all"] = gpu
            floor_bytes = weights + row["unique_tokens"] * _kv_bytes_per_token(engine) + row["queries"] * vocab * 4
            row["floor_ms"] = floor_bytes / bw * 1e3
            row["wall_over_gpu"] = row["wall_ms"] / row["gpu_ms"]
            row["gpu_over_floor"] = row["gpu_ms"] / row["floor_ms"]
            result["workloads"].setdefault(wl.name, {"spec": {"prompt_len": wl.prompt_len, "prompts": wl.prompts,
                                                              "n": wl.n, "new_tokens": wl.new_tokens}})[strategy] = row
        result["engines"][strategy] = {"compile_s": compile_s, "first_run_s": first, "second_run_s": second}
        del engine
        torch.cuda.empty_cache()
    if transformers_baseline:
        say("transformers: building the model")
        hf = _hf_model(model.config, model.device, model.dtype)
        for wl in workloads:
            if wl.hf_args() is not None:
                say(f"{wl.name} / transformers")
                result["workloads"][wl.name]["transformers"] = _run_hf(hf, wl, vocab, model.device)
        del hf
        torch.cuda.empty_cache()
    for name, rows in result["workloads"].items():
        if "auto" in rows and "sequence" in rows:
            rows["auto_over_sequence"] = rows["sequence"]["wall_ms"] / rows["auto"]["wall_ms"]
        if "auto" in rows and "transformers" in rows:
            rows["auto_over_transformers"] = rows["transformers"]["ms_per_step"] / rows["auto"]["wall_ms"]
    return result


def plot_workloads(result: dict, path) -> None:
    """Bar chart: ms/step per workload (wall and GPU per strategy, transformers, the floor)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    series = []
    for s in ("auto", "sequence"):
        series.append((f"{s} wall", [result["workloads"][n].get(s, {}).get("wall_ms", np.nan) for n in names]))
        series.append((f"{s} GPU", [result["workloads"][n].get(s, {}).get("gpu_ms", np.nan) for n in names]))
    series.append(("transformers", [result["workloads"][n].get("transformers", {}).get("ms_per_step", np.nan)
                                    for n in names]))
    floor = [result["workloads"][n].get("auto", {}).get("floor_ms", np.nan) for n in names]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4.5))
    w = 0.8 / len(series)
    x = np.arange(len(names))
    for i, (label, ys) in enumerate(series):
        ax.bar(x + i * w - 0.4 + w / 2, ys, w, label=label)
    ax.scatter(x, floor, marker="_", s=800, color="black", label="floor (bytes / copy bandwidth)", zorder=3)
    ax.set_xticks(x, names)
    ax.set_ylabel("ms per decode step")
    ax.set_yscale("log")
    p = result["provenance"]
    ax.set_title(f"{p['device']}, {result['model']['arch']} {result['model']['layers']} layers "
                 f"{result['model']['dtype']}, commit {p['commit']}", fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
