"""A Llama-family decoder (RMSNorm, RoPE with Llama-3 scaling, GQA, SwiGLU; Llama, Mistral, Qwen2
and Qwen3 checkpoints, and Gemma 3's variant: ``1 + w`` norms around attention and MLP, GeGLU,
scaled embeddings, sliding-window layers with their own RoPE base) whose decode attention is
supplied by the caller (treeattn over the paged tree KV cache) and whose prefill uses causal SDPA
(with the sliding window's mask in sliding-window layers).

The forward pass is split into per-layer pieces (:meth:`TreeModel.pre_attention`,
:meth:`TreeModel.post_attention`) so that the pieces between two attention calls can be captured
in CUDA graphs (:mod:`treeattn.engine.graphs`). On CUDA the elementwise parts of those pieces run as
fused Triton kernels (:mod:`treeattn.engine.fused`: RMSNorm with the residual add, RoPE of q and k
with the K/V cache write, SwiGLU); the PyTorch code here is the reference and the CPU path, and
runs the parts the kernels do not cover (per-head q/k norms, Gemma's norms and GeGLU).

With a :class:`~treeattn.engine.parallel.TensorParallel` the model is this rank's share of a
tensor-parallel model (its heads, intermediate features and vocabulary slice): the o and down
projections are each followed by an all-reduce, the embedding by one, and the logits are
all-gathered; without one nothing else runs.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from treeattn.engine import fused
from treeattn.engine.config import ModelConfig, load_config
from treeattn.engine.parallel import TensorParallel
from treeattn.engine.weights import Weights, load_weights, random_weights

__all__ = ["TreeModel", "rms_norm", "gemma_rms_norm", "apply_rope"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: in float32, cast back, then scaled by ``weight``.

    ``x`` ``[..., hidden]`` in the model dtype; returns the same shape and dtype.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, factor: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm as transformers computes it: scaled by ``factor = 1 + w`` in float32, then
    cast. ``x`` ``[..., C]`` in the model dtype, ``factor`` float32 ``[C]``; returns ``x``'s shape
    and dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * factor).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [n, heads, D]`` by ``cos, sin [n, D]`` (rotate-half layout, as in transformers)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


# SDPA's cuDNN backend builds an execution plan for every new (prompt, context) length: 0.1-1.5 s
# at the first prefill of each length on an H200, so every new request paid it in its TTFT
_PREFILL_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class TreeModel:
    """Decoder over a flat paged KV cache.

    Parameters
    ----------
    config : ModelConfig
    weights : Weights
        On ``device`` in ``dtype``.
    device : torch.device or str
    dtype : torch.dtype
        float32, float16 or bfloat16.
    fused : bool or None
        Run the elementwise parts as fused Triton kernels (:mod:`treeattn.engine.fused`); default:
        on CUDA. On CPU they need Triton's interpreter (``TRITON_INTERPRET=1``). Can be changed
        later through the ``fused`` attribute. Gemma's norms and GeGLU always run in PyTorch.
    tp : TensorParallel, optional
        This rank's place in a tensor-parallel group; ``weights`` are then its share
        (:func:`~treeattn.engine.weights.load_weights` with ``tp``), and every call of the
        pieces below is collective over the group.

    Attributes
    ----------
    num_heads, num_kv_heads : int
        The query and KV heads this model computes (all of them, or a TP rank's share).
    q_size, kv_size : int
        ``num_heads * head_dim`` and ``num_kv_heads * head_dim``.

    Notes
    -----
    ``caches`` arguments are lists with one ``(k, v)`` pair per layer, each ``[num_slots, Hkv, D]``
    (a flat view of the KV pool: slot ``s`` holds the key/value of one token). ``cos`` and ``sin``
    are the RoPE tables ``[P, D]`` of the full-attention layers; sliding-window layers with their
    own RoPE base (Gemma 3) use ``local_cos`` and ``local_sin``.
    """

    def __init__(self, config: ModelConfig, weights: Weights, *, device="cpu", dtype=torch.float32,
                 fused: bool | None = None, tp: TensorParallel | None = None):
        parts = 1
        if tp is not None:
            tp.check(config)
            parts = tp.size
        self.config = config
        self.tp = tp
        self.num_heads, self.num_kv_heads = config.num_heads // parts, config.num_kv_heads // parts
        self.q_size, self.kv_size = self.num_heads * config.head_dim, self.num_kv_heads * config.head_dim
        rows = weights.layers[0].qkv.shape[0]
        if rows != self.q_size + 2 * self.kv_size:
            raise ValueError(f"weights: the q/k/v projection has {rows} rows, but {self.num_heads} query and "
                             f"{self.num_kv_heads} KV heads of {config.head_dim} need "
                             f"{self.q_size + 2 * self.kv_size} (weights of another tensor-parallel split?)")
        self.weights = weights
        self.device = torch.device(device)
        self.dtype = dtype
        self._inv_freq = config.inv_freq().to(self.device)
        self._local_inv_freq = (config.inv_freq(local=True).to(self.device)
                                if config.local_rope_theta is not None else None)
        self.cos = torch.empty(0, config.head_dim, device=self.device, dtype=dtype)
        self.sin = torch.empty_like(self.cos)
        self.local_cos, self.local_sin = self.cos, self.sin
        self._embed_scale = (torch.tensor(config.embed_scale, dtype=dtype, device=self.device)
                             if config.embed_scale is not None else None)
        self.tokenizer = None
        self.fused = self.device.type == "cuda" if fused is None else bool(fused)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model_dir, *, device="cpu", dtype=torch.float32,
                        fused: bool | None = None, tp: TensorParallel | None = None) -> "TreeModel":
        """Load a Hugging Face model directory (config.json + safetensors; tokenizer.json if any);
        with ``tp``, only this rank's share of the weights."""
        from treeattn.engine.weights import load_tokenizer

        config = load_config(model_dir)
        model = cls(config, load_weights(model_dir, config, device=device, dtype=dtype, tp=tp), device=device,
                    dtype=dtype, fused=fused, tp=tp)
        model.tokenizer = load_tokenizer(model_dir)
        return model

    @classmethod
    def random(cls, config, *, device="cpu", dtype=torch.float32, seed: int = 0,
               std: float = 0.02, fused: bool | None = None, tp: TensorParallel | None = None) -> "TreeModel":
        """Random weights of a preset name (``"tiny"``, ``"llama3-8b"``) or a :class:`ModelConfig`;
        with ``tp``, this rank's share of the same seed's weights."""
        if isinstance(config, str):
            config = ModelConfig.preset(config)
        return cls(config, random_weights(config, device=device, dtype=dtype, seed=seed, std=std, tp=tp),
                   device=device, dtype=dtype, fused=fused, tp=tp)

    # ------------------------------------------------------------------ pieces
    def ensure_positions(self, n: int) -> None:
        """Make the RoPE tables cover positions ``[0, n)`` (they only grow)."""
        if n > self.config.max_position_embeddings:
            raise ValueError(f"position {n - 1} is beyond the model's max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        if n <= self.cos.shape[0]:
            return
        n = min(self.config.max_position_embeddings, max(n, 2 * self.cos.shape[0]))
        self.cos, self.sin = self._tables(n, self._inv_freq)
        self.local_cos, self.local_sin = (self.cos, self.sin) if self._local_inv_freq is None else \
            self._tables(n, self._local_inv_freq)

    def _tables(self, n: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(n, device=self.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.local_cos, self.local_sin) if self.config.local_rope(layer) else (self.cos, self.sin)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` int64 ``[n]`` -> hidden states ``[n, hidden]``."""
        if self.tp is None:
            e = self.weights.embed.index_select(0, tokens)
        else:
            e = self.tp.embed(self.weights.embed, tokens)
        return e if self._embed_scale is None else e * self._embed_scale

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm of ``x [..., C]``: Gemma's, fused (one kernel) or PyTorch's."""
        c = self.config
        if c.gemma:
            return gemma_rms_norm(x, weight, c.rms_norm_eps)
        return (fused.rms_norm if self.fused else rms_norm)(x, weight, c.rms_norm_eps)

    def _qk_norm(self, qkv: torch.Tensor, w) -> torch.Tensor:
        """``qkv [n, q + 2 kv]`` with every query and key head RMS-normed (Qwen3, Gemma 3)."""
        c, n = self.config, qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        norm = gemma_rms_norm if c.gemma else rms_norm
        q = norm(q.reshape(n, self.num_heads, c.head_dim), w.q_norm, c.rms_norm_eps)
        k = norm(k.reshape(n, self.num_kv_heads, c.head_dim), w.k_norm, c.rms_norm_eps)
        return torch.cat((q.reshape(n, self.q_size), k.reshape(n, self.kv_size), v), dim=-1)

    def pre_attention(self, layer: int, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      caches, *, q_out: torch.Tensor | None = None, layer_out: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, q/k/v projection and RoPE of ``h [n, hidden]`` at ``positions`` int64 ``[n]``; K/V
        are written to ``slots`` int64 ``[n]`` of the layer's cache. Returns ``(q [n, Hq, D], k, v
        [n, Hkv, D])``; ``q`` is written into ``q_out [n, Hq, D]`` (and returned) when given, and
        ``layer`` into ``layer_out`` (int32 [1]: the attention graph's layer counter) when given.

        Fused (Llama-like layers): 3 kernels (norm, GEMM, RoPE + K/V write); unfused: about 23."""
        x = self._norm(h, self.weights.layers[layer].attn_norm)
        return self._attention_input(layer, x, positions, slots, caches, q_out=q_out, layer_out=layer_out)

    def _attention_input(self, layer: int, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                         caches, *, q_out: torch.Tensor | None, layer_out: torch.Tensor | None):
        """:meth:`pre_attention` after the norm: ``x`` is the normed hidden state."""
        c, w = self.config, self.weights.layers[layer]
        n = x.shape[0]
        kc, vc = caches[layer]
        cos, sin = self._rope(layer)
        qkv = F.linear(x, w.qkv, w.qkv_bias)
        if c.qk_norm:
            qkv = self._qk_norm(qkv, w)
        if self.fused:
            return fused.rope_qkv_cache(qkv, cos, sin, positions, slots, kc, vc, self.num_heads,
                                        self.num_kv_heads, c.head_dim, q_out=q_out, layer_out=layer_out,
                                        layer=layer)
        if layer_out is not None:
            layer_out.fill_(layer)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
        q = apply_rope(q.view(n, self.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(n, self.num_kv_heads, c.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, c.head_dim)
        kc.index_copy_(0, slots, k)
        vc.index_copy_(0, slots, v)
        if q_out is not None:
            q = q_out.copy_(q)
        return q, k, v

    def post_attention(self, layer: int, h: torch.Tensor, o: torch.Tensor, *,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Output projection of the attention result ``o [n, Hq, D]``, residual, MLP, residual.
        Returns the new ``h [n, hidden]``, written into ``out`` when given (``out`` may be ``h``).

        Fused (Llama-like layers): 6 kernels (4 GEMMs, residual add + norm, SwiGLU, residual add);
        unfused: about 15."""
        c, w = self.config, self.weights.layers[layer]
        a = self._attention_output(layer, o)
        if c.gemma:
            h = h + gemma_rms_norm(a, w.attn_out_norm, c.rms_norm_eps)
            d = self._mlp(gemma_rms_norm(h, w.mlp_norm, c.rms_norm_eps), w)
            h = h + gemma_rms_norm(d, w.mlp_out_norm, c.rms_norm_eps)
            return h if out is None else out.copy_(h)
        if self._fused_mlp:
            h, d = self._fused_mlp_delta(layer, h, a)
            return torch.add(h, d, out=out) if out is not None else h.add_(d)
        h = h + a
        h = h + self._mlp(rms_norm(h, w.mlp_norm, c.rms_norm_eps), w)
        return h if out is None else out.copy_(h)

    def _attention_output(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention result ``o [n, Hq, D]`` -> ``[n, hidden]`` (a TP
        rank's partial sums all-reduced)."""
        w = self.weights.layers[layer]
        a = F.linear(o.reshape(o.shape[0], self.q_size), w.o, w.o_bias)
        return a if self.tp is None else self.tp.all_reduce(a)

    @property
    def _fused_mlp(self) -> bool:
        return self.fused and not self.config.gemma and self.config.hidden_act == "silu"

    def _fused_mlp_delta(self, layer: int, h: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused path of :meth:`post_attention` but its last residual add: ``h + a`` (in
        ``a``'s memory) and the MLP's output of its norm."""
        c, w = self.config, self.weights.layers[layer]
        h, x = fused.add_rms_norm(h, a, w.mlp_norm, c.rms_norm_eps, h_out=a)
        act = fused.swiglu(F.linear(x, w.gate_up, w.gate_up_bias))
        d = F.linear(act, w.down, w.down_bias)
        if self.tp is not None:
            self.tp.all_reduce(d)
        return h, d

    def next_layer(self, layer: int, h: torch.Tensor, o: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, caches, *, q_out: torch.Tensor | None = None,
                   layer_out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`post_attention` of ``layer`` into ``h`` (in place), then :meth:`pre_attention`
        of ``layer + 1``; returns that layer's ``q`` (in ``q_out`` when given). Fused Llama-like
        layers add the MLP's residual in the next layer's norm kernel: one launch a layer fewer
        than the two calls."""
        if not self._fused_mlp:
            self.post_attention(layer, h, o, out=h)
            return self.pre_attention(layer + 1, h, positions, slots, caches, q_out=q_out, layer_out=layer_out)[0]
        mid, d = self._fused_mlp_delta(layer, h, self._attention_output(layer, o))
        _, x = fused.add_rms_norm(mid, d, self.weights.layers[layer + 1].attn_norm, self.config.rms_norm_eps, h_out=h)
        return self._attention_input(layer + 1, x, positions, slots, caches, q_out=q_out, layer_out=layer_out)[0]

    def _mlp(self, x: torch.Tensor, w) -> torch.Tensor:
        """The gated MLP of ``x [n, hidden]``: SwiGLU, or GeGLU with tanh-approximated GELU."""
        gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        act = F.silu(gate) if self.config.hidden_act == "silu" else F.gelu(gate, approximate="tanh")
        d = F.linear(act * up, w.down, w.down_bias)
        return d if self.tp is None else self.tp.all_reduce(d)

    def logits(self, h: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and LM head: ``h [n, hidden]`` -> float32 logits ``[n, vocab]`` (a TP rank's
        vocabulary slices all-gathered), written into ``out`` (float32 ``[n, vocab]``) when given:
        the conversion from the model's dtype is then the copy (one pass over the logits, not
        two: the second took 35 us a step at 128 rows of a 128K vocabulary on an H200)."""
        y = F.linear(self._norm(h, self.weights.norm), self.weights.lm_head)
        if self.tp is not None:
            y = self.tp.gather(y.float())
        if out is None:
            return y.float()
        return out.copy_(y)

    # ------------------------------------------------------------------ passes
    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, caches,
               attend) -> torch.Tensor:
        """One decode step of ``n`` new tokens (eager).

        Parameters
        ----------
        tokens, positions, slots : int64 ``[n]`` on the model's device
        caches : per-layer ``(k, v)`` flat caches
        attend : callable ``(layer, q [n, Hq, D]) -> o [n, Hq, D]``
            Attention of the new tokens over the tree (their own K/V are in the cache already).

        Returns
        -------
        float32 logits ``[n, vocab]``.
        """
        h = self.embed(tokens)
        q, _, _ = self.pre_attention(0, h, positions, slots, caches)
        last = self.config.num_layers - 1
        for layer in range(last):
            q = self.next_layer(layer, h, attend(layer, q), positions, slots, caches)
        return self.logits(self.post_attention(last, h, attend(last, q)))

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                context_slots, caches, *, lengths=None, all_logits: bool = False) -> torch.Tensor:
        """Causal prefill of ``L`` tokens that follow ``C`` context tokens already in the cache
        (the whole path before them: context token ``i`` sits at position ``i``); in sliding-window
        layers each token sees the last ``sliding_window`` tokens only.

        Several *segments* (prompts of different requests) can share one pass: their tokens are
        concatenated, every layer's norms, GEMMs and K/V writes run once over all of them, and only
        attention runs per segment. Every segment's K/V of a layer is written before any attention
        of that layer, so a segment's context may include slots an earlier segment writes.

        Parameters
        ----------
        tokens, positions, slots : int64 ``[L]``
            Of every segment, concatenated in order.
        context_slots : int64 ``[C]``, or a sequence of ``R`` of them
            Cache slots of the (each segment's) context, in order (empty for a root prompt).
        lengths : sequence of ``R`` int, optional
            New tokens of each segment (positive, summing to ``L``); required with a sequence of
            ``context_slots``.
        all_logits : bool
            Return logits of every position instead of each segment's last one.

        Returns
        -------
        float32 logits ``[vocab]`` (last position, one tensor ``context_slots``), ``[R, vocab]``
        (each segment's last position, a sequence of them) or ``[L, vocab]`` (``all_logits``).
        """
        L = tokens.shape[0]
        single = isinstance(context_slots, torch.Tensor)
        if single:
            contexts, lengths = [context_slots], [L]
        else:
            contexts = list(context_slots)
            if lengths is None or len(lengths) != len(contexts) or not contexts:
                raise ValueError(f"prefill: {len(contexts)} context_slots need as many segment lengths, got "
                                 f"{None if lengths is None else len(lengths)}")
            lengths = [int(n) for n in lengths]
            if min(lengths) < 1 or sum(lengths) != L:
                raise ValueError(f"prefill: segment lengths {lengths} must be positive and sum to the {L} tokens")
        c = self.config
        group = c.num_heads // c.num_kv_heads
        segments, start = [], 0
        for ctx, n in zip(contexts, lengths):
            segments.append((start, start + n, self._prefill_keys(ctx, slots[start:start + n])))
            start += n
        h = self.embed(tokens)
        with sdpa_kernel(list(_PREFILL_BACKENDS)):
            for layer in range(c.num_layers):
                # all segments' K/V of this layer are in the cache before any of them attends
                q, _, _ = self.pre_attention(layer, h, positions, slots, caches)
                kc, vc = caches[layer]
                win = c.layer_window(layer)
                outs = []
                for a, b, kinds in segments:
                    key_slots, mask = kinds[win]
                    k = kc.index_select(0, key_slots).repeat_interleave(group, dim=1)
                    v = vc.index_select(0, key_slots).repeat_interleave(group, dim=1)
                    o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                       v.transpose(0, 1)[None], attn_mask=mask, scale=c.sm_scale)
                    outs.append(o[0].transpose(0, 1))
                h = self.post_attention(layer, h, outs[0] if len(outs) == 1 else torch.cat(outs))
        if all_logits:
            return self.logits(h)
        if single:
            return self.logits(h[-1:])[0]
        # (views of the last rows: no index tensor to upload)
        return self.logits(torch.stack([h[b - 1] for _, b, _ in segments]))

    def _prefill_keys(self, context_slots: torch.Tensor, slots: torch.Tensor) -> dict:
        """Per kind of layer (its window, None: full attention), the slots of the keys that the
        ``L`` new tokens at ``slots`` after ``C`` context tokens read and the mask over them."""
        c = self.config
        L, C = slots.shape[0], context_slots.shape[0]
        # full layers take a lower-right causal bias, which SDPA runs with its flash kernel, not a
        # dense mask
        kinds = {None: (torch.cat((context_slots, slots)), causal_lower_right(L, C + L))}
        if c.sliding_window is not None:
            # the first context token any query's window reaches: C - (W - 1)
            first = max(0, C - c.sliding_window + 1)
            query = C + torch.arange(L, device=self.device)
            key = torch.arange(first, C + L, device=self.device)[None, :]
            win_mask = (key <= query[:, None]) & (key > query[:, None] - c.sliding_window)
            kinds[c.sliding_window] = (torch.cat((context_slots[first:], slots)), win_mask)
        return kinds
