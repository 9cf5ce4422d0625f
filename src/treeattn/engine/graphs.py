"""Piecewise CUDA graphs of the decode forward pass.

Everything between two attention calls (output projection, MLP, the next layer's norm, q/k/v,
RoPE and KV write) has static shapes for a given number of new tokens, so it is captured once per
token-count bucket and replayed; only the tree attention (whose plan changes every step) runs
eagerly between the replays. Rows beyond the real tokens of a bucket are padding: they write their
K/V to a private pad slot and their outputs are ignored.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

__all__ = ["DecodeGraphs", "AttentionGraph", "BUCKETS"]

log = logging.getLogger(__name__)

#: Token counts graphs are captured for; a step of ``n`` tokens uses the smallest bucket >= n.
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 448, 512)


class DecodeGraphs:
    """CUDA-graph runner for :meth:`treeattn.engine.model.TreeModel.decode`.

    Parameters
    ----------
    model : TreeModel
        On a CUDA device.
    kv : KVCacheManager
        Provides the flat caches and the pad slot.
    verify : bool
        Compare the first run of every bucket with the eager pass and fall back to eager
        execution (logging a warning) when they differ.
    layer_counter : int32 [1], optional
        The :class:`AttentionGraph`'s layer counter: each layer's RoPE kernel writes its layer there
        before the layer's attention replays.
    """

    def __init__(self, model, kv, *, verify: bool = True, layer_counter: torch.Tensor | None = None):
        self.model, self.kv, self.verify, self.layer_counter = model, kv, verify, layer_counter
        self.disabled = False
        self.max_diff = 0.0      # largest relative L2 difference graph vs eager seen by check()
        self._graphs: dict[int, list] = {}
        self._checked: set = set()
        self._cap = 0
        self._pool = None
        self._bufs: dict = {}

    @staticmethod
    def bucket(n: int) -> int | None:
        return next((b for b in BUCKETS if b >= n), None)

    @property
    def ready(self) -> set:
        """Buckets captured and checked against eager execution."""
        return {m for m in self._checked if m in self._graphs}

    def supports(self, n: int) -> bool:
        return not self.disabled and self.bucket(n) is not None

    # ------------------------------------------------------------------ capture
    def _alloc(self, m: int) -> None:
        c, dev, dt = self.model.config, self.model.device, self.model.dtype
        self._graphs.clear()
        # a fresh memory pool: capturing into the pool of graphs just destroyed trips the caching
        # allocator (PyTorch's use_count assertion) when a bigger bucket arrives after a smaller one
        self._pool = None
        self._cap = m
        self._bufs = {
            "tok": torch.zeros(m, dtype=torch.int64, device=dev),
            "meta": torch.zeros(2 * m, dtype=torch.int64, device=dev),
            "h": torch.zeros(m, c.hidden_size, dtype=dt, device=dev),
            "q": torch.zeros(m, self.model.num_heads, c.head_dim, dtype=dt, device=dev),
            "o": torch.zeros(m, self.model.num_heads, c.head_dim, dtype=dt, device=dev),
            "logits": torch.zeros(m, c.vocab_size, dtype=torch.float32, device=dev),
        }

    def _segments(self, m: int) -> list:
        b, model, caches = self._bufs, self.model, self.kv.caches
        tok, h, q, o, logits = b["tok"][:m], b["h"][:m], b["q"][:m], b["o"][:m], b["logits"][:m]
        pos, slots = b["meta"][:m], b["meta"][m: 2 * m]
        last, counter = model.config.num_layers - 1, self.layer_counter

        # the pieces write straight into the static buffers (q_out / out), saving two copies a layer
        def first():
            h.copy_(model.embed(tok))
            model.pre_attention(0, h, pos, slots, caches, q_out=q, layer_out=counter)

        def middle(layer):
            def seg():
                model.next_layer(layer, h, o, pos, slots, caches, q_out=q, layer_out=counter)
            return seg

        def final():
            model.logits(model.post_attention(last, h, o), out=logits)

        return [first] + [middle(layer) for layer in range(last)] + [final]

    def _capture(self, m: int) -> list:
        if m > self._cap:
            self._alloc(max(m, min(2 * self._cap, BUCKETS[-1]), 16))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        meta = self._bufs["meta"]
        meta[:m].zero_()
        meta[m: 2 * m].fill_(self.kv.pad_slot)
        segs = self._segments(m)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for f in segs:
                f()
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        with torch.no_grad():
            for f in segs:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool):
                    f()
                graphs.append(g)
        log.debug("captured %d CUDA graphs for %d-token decode steps", len(graphs), m)
        return graphs

    # ------------------------------------------------------------------ replay
    def ensure(self, m: int) -> bool:
        """Capture the graphs of bucket ``m`` unless they exist; False (and graphs disabled) when
        capturing fails."""
        if m in self._graphs and m <= self._cap:
            return True
        try:
            self._graphs[m] = self._capture(m)
            return True
        except Exception as e:  # capture is best effort: eager execution is always correct
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)
            self.disabled = True
            return False

    def run(self, tokens: torch.Tensor, positions: np.ndarray, slots: np.ndarray, attend) -> torch.Tensor:
        """Decode ``n`` tokens; ``attend(layer, q, out)`` writes the attention of ``q [n, Hq, D]``
        into ``out``. Returns float32 logits ``[n, vocab]`` (a fresh tensor). The first run of a
        bucket is checked against the eager pass when ``verify`` is set."""
        m = self.bucket(tokens.numel())
        if m not in self._checked and self.verify:
            return self.check(tokens, positions, slots, attend)
        if not self.ensure(m):
            return self._eager(tokens, positions, slots, attend)
        return self._replay(m, tokens, positions, slots, attend)

    def check(self, tokens, positions, slots, attend) -> torch.Tensor:
        """Run the step eagerly and with the graphs (both write the same K/V); keep the graphs only
        when their logits match. Returns the eager logits."""
        m = self.bucket(tokens.numel())
        reference = self._eager(tokens, positions, slots, attend)
        self._checked.add(m)
        if self.ensure(m):
            graphed = self._replay(m, tokens, positions, slots, attend)
            diff = ((graphed - reference).norm() / reference.norm().clamp_min(1e-30)).item()
            self.max_diff = max(self.max_diff, diff)
            if not diff <= 0.05:
                log.warning("CUDA-graph logits differ from eager ones (relative L2 %.3g); decoding "
                            "eagerly", diff)
                self.disabled = True
        return reference

    def _replay(self, m: int, tokens, positions, slots, attend) -> torch.Tensor:
        """Replay bucket ``m``; each layer's attention is ``attend.for_step(q, o)(layer)`` when
        ``attend`` offers a per-step graph (:class:`AttentionGraph`), else ``attend(layer, q, o)``."""
        n = tokens.numel()
        b = self._bufs
        meta = np.empty(2 * m, dtype=np.int64)
        meta[:n], meta[n:m] = positions, 0
        meta[m: m + n], meta[m + n:] = slots, self.kv.pad_slot
        src = torch.from_numpy(meta)
        b["meta"][: 2 * m].copy_(src.pin_memory() if b["meta"].is_cuda else src, non_blocking=True)
        b["tok"][:n].copy_(tokens)
        q, o = b["q"][:n], b["o"][:n]
        graphs = self._graphs[m]
        for_step = getattr(attend, "for_step", None)
        attend_layer = for_step(q, o) if for_step is not None else (lambda layer: attend(layer, q, o))
        for layer, g in enumerate(graphs[:-1]):
            g.replay()
            attend_layer(layer)
        graphs[-1].replay()
        return b["logits"][:n].clone()

    def _eager(self, tokens, positions, slots, attend) -> torch.Tensor:
        dev = self.model.device
        pos = torch.from_numpy(positions).to(dev)
        sl = torch.from_numpy(slots).to(dev)
        return self.model.decode(tokens, pos, sl, self.kv.caches, lambda layer, q: attend(layer, q, None))


class AttentionGraph:
    """One CUDA graph of a decode step's attention launches, replayed for every layer.

    Between the decode graphs' replays each layer's attention used to run eagerly: 2-4 Triton
    launches at ~36 us of host time each, so 32 layers of a prefix-aware plan took longer to enqueue
    than a small step takes on the GPU. The plan changes every step, so the launches are captured
    once per step and replayed for each layer. The kernels read the layer from a device counter
    that the layer's RoPE kernel, in the decode graph before it, has written
    (:class:`DecodeGraphs`' ``layer_counter``; an increment in this graph cost a launch a layer).

    Parameters
    ----------
    k_cache, v_cache : [num_pages, page_size, Hkv, D]
        Layer 0's caches; layer ``l``'s start ``l * layer_stride`` elements later.
    layer_stride : int
    """

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, layer_stride: int):
        self.k_cache, self.v_cache, self.layer_stride = k_cache, v_cache, int(layer_stride)
        self.counter = torch.zeros(1, dtype=torch.int32, device=k_cache.device)
        self._stream = torch.cuda.Stream(k_cache.device)
        self._barrier = torch.cuda.Event(enable_timing=True)

    def capture(self, attention, q: torch.Tensor, out: torch.Tensor, plan, *,
                sm_scale: float | None = None) -> torch.cuda.CUDAGraph:
        """Capture ``attention.run`` of ``plan`` into ``out``, for the layer in :attr:`counter` at
        each replay. A step whose layers use two plans (full and sliding-window layers) captures
        one graph for each."""
        graph = torch.cuda.CUDAGraph()
        # capture_begin directly: torch.cuda.graph() would synchronise and collect garbage, every step
        with torch.cuda.stream(self._stream):
            graph.capture_begin(capture_error_mode="relaxed")
            try:
                attention.run(q, self.k_cache, self.v_cache, plan, out=out, sm_scale=sm_scale,
                              layer=self.counter, layer_stride=self.layer_stride)
            finally:
                graph.capture_end()
        return graph

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        """Replay ``graph`` (from :meth:`capture`) for the counter's layer, then record a timing event.

        Why the event: with this graph's replays and the decode graphs' alternating back to back on
        one stream, back-to-back decode steps ran 10-20% slower than the same steps issued behind
        a GPU sleep (H200, CUDA 13; more so later in a process). A timing event (or any kernel)
        after each replay removes most of that (ToT sorting 6.28 -> 5.60 ms a step); a plain event,
        or the same wait on the host, does not."""
        graph.replay()
        self._barrier.record()
