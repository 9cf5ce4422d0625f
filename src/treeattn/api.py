"""Public attention API: the plan/run wrapper, the functional form and ``merge_states``."""
from __future__ import annotations

import weakref

import torch

from treeattn.compiled import launch_stream
from treeattn.launchers import (SUPPORTED_DTYPES, check_attention_inputs, default_scale, launch_cache, launch_packed,
                                merge_partials, pack_launches, partial_attention)
from treeattn.plan import STRATEGIES, CostModel, HeadConfig, Plan, make_plan
from treeattn.plan.lower.addressing import tma_loads
from treeattn.plan.select.profiles import profile_for
from treeattn.plan.lower.update import update_plan
from treeattn.precompile import precompile
from treeattn.reference import merge_states_torch, run_plan_torch
from treeattn.tree import DecodingTree

__all__ = ["TreeAttention", "tree_attention", "merge_states", "BACKENDS"]

BACKENDS = ("auto", "triton", "torch")


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


class TreeAttention:
    """Prefix-aware attention for a decoding tree over a paged KV cache.

    ``plan()`` runs on the host once per tree (reuse it for every layer and every step until the
    tree changes); ``run()`` launches the kernels without host synchronisation or allocation
    (given ``out``), so it can be captured in a CUDA graph.

    Parameters
    ----------
    workspace : torch.Tensor, optional
        fp32 buffer for partial results (16-bit partial outputs of 16-bit inputs are stored in
        it too), owned by the caller; it must hold at least ``plan.workspace_bytes() / 4``
        elements. Without it the wrapper allocates (and grows) its
        own buffer in ``plan()``.
    device : torch.device or str, optional
        Where plans live (default: the workspace's device, else CPU).
    backend : {"auto", "triton", "torch"}
        "auto" runs the Triton kernels on CUDA tensors and the PyTorch reference backend
        otherwise.
    cost : CostModel, optional
        Cost model for the balancing planners and ``auto`` (default: a ``CostModel`` of
        :func:`~treeattn.plan.select.profiles.profile_for` ``device``, with ``side_streams=False``
        when ``streams`` is 0 without ``pdl``, and ``tma`` as resolved).
    streams : int or None
        CUDA side streams on which a plan's launches of different tile shapes run beside the
        first when ``run()`` is captured in a CUDA graph (PAT's multi-stream forward); 0 runs
        them one after another on one stream, where the last launch merges the partial rows
        itself when the plan allows (:attr:`~treeattn.plan.format.Plan.merge_last`: no merge
        launch). None: 0 where ``pdl`` applies (it overlaps the launches on one stream and was
        faster under graph replay on the H100), else 3.
        Destroying a graph with side-stream branches waits for its queued replays, so code that
        captures ``run()`` every step (the engine) uses 0.
    pdl : bool or None
        Run a plan's launches and its merge as programmatic dependent launches on one stream
        (CUDA devices of compute capability 9.0 or later, ``streams=0``): each launch starts
        while the one before finishes (see :func:`treeattn.launchers.partial_attention`). None: where
        supported.
    tma : bool or None
        Tall launches over long runs of consecutive slots load K/V through tensor descriptors
        (Hopper's TMA; 16-bit caches; :func:`treeattn.plan.lower.addressing.tma_launches`). None: on
        CUDA devices of compute capability 9.0 or later. Ignored when ``cost`` is given (its
        ``tma`` decides).

    Examples
    --------
    >>> wrapper = TreeAttention(device="cuda")
    >>> plan = wrapper.plan(tree, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    >>> for layer in range(num_layers):
    ...     o = wrapper.run(q[layer], pool.k_cache(layer), pool.v_cache(layer), plan)
    """

    def __init__(self, workspace: torch.Tensor | None = None, *, device=None, backend: str = "auto",
                 cost: CostModel | None = None, streams: int | None = None, pdl: bool | None = None,
                 tma: bool | None = None):
        if workspace is not None:
            if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.float32:
                raise TypeError("workspace must be a float32 torch.Tensor")
            device = workspace.device if device is None else device
        self.device = torch.device(device if device is not None else "cpu")
        self.backend = _resolve_backend(backend, self.device)
        self._workspace = workspace
        self._owns_workspace = workspace is None
        # plan -> (workspace, o_part, lse_part, {call signature: packed launches})
        self._views = weakref.WeakKeyDictionary()
        hopper = (self.backend == "triton" and self.device.type == "cuda"
                  and torch.cuda.get_device_capability(self.device)[0] >= 9)
        if streams is None:
            streams = 0 if hopper and pdl is not False else 3
        if streams < 0:
            raise ValueError(f"streams must be >= 0, got {streams}")
        self._streams = (tuple(torch.cuda.Stream(self.device) for _ in range(streams))
                         if self.backend == "triton" and self.device.type == "cuda" else ())
        supported = not streams and hopper
        if pdl and not supported:
            raise ValueError("pdl needs the triton backend on a CUDA device of compute capability 9.0 "
                             "or later, and streams=0")
        self.pdl = supported if pdl is None else bool(pdl)
        if tma and self.device.type == "cuda" and not hopper:
            raise ValueError("tma needs the triton backend on a CUDA device of compute capability 9.0 or later")
        # launches overlap on side streams and with PDL alike (measured on an H200)
        self.cost = cost or CostModel(profile=profile_for(self.device), side_streams=streams > 0 or self.pdl,
                                      tma=hopper if tma is None else bool(tma), pdl=self.pdl)

    @property
    def num_streams(self) -> int:
        """Side streams of the captured ``run()`` (0: the launches run in order on one stream)."""
        return len(self._streams)

    def plan(self, tree: DecodingTree, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype = torch.float16, strategy: str = "auto") -> Plan:
        """Plan one decode step of ``tree`` (host-side); see :data:`treeattn.STRATEGIES`."""
        if dtype not in SUPPORTED_DTYPES and dtype != torch.float64:
            raise TypeError(f"dtype {dtype} is not supported; expected float16, bfloat16 or float32")
        heads = HeadConfig(num_qo_heads, num_kv_heads, head_dim, dtype)
        plan = make_plan(tree, heads, strategy=strategy, device=self.device, cost=self.cost)
        need = plan.workspace_bytes() // 4
        if self._workspace is None or self._workspace.numel() < need:
            if not self._owns_workspace:
                raise ValueError(f"workspace holds {self._workspace.numel()} floats but this plan needs "
                                 f"{need}")
            self._workspace = torch.empty(max(need, 1), dtype=torch.float32, device=self.device)
        return plan

    def update(self, plan: Plan, tree: DecodingTree) -> Plan:
        """``plan`` for ``tree`` after a decode step (PAT's lazy update).

        When ``tree`` is ``plan``'s tree with tokens appended to the tails of nodes the plan
        already reads (every leaf grew by one token, say), the plan is patched in place of being
        rebuilt: same work items, longer KV ranges. Otherwise ``tree`` is planned again with
        ``plan``'s strategy and heads. A ``tree`` made from the plan's by
        :meth:`~treeattn.tree.decoding_tree.DecodingTree.append` is patched without comparing the two trees.
        """
        patched = update_plan(plan, tree)
        if patched is not None:
            need = patched.workspace_bytes() // 4
            if self._workspace is not None and self._workspace.numel() >= need:
                return patched
        h = plan.heads
        return self.plan(tree, num_qo_heads=h.num_qo_heads, num_kv_heads=h.num_kv_heads,
                         head_dim=h.head_dim, dtype=h.dtype, strategy=plan.requested_strategy)

    def precompile(self, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype = torch.float16, page_size: int, workers: int = 0,
                   vocab: int | None = None) -> int:
        """Compile every kernel variant this wrapper's plans for these heads can launch, now
        (Triton compiles a variant on its first launch, seconds each): with this wrapper's
        ``pdl``, TMA loads, merging last launches and device profile (whose tiles the lowering
        gives), in ``workers`` processes on a GPU
        (:func:`treeattn.precompile.precompile`); with ``vocab``, the fused sampling kernel's
        too. Returns the launches made here; 0 with the torch backend."""
        if self.backend != "triton":
            return 0
        heads = HeadConfig(num_qo_heads, num_kv_heads, head_dim, dtype)
        return precompile(heads, page_size=page_size, device=self.device, pdl=self.pdl,
                          tma=tma_loads(heads, self.cost), merge_last=self.cost.merges_last(heads), workers=workers,
                          vocab=vocab, profile=self.cost.profile)

    def partial_buffers(self, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the workspace that ``run`` gives ``plan``'s partial results:
        ``o_part [R, Hq, D]`` in ``plan.heads.partial_dtype`` and fp32 ``lse_part [R, Hq]`` (to
        launch the kernels one by one)."""
        made = self._views.get(plan)
        if made is not None and made[0] is self._workspace:  # (a run per layer: made once)
            return made[1], made[2]
        if self._workspace is None or self._workspace.numel() * 4 < plan.workspace_bytes():
            raise ValueError("this plan was not made by this wrapper (workspace too small)")
        rows, hq, d = plan.num_rows, plan.heads.num_qo_heads, plan.heads.head_dim
        dtype = plan.heads.partial_dtype
        words = -(-rows * hq * d * dtype.itemsize // 4)  # fp32 words the outputs take
        o_part = self._workspace[:words].view(dtype)[: rows * hq * d].view(rows, hq, d)
        lse_part = self._workspace[words: words + rows * hq].view(rows, hq)
        self._views[plan] = (self._workspace, o_part, lse_part, {})
        return o_part, lse_part

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Plan, *,
            sm_scale: float | None = None, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, return_lse: bool = False,
            layer: torch.Tensor | None = None, layer_stride: int = 0):
        """Attention of every query of ``plan`` over its visible KV.

        Parameters
        ----------
        q : [Q, Hq, D], float16 / bfloat16 / float32 (float64 with the torch backend)
        k_cache, v_cache : [num_pages, page_size, Hkv, D], same dtype
            The paged pool: slot ``s`` is ``cache[s // page_size, s % page_size]``.
        plan : Plan from :meth:`plan`
        sm_scale : float, default ``1 / sqrt(D)``
        out : [Q, Hq, D] in q's dtype, optional
        lse : [Q, Hq] float32, optional (written when given or when ``return_lse``)
        layer : [1] int32 on the caches' device, optional (Triton backend)
            Read on the device: the caches are those of layer ``layer[0]``, ``layer_stride``
            elements after ``k_cache`` / ``v_cache`` per layer (the pool's layout), so one CUDA
            graph of ``run`` serves every layer. The caller keeps ``layer[0]`` in range.
        layer_stride : int
            Elements between consecutive layers' caches (with ``layer``).

        Returns
        -------
        out, or ``(out, lse)`` with natural-log fp32 ``lse`` when ``return_lse``.

        Notes
        -----
        With ``out`` given (and ``lse`` with ``return_lse``), a call that repeats an earlier call
        of this plan exactly (the same tensors' addresses, shapes, strides and dtypes, and the
        same scalars) skips the checks and launches that call's kernels with their arguments
        packed (:func:`~treeattn.launchers.pack_launches`): a plan's runs over the same buffers,
        layer after layer (``layer=``) or step after step, pay little more host time than the
        CUDA driver's launches.
        """
        # the outputs are the caller's: a repeat of this call may take its packed launches
        packable = out is not None and (lse is not None or not return_lse)
        sig = None
        made = self._views.get(plan) if packable and isinstance(plan, Plan) else None
        # (records only exist on CUDA, where a call was launched through Triton's C launcher)
        if made is not None and made[3] and made[0] is self._workspace and not (
                self._streams and torch.cuda.is_current_stream_capturing()):
            try:
                sig = _call_signature(q, k_cache, v_cache, out, lse, layer, layer_stride, sm_scale, return_lse)
            except (AttributeError, TypeError):  # (not tensors: the checks below name the problem)
                pass
            packed = made[3].get(sig)
            if packed is not None:
                stream = launch_stream(sig[0])
                if stream is not None:
                    launch_packed(packed, stream)
                    return (out, lse) if return_lse else out
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a Plan from TreeAttention.plan, got {type(plan).__name__}")
        check_attention_inputs(q, k_cache, v_cache, plan)
        scale = default_scale(plan.heads.head_dim, sm_scale)
        nq, hq, d = q.shape
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
            raise ValueError(f"out must be a {tuple(q.shape)} {q.dtype} tensor on {q.device}, "
                             "contiguous in its last dimension")
        want_lse = return_lse or lse is not None
        if want_lse and lse is None:
            lse = torch.empty((nq, hq), dtype=torch.float32, device=q.device)
        if lse is not None and (lse.shape != (nq, hq) or lse.dtype != torch.float32):
            raise ValueError(f"lse must be a ({nq}, {hq}) float32 tensor")
        if layer is not None:
            if self.backend != "triton":
                raise ValueError("layer= needs the triton backend")
            if (not isinstance(layer, torch.Tensor) or layer.dtype != torch.int32 or layer.numel() != 1
                    or layer.device != q.device):
                raise ValueError(f"layer must be a one-element int32 tensor on {q.device}")
            if layer_stride < 0:
                raise ValueError(f"layer_stride must be >= 0, got {layer_stride}")
        if self.backend == "torch":
            acc = torch.float64 if q.dtype == torch.float64 else torch.float32
            o_part, lse_part = run_plan_torch(q, k_cache, v_cache, plan, sm_scale=scale, acc_dtype=acc)
            o, l = merge_states_torch(o_part, lse_part, plan.merge_indptr, plan.merge_indices,
                                      out_dtype=q.dtype)
            out.copy_(o)
            if lse is not None:
                lse.copy_(l)
        else:
            if q.dtype == torch.float64:
                raise TypeError("the triton backend supports float16, bfloat16 and float32")
            o_part, lse_part = self.partial_buffers(plan)
            # side streams only pay under a CUDA graph: eagerly, each fork and join costs more
            # host time than the launches' overlap saves
            streams = self._streams if self._streams and torch.cuda.is_current_stream_capturing() else ()
            # launches in order on one stream: the last one merges, where the plan allows (decided
            # by the wrapper's streams, not by capture, so a graph replays what eager runs). Else a
            # merge launch: under PDL it adds 1-2.5 us a layer, less than the launches' last
            # arrivals took to merge the rows themselves (atomic counts, measured on an H200)
            merge_last = plan.merge_last and not self._streams
            launched = partial_attention(q, k_cache, v_cache, plan, o_part, lse_part, sm_scale=scale, out=out,
                                         lse_out=lse, streams=streams, layer=layer, layer_stride=layer_stride,
                                         pdl=self.pdl, merge_last=merge_last, merge=not merge_last)
            if packable and launched is not None and launched[0] is not None and not streams:
                records = self._views[plan][3]
                if len(records) < _MAX_PACKED_CALLS:
                    packed = pack_launches(*launched, k_cache, v_cache, layer_stride, launch_cache(plan))
                    if packed is not None:
                        # (read above where the plan had records; the call's checks passed since)
                        sig = sig or _call_signature(q, k_cache, v_cache, out, lse, layer, layer_stride, sm_scale,
                                                     return_lse)
                        records[sig] = packed
        return (out, lse) if return_lse else out


#: calls a plan keeps packed (:meth:`TreeAttention.run`): one a layer where each layer's caches
#: are their own tensors; calls beyond it take the checked path
_MAX_PACKED_CALLS = 256


def _call_signature(q, k_cache, v_cache, out, lse, layer, layer_stride, sm_scale, return_lse) -> tuple:
    """What a :meth:`TreeAttention.run` call's checks and launches depend on beyond its plan and
    wrapper, on CUDA: the current device first, then the tensors' addresses (unique across
    devices under CUDA's unified addressing), shapes, strides and dtypes, and the scalars."""
    return (torch._C._cuda_getDevice(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            q.device, q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(),
            out.shape, out.stride(), q.dtype, k_cache.dtype, v_cache.dtype, out.dtype,
            None if lse is None else (lse.data_ptr(), lse.shape, lse.stride(), lse.dtype),
            None if layer is None else (layer.data_ptr(), layer.shape, layer.dtype), layer_stride, sm_scale,
            return_lse)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parents, lengths, *,
                   query_nodes=None, query_prefix=None, strategy: str = "auto", backend: str = "auto",
                   sm_scale: float | None = None) -> torch.Tensor:
    """Attention for a decoding tree over contiguous (unpaged) KV.

    Parameters
    ----------
    q : [num_queries, Hq, D]
    k, v : [sum(lengths), Hkv, D]
        Node ``i``'s tokens are contiguous, nodes in id order.
    parents : int sequence [N]
        ``-1`` marks a root; parents need not precede children.
    lengths : int sequence [N]
        Tokens of each node (``>= 0``).
    query_nodes : int sequence [num_queries], optional
        Default: one query per leaf, leaves in increasing id order.
    query_prefix : int sequence [num_queries], optional
        Tokens of its own node each query sees (default: all).
    strategy : one of :data:`treeattn.STRATEGIES`
    backend : {"auto", "triton", "torch"}

    Returns
    -------
    o : [num_queries, Hq, D] in q's dtype.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [total_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_queries, num_qo_heads, head_dim], got {tuple(q.shape)}")
    tree = DecodingTree.from_parents(parents, lengths, query_nodes=query_nodes, query_prefix=query_prefix)
    if k.shape[0] != tree.num_tokens:
        raise ValueError(f"k holds {k.shape[0]} tokens but the nodes' lengths sum to {tree.num_tokens}")
    if q.shape[0] != tree.num_queries:
        raise ValueError(f"q has {q.shape[0]} queries but the tree has {tree.num_queries}")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads/dim {tuple(q.shape[1:])} do not match k heads/dim {tuple(k.shape[1:])}")
    wrapper = TreeAttention(device=q.device, backend=backend)
    plan = wrapper.plan(tree, num_qo_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2],
                        dtype=q.dtype, strategy=strategy)
    return wrapper.run(q, k.unsqueeze(1), v.unsqueeze(1), plan, sm_scale=sm_scale)


def merge_states(o: torch.Tensor, lse: torch.Tensor, *, backend: str = "auto"):
    """Merge attention states computed over disjoint KV sets.

    Parameters
    ----------
    o : [N, S, H, D]
        S partial outputs per row, each normalised over its own KV set.
    lse : [N, S, H] float32
        Their natural-log log-sum-exp (``-inf`` for an empty KV set).

    Returns
    -------
    (o [N, H, D] in o's dtype, lse [N, H] float32)
    """
    if o.dim() != 4 or lse.shape != o.shape[:3]:
        raise ValueError(f"o must be [N, S, H, D] and lse [N, S, H]; got {tuple(o.shape)}, {tuple(lse.shape)}")
    n, s, h, d = o.shape
    indptr = torch.arange(0, n * s + 1, s, dtype=torch.int32, device=o.device)
    indices = torch.arange(n * s, dtype=torch.int32, device=o.device)
    o_rows = o.reshape(n * s, h, d)
    lse_rows = lse.reshape(n * s, h)
    if _resolve_backend(backend, o.device) == "torch":
        return merge_states_torch(o_rows, lse_rows, indptr, indices, out_dtype=o.dtype)
    out = torch.empty((n, h, d), dtype=o.dtype, device=o.device)
    lse_out = torch.empty((n, h), dtype=torch.float32, device=o.device)
    merge_partials(o_rows.float().contiguous(), lse_rows.float().contiguous(),
                   torch.arange(n, dtype=torch.int32, device=o.device), indptr, indices, out, lse_out,
                   max_rows=s)
    return out, lse_out
