"""Why is `256_4096` slower at 64/8 heads than at 32/8 (one GPU call)?

Both run the same single launch (`sequence`, one 4096-token item per query, 16-row tiles, the
same KV bytes); the compiled kernels differ only in the GROUP constant. This times the plan at
both head configs with the KV caches allocated before or after the queries (and behind a 1 or
3 MiB pad), with zero queries, and with 4 of each 8 heads zero, sampling SM clock and power
with nvidia-smi meanwhile. Writes JSON to $OUT/probe_64_8.json.
"""
import json
import os
import subprocess
import threading
import time

import torch

from treeattn import TreeAttention
from treeattn.bench.timing import graph_us
from treeattn.workloads import tree_from_spec

D = 128


def smi() -> str:
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    tree = tree_from_spec("256_4096")
    res = {}
    for variant in ("kv_first", "q_first", "pad1M", "pad3M", "zeros", "half_heads_zero"):
        for hq in (32, 64):
            torch.cuda.empty_cache()
            q = torch.randn(tree.num_queries, hq, D, device="cuda", dtype=torch.float16) \
                if variant == "q_first" else None
            pad = torch.empty(int(variant[3]) << 20, dtype=torch.uint8, device="cuda") \
                if variant.startswith("pad") else None
            k = torch.randn(tree.num_tokens, 1, 8, D, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            if q is None:
                q = torch.randn(tree.num_queries, hq, D, device="cuda", dtype=torch.float16)
            if variant == "zeros":
                q.zero_()
            if variant == "half_heads_zero":
                q.view(tree.num_queries, 8, hq // 8, D)[:, :, hq // 16:] = 0
            out = torch.empty_like(q)
            w = TreeAttention(device="cuda", streams=3)
            plan = w.plan(tree, num_qo_heads=hq, num_kv_heads=8, head_dim=D)
            samples, stop = [], threading.Event()

            def poll():
                while not stop.is_set():
                    samples.append(smi())
                    time.sleep(0.05)
            th = threading.Thread(target=poll)
            th.start()
            t = graph_us(lambda: w.run(q, k, v, plan, out=out), rep=200)
            stop.set()
            th.join()
            res[f"{variant} {hq}/8"] = {"us": t, "k_offset_2MiB": k.data_ptr() % (2 << 20), "pad": pad is not None,
                                        "smi": samples[len(samples) // 2: len(samples) // 2 + 2]}
            print(f"{variant:16s} {hq}/8 {t:7.1f} us {res[f'{variant} {hq}/8']['smi'][:1]}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "probe_64_8.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
