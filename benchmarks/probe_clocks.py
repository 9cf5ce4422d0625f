"""Do back-to-back decode steps slow down because the GPU lowers its clocks under load?

`bench e2e --steps all` shows each window's first steps after the breakdown steps' GPU sleeps at
~5.4 ms and the following ones climbing to ~6.1 ms within 10-20 steps (ToT sorting, both
strategies), while an isolated step takes 5.5 ms. This probe runs only the decode step's weight
GEMMs (Llama-3-8B shapes, bf16, ``--tokens`` rows, every layer's own weights: 15 GB read a
step), back to back after a GPU sleep, timing each step with CUDA events, while ``nvidia-smi``
logs the SM and memory clocks, the power draw and the active clock-throttle reasons every 50 ms.
Writes JSON (step times per round, the nvidia-smi samples)."""
from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

from treeattn.bench.timing import provenance

#: Llama-3-8B: hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocabulary 128256
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,{reasons}.active"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    weights = [{k: torch.randn(*s, device=dev, dtype=torch.bfloat16) * 0.02 for k, s in SHAPES.items()}
               for _ in range(32)]
    head = torch.randn(4096, 128256, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(args.tokens, 4096, device=dev, dtype=torch.bfloat16)

    def step():
        h = x
        for w in weights:
            h = (h @ w["qkv"])[:, :4096] @ w["o"]
            h = (torch.nn.functional.silu(h @ w["gate_up"])[:, :14336]) @ w["down"]
        return h @ head

    step()
    torch.cuda.synchronize()
    # (newer drivers call the throttle reasons clock event reasons)
    query = next(q for q in (QUERY.format(reasons=r) for r in ("clocks_event_reasons", "clocks_throttle_reasons"))
                 if subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"], capture_output=True).returncode == 0)
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    rounds = []
    try:
        for _ in range(args.rounds):
            torch.cuda._sleep(2_000_000_000)  # ~1 s idle at ~1.9 GHz: the clocks recover
            torch.cuda.synchronize()
            t0 = time.time()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
            events[0].record()
            for i in range(args.steps):
                step()
                events[i + 1].record()
            torch.cuda.synchronize()
            ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
            rounds.append({"start_unix": t0, "end_unix": time.time(), "step_ms": ms})
            print(f"round: first 5 {[round(v, 3) for v in ms[:5]]} last 5 {[round(v, 3) for v in ms[-5:]]}",
                  flush=True)
    finally:
        smi.terminate()
        samples = smi.communicate()[0].strip().splitlines()
    print("\n".join(samples[:: max(1, len(samples) // 40)]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "tokens": args.tokens, "query": query, "rounds": rounds,
                       "nvidia_smi": samples}, f, indent=1)


if __name__ == "__main__":
    main()
