"""Host cost of an eager ``TreeAttention.run()``: the whole call against its Triton launches, and a
launch through ``kernel[grid](...)`` against the compiled kernel's own launcher called with the
same arguments (the floor a cached launch could reach).

The GPU is kept busy by a long sleep, so only host time is measured. Writes JSON.

    python benchmarks/probe_launch.py [--heads 32/8] [--out launch.json]
"""
from __future__ import annotations

import argparse
import json


from treeattn.bench.kernels import case_inputs, case_run
from treeattn.bench.timing import host_profile, host_us, provenance
from treeattn.kernels.attention import _tree_partial_attention_kernel
from treeattn.kernels.merge import _merge_states_kernel
from treeattn.workloads import tree_from_spec

CASES = ["1,256_256,32", "1,16,64_1024,256,32", "1,2,4,8,16,32,64,128,1024_16,16,16,16,16,16,16,16,16"]


class Spy:
    """Records the arguments of a compiled kernel's launcher (``CompiledKernel.run``)."""

    def __init__(self):
        self.calls = []

    def wrap(self, compiled):
        real = compiled.__dict__.setdefault("_real_run", compiled.run)  # (a property: made on first use)

        def run(*args):
            self.calls.append((compiled, real, args))
            return real(*args)
        compiled._run = run


class JitSpy:
    """Records the arguments of ``JITFunction.run`` (what ``kernel[grid](...)`` calls)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []
        self.real = fn.__dict__.setdefault("_real_jit_run", fn.run)

    def __enter__(self):
        def run(*args, **kwargs):
            self.calls.append((args, kwargs))
            return self.real(*args, **kwargs)
        self.fn.run = run
        return self

    def __exit__(self, *exc):
        self.fn.run = self.real


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    res = {**provenance(), "rows": []}
    for spec in CASES:
        tree = tree_from_spec(spec)
        inputs = case_inputs(tree, hq, hkv)
        for streams in (True, False):
            _, plan, run = case_run(tree, hq, hkv, inputs, streams=3 if streams else 0)
            for _ in range(5):
                run()
            whole = host_us(run, 200)
            # every compiled kernel run() launched, with the arguments it was given
            spy = Spy()
            for fn in (_tree_partial_attention_kernel, _merge_states_kernel):
                for cache in fn.device_caches.values():
                    for compiled in cache[0].values():
                        spy.wrap(compiled)
            run()
            calls = list(spy.calls)
            launcher_only = host_us(lambda: [real(*a) for _, real, a in calls], 200)
            jit_calls = []
            for fn in (_tree_partial_attention_kernel, _merge_states_kernel):
                with JitSpy(fn) as js:
                    run()
                jit_calls += [(js.real, a, kw) for a, kw in js.calls]
            jit_only = host_us(lambda: [real(*a, **kw) for real, a, kw in jit_calls], 200)
            profile = host_profile(run, 100, 16)
            row = {"tree": spec, "hq": hq, "hkv": hkv, "strategy": plan.strategy, "streams": streams,
                   "launches": len(calls), "run_host_us": whole, "launchers_only_us": launcher_only,
                   "jit_runs_only_us": jit_only,
                   "profile": profile[-26:]}
            res["rows"].append(row)
            print(f"{spec[:32]:32s} {plan.strategy:8s} streams {streams!s:5s} launches {len(calls)} "
                  f"run() {whole:6.1f} us, its kernel[grid] calls alone {jit_only:6.1f} us, their launchers alone "
                  f"{launcher_only:6.1f} us", flush=True)
    print("\n".join(res["rows"][0]["profile"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
