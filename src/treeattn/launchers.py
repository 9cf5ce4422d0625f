"""Launchers: validate devices, dtypes, shapes and strides, then launch the Triton kernels.

They never synchronise with the host and allocate nothing when given their outputs, so a
sequence of launches can be captured in a CUDA graph.
"""
from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence

import torch
import triton
from triton.compiler.compiler import CompiledKernel
from triton.tools.tensor_descriptor import TensorDescriptor

from treeattn.compiled import KeptKernel, launch_stream
from treeattn.kernels.attention import _tree_partial_attention_kernel
from treeattn.kernels.merge import _merge_states_kernel, _merge_tile_kernel
from treeattn.kernels.sampling import _sample_combine_kernel, _sample_partial_kernel, _topk_partial_kernel
from treeattn.kernels.state import LOG2E
from treeattn.plan.lower.merge_config import merge_config, merge_row_tile
from treeattn.plan.format import Plan

__all__ = ["SUPPORTED_DTYPES", "attention_constexprs", "check_attention_inputs", "partial_attention",
           "pack_launches", "launch_packed", "merge_partials", "launch_cache", "check_triton_device",
           "gumbel_argmax", "row_topk_candidates", "TOPK_CANDIDATES"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_triton_device(t: torch.Tensor) -> None:
    """Raise RuntimeError when ``t`` is on the CPU and Triton's interpreter is off (a kernel would
    fail deep in Triton's launcher)."""
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "triton is imported to run the kernels on CPU tensors")


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           plan: Plan) -> None:
    """Raise TypeError/ValueError naming the first problem with ``q``, the caches or the plan.

    Inputs of a kind that passed for this plan before (the same shapes, dtypes, devices and
    strides) pass at once: reading them as a key costs a third of the checks' host time."""
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k_cache, tensor) and isinstance(v_cache, tensor)):
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    key = (q.shape, q.dtype, q.device, q.stride(), k_cache.shape, k_cache.dtype, k_cache.device, k_cache.stride(),
           v_cache.shape, v_cache.dtype, v_cache.device, v_cache.stride())
    checked = plan.__dict__.setdefault("_checked_inputs", set())
    if key in checked:
        return
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in SUPPORTED_DTYPES and t.dtype != torch.float64:
            raise TypeError(f"{name} has dtype {t.dtype}; expected one of float16, bfloat16, float32")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_queries, num_qo_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_pages, page_size, num_kv_heads, head_dim]"
                         f", got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device == plan.device):
        raise ValueError(f"device mismatch: q on {q.device}, k_cache on {k_cache.device}, "
                         f"v_cache on {v_cache.device}, plan on {plan.device}")
    h = plan.heads
    nq, hq, d = q.shape
    _, page_size, hkv, dk = k_cache.shape
    if nq != plan.num_queries:
        raise ValueError(f"q has {nq} queries but the plan was made for {plan.num_queries}")
    if (hq, hkv, d, dk) != (h.num_qo_heads, h.num_kv_heads, h.head_dim, h.head_dim):
        raise ValueError(f"head shape mismatch: q has {hq} heads of dim {d}, the caches {hkv} heads of "
                         f"dim {dk}; the plan expects {h.num_qo_heads}/{h.num_kv_heads} heads of dim "
                         f"{h.head_dim}")
    if page_size != plan.page_size:
        raise ValueError(f"k_cache has page size {page_size} but the tree was planned with "
                         f"{plan.page_size}")
    if plan.min_slots > k_cache.shape[0] * page_size:
        raise ValueError(f"page out of range: the plan reads slot {plan.min_slots - 1} but the cache "
                         f"has {k_cache.shape[0]} pages of {page_size}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    checked.add(key)


def launch_cache(plan: Plan) -> dict:
    """The compiled kernels that :func:`partial_attention` launches for ``plan``, its merge
    included (kept on the plan object: made on its first run, reused by every layer and step).

    A call whose inputs match an earlier one's in everything Triton specialises on (dtypes,
    16-byte alignment of the tensors, the scalars, the constexprs and launch options) launches
    that call's compiled kernels (:class:`~treeattn.compiled.KeptKernel`), its tensors passed as
    addresses, instead of Triton's ``kernel[grid](...)``, which binds and specialises every
    argument again (~25 us of host time a launch on the H200's host). Under Triton's interpreter
    nothing is compiled or kept."""
    return plan.__dict__.setdefault("_launch_cache", {})


def _plan_addresses(plan: Plan, cache: dict) -> tuple:
    """Device addresses of the plan's index tensors in :func:`partial_attention`'s argument order
    (fixed for the plan object: read once)."""
    addr = cache.get("addresses")
    if addr is None:
        addr = cache["addresses"] = tuple(t.data_ptr() for t in _plan_tensors(plan))
    return addr


def _plan_tensors(plan: Plan) -> tuple:
    """The plan's index tensors in :func:`partial_attention`'s argument order."""
    mask = (plan.tree_mask, plan.query_pos, plan.query_prefix) if plan.has_mask else (plan.kv_indices,) * 3
    return (plan.kv_indices, plan.work_kv_start, plan.work_kv_end, plan.work_mask_start, plan.work_row_indptr,
            plan.row_q_indices, plan.row_direct, *mask, plan.merge_indptr, plan.merge_indices)


def _wide(plan: Plan, strides: tuple, num_pages: int) -> bool:
    """Whether an element offset of a :func:`partial_attention` call may reach 2^31: a bound on
    every tensor's span from the call's ``strides`` (in that function's order), the plan's
    shapes and the caches' ``num_pages``, in a few integer operations (reading each tensor's
    shape and strides again cost ~7 us a call); only a call that launches through Triton needs it."""
    sq0, sq1, sk0, sk1, sk2, sv0, sv1, sv2, sp0, sp1, spl, so0, so1, sl = strides
    h = plan.heads
    hq, hkv, d = h.num_qo_heads, h.num_kv_heads, h.head_dim
    rows = max(plan.num_queries, plan.num_rows)  # (the output may be the partial rows' buffer)
    ps = plan.page_size
    spans = (rows * max(sq0, sp0, so0) + hq * max(sq1, sp1, so1) + d, rows * max(spl, sl) + hq,
             num_pages * sk0 + ps * sk1 + hkv * sk2 + d, num_pages * sv0 + ps * sv1 + hkv * sv2 + d,
             4 * plan.kv_indices.numel())  # (the tree mask: a record of 4 an entry)
    return max(spans) >= 1 << 31


def _aligned(*addresses: int) -> tuple:
    return tuple(a % 16 == 0 for a in addresses)


def _keep(kernel, grid: tuple, args: tuple, kwargs: dict) -> KeptKernel | None:
    """``kernel[grid](*args, **kwargs)`` through Triton, and its compiled kernel bound to this
    grid and these keyword arguments (None where Triton returned none: its interpreter)."""
    compiled = kernel[grid](*args, **kwargs)
    if not isinstance(compiled, CompiledKernel):
        return None
    params = kernel.params[len(args):]
    if not all(p.name in kwargs or p.has_default for p in params):
        return None
    # (a compiled kernel takes a 3-D grid and every parameter, constexprs included)
    return KeptKernel(compiled, grid + (1,) * (3 - len(grid)),
                      tuple(kwargs[p.name] if p.name in kwargs else p.default for p in params))


def _pdl_kwargs(pdl: bool) -> dict:
    """Launch options of a programmatic dependent launch (the kernels' ``PDL`` branches included)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {}


def _tma_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, layer_stride: int,
                     block_n: int) -> tuple | None:
    """Tensor descriptors (K, V) over the caches' slots for :attr:`Launch.tma` launches: 2-D
    ``[rows, Hkv * D]``, one row a slot, from ``k_cache``'s first slot to the end of its storage
    (so every layer ``layer_stride`` elements on is inside), ``[block_n, D]`` boxes. None where the
    layout does not allow it (the launch then loads through pointers, with the same result):
    slots not evenly strided across pages, heads not adjacent, strides or bases not 16-byte
    aligned, layers not a whole number of slots apart, or K and V strided differently."""
    _, page_size, hkv, d = k_cache.shape
    sp, ss, sh, _ = k_cache.stride()
    eb = k_cache.element_size()
    if (v_cache.stride() != k_cache.stride() or sh != d or sp != page_size * ss or (ss * eb) % 16
            or layer_stride % ss or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16):
        return None
    descs = []
    for t in (k_cache, v_cache):
        avail = t.untyped_storage().nbytes() // eb - t.storage_offset()
        rows = (avail - hkv * d) // ss + 1
        descs.append(TensorDescriptor(t, [rows, hkv * d], [ss, 1], [block_n, d]))
    return tuple(descs)


def _descriptor_args(kept: KeptKernel, direct: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     layer_stride: int, block_n: int, cache: dict) -> tuple:
    """The K/V tensor-descriptor arguments of a kept TMA launch: the descriptors themselves for
    its runner, or (``direct``) as its C launcher takes them, made once for these caches (by
    address and storage size, which with the call's strides decide the descriptors): encoding
    one costs about as much host time as a launch."""
    key = ("tma", id(kept), direct, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.untyped_storage().nbytes(),
           v_cache.untyped_storage().nbytes())
    args = cache.get(key)
    if args is None:
        descs = _tma_descriptors(k_cache, v_cache, layer_stride, block_n)
        args = cache[key] = kept.descriptor_args(descs) if direct else descs
    return args


def _block_d(head_dim: int) -> int:
    """The kernels' head_dim tile: the next power of two, at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def attention_constexprs(plan: Plan, launch, *, dtype: torch.dtype, device: torch.device, direct: bool,
                         merges: bool, write_lse: bool, tma: bool, wide: bool) -> dict:
    """The constexprs and launch options of the partial-attention kernel for ``launch`` of
    ``plan`` (what :func:`partial_attention` launches and :mod:`treeattn.precompile` compiles):
    ``dtype`` and ``device`` of the query, whether the plan writes single-row queries out
    (``direct``), this launch merges (``merges``) and writes the LSE out (``write_lse``), loads
    through tensor descriptors (``tma``) and needs int64 offsets (``wide``). A flag that the
    kernel would not read (a mask split without the mask, the split tail of a masked launch) is
    off, so that launches which run the same code share one compiled variant."""
    masked = plan.has_mask and launch.masked
    # Triton's CPU interpreter computes bf16 dots wrongly: they run in fp32 there
    upcast = torch.device(device).type == "cpu" and dtype == torch.bfloat16
    h = plan.heads
    return dict(
        GROUP=h.group, HEAD_DIM=h.head_dim, BLOCK_D=_block_d(h.head_dim),
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, PAGE_SIZE=plan.page_size,
        HAS_MASK=masked, MASK_SPLIT=launch.mask_split and masked, HEADS_INNER=launch.heads_inner,
        CONTIG=launch.contig, SPLIT_TAIL=launch.split_tail and not masked, DIRECT=direct and not merges,
        WRITE_LSE=(direct or merges) and write_lse, DOT_PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast, TMA=tma, MERGE_ROWS=merges, PERSIST=launch.programs > 0, WIDE=wide,
        num_warps=launch.num_warps, num_stages=launch.num_stages)


def partial_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Plan,
                      o_part: torch.Tensor, lse_part: torch.Tensor, *, sm_scale: float,
                      out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                      streams: Sequence[torch.cuda.Stream] = (), layer: torch.Tensor | None = None,
                      layer_stride: int = 0, pdl: bool = False, merge_last: bool = False,
                      merge: bool = False) -> tuple | None:
    """Launch the partial-attention kernel for every launch group of ``plan`` (on CUDA, through
    the plan's :func:`launch_cache`), and with ``merge`` the merge of its partial rows into
    ``out`` (and ``lse_out``) after them (:func:`merge_partials` of the plan's merged queries).

    Writes ``o_part [R, Hq, D]`` (``plan.heads.partial_dtype``) and ``lse_part [R, Hq]`` (fp32,
    natural-log LSE) of the rows
    the merge reads. Queries with a single row (``plan.row_direct``) are written straight to
    ``out [Q, Hq, D]`` (and ``lse_out [Q, Hq]`` fp32 when given), which must then be given.

    With ``layer`` (int32 ``[1]`` on the device) the caches are those of layer ``layer[0]``,
    ``layer_stride`` elements apart starting at ``k_cache`` / ``v_cache`` (a CUDA graph of the
    launches then serves every layer).

    With CUDA ``streams``, launches after the first run on them (round robin), forked from and
    joined back into the current stream, so launches of different tile shapes run side by side
    (PAT's multi-stream forward; a CUDA graph captures them as parallel branches). The first
    launch is the tallest with ``plan.tall_first``, else the shortest.

    Launches with :attr:`~treeattn.plan.format.Launch.tma` read K/V through tensor descriptors
    (:func:`_tma_descriptors`) where the caches' layout allows, through pointers otherwise.

    With ``pdl`` (CUDA, compute capability 9.0 or later, no ``streams``) the launches are
    programmatic dependent launches: each one after the first starts once every program of the
    one before has started, and they finish in order (see the kernel), so they overlap on one
    stream as on side streams. The next kernel on the stream must be a
    :func:`merge_partials` with ``pdl`` or an ordinary launch.

    With ``merge_last`` (``plan.merge_last``, no ``streams``) the launch that runs last merges
    every query's partial rows and writes ``out``: no merge follows.

    On CUDA, a call whose inputs are specialised like an earlier call's launches that call's
    kept kernels (:func:`launch_cache`) with the tensors' addresses, through Triton's C launcher
    where it can (:mod:`treeattn.compiled`): about 4 us of host time a launch on the H200's host.

    Returns ``(kept, addresses)`` on CUDA, what :func:`pack_launches` packs for a repeat of this
    exact call (``kept`` None where Triton kept no kernel), else None.
    """
    cuda = q.is_cuda
    if not cuda:
        check_triton_device(q)
    direct = plan.num_direct > 0
    if direct and out is None:
        raise ValueError("this plan writes single-row queries to the output: pass out=")
    if merge_last and (not plan.merge_last or out is None or streams):
        raise ValueError("merge_last needs a plan whose last launch can merge (plan.merge_last), out= "
                         "and no side streams")
    if merge and (merge_last or out is None):
        raise ValueError("merge needs out= and no merge_last (whose last launch merges)")
    merge = merge and plan.merge_q_indices.numel() > 0
    side = list(streams)[: len(plan.launches) - 1] if cuda else []
    if pdl and (side or not cuda):
        raise ValueError("pdl needs CUDA tensors and no side streams")
    out_arg = out if out is not None else o_part  # never written without DIRECT
    lse_arg = lse_out if lse_out is not None else lse_part
    if layer is None:
        layer, layer_stride = plan.work_row_indptr, 0  # offset 0: an int32 (0) times a zero stride
    sq, sk, sv, sp, so, sl = (q.stride(), k_cache.stride(), v_cache.stride(), o_part.stride(), out_arg.stride(),
                              lse_arg.stride())
    kept = cache = call = None
    if cuda:
        # everything the launches are specialised on beyond the plan's own tensors (fixed for the
        # plan object) and each launch's config, as read from the inputs: one key for them all
        addr = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), o_part.data_ptr(), lse_part.data_ptr(),
                out_arg.data_ptr(), lse_arg.data_ptr(), layer.data_ptr())
        device = torch.cuda.current_device()
        call = (device, q.dtype, sq, sk, k_cache.shape[0], sv, sp, lse_part.stride(0), so, sl, layer_stride, sm_scale,
                lse_out is not None, pdl, merge_last, merge, _aligned(*addr))
        cache = launch_cache(plan)
        kept = cache.get(call)
        if kept is not None and not side:
            _launch_kept(kept, addr, launch_stream(device), k_cache, v_cache, layer_stride, cache)
            return kept, addr
    strides = (sq[0], sq[1], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sp[0], sp[1], lse_part.stride(0), so[0], so[1],
               sl[0])
    # int64 offsets only where some tensor may span 2^31 elements (a cache past 4 GiB in 16 bits):
    # int32 ones take about half the address instructions
    wide = _wide(plan, strides, k_cache.shape[0])

    h = plan.heads
    scale = sm_scale * LOG2E.value
    plan_args = _plan_tensors(plan)
    last = len(plan.launches) - 1

    def launch_group(i: int, launch):
        """Launch ``launch`` (the ``i``-th to run) through Triton: ``(kept kernel, arguments
        before the layer, after it, TMA box rows or 0)`` for :func:`_launch_kept`."""
        first = int(i == 0)
        descs = (_tma_descriptors(k_cache, v_cache, layer_stride, launch.block_n)
                 if launch.tma and launch.contig and h.head_dim == _block_d(h.head_dim) else None)
        units = launch.work_end - launch.work_start
        before = (launch.work_start, units, h.num_kv_heads, scale)
        after = (layer_stride, first, *strides)
        if launch.programs:
            grid = (min(launch.programs, units * h.num_kv_heads),)
        elif launch.heads_inner:
            grid = (units * h.num_kv_heads,)
        else:
            grid = (units, h.num_kv_heads)
        kwargs = attention_constexprs(plan, launch, dtype=q.dtype, device=q.device, direct=direct,
                                      merges=merge_last and i == last, write_lse=lse_out is not None,
                                      tma=descs is not None, wide=wide)
        kernel = _keep(_tree_partial_attention_kernel, grid,
                       (q, k_cache, v_cache, *(descs or (None, None)), o_part, lse_part, out_arg, lse_arg,
                        *plan_args, *before, layer, *after), kwargs | _pdl_kwargs(pdl))
        if kernel is not None:
            return kernel, _plan_addresses(plan, cache) + before, after, launch.block_n if descs else 0
        return None

    main = torch.cuda.current_stream(q.device) if side else None
    for stream in side:  # fork before anything is queued on the main stream
        stream.wait_stream(main)
    made = []
    for i, launch in enumerate(reversed(plan.launches) if plan.tall_first else plan.launches):
        with torch.cuda.stream(side[(i - 1) % len(side)]) if i and side else contextlib.nullcontext():
            if kept is not None:
                _launch_kept((kept[0][i:i + 1], None), addr, launch_stream(device), k_cache, v_cache, layer_stride,
                             cache)
            else:
                made.append(launch_group(i, launch))
    for stream in side:  # join: the merge (and the caller) see every launch's rows
        main.wait_stream(stream)
    merged = None
    if merge and kept is not None:
        _launch_kept(((), kept[1]), addr, launch_stream(device), k_cache, v_cache, layer_stride, cache)
    elif merge:
        merged = _merge_launch(o_part, lse_part, plan.merge_q_indices, plan.merge_indptr, plan.merge_indices, out,
                               lse_out, max_rows=plan.merge_rows_max, pdl=pdl)
    if cuda and kept is None and all(made) and (merged is not None or not merge):
        kept = cache[call] = (tuple(made), merged)
    return (kept, addr) if cuda else None


def _launch_kept(kept: tuple, addr: tuple, stream: int | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 layer_stride: int, cache: dict) -> None:
    """Launch a call's kept launches, ``(attention launches, merge or None)`` as
    :func:`partial_attention` keeps them, with the call's tensor addresses ``addr`` on ``stream``
    (:func:`~treeattn.compiled.launch_stream`)."""
    qa, ka, va, pa, la, oa, loa, layer_a = addr
    launches, merge = kept
    for kernel, before, after, block_n in launches:
        descs = (None, None)
        if block_n:
            descs = _descriptor_args(kernel, stream is not None and kernel.direct, k_cache, v_cache, layer_stride,
                                     block_n, cache)
        kernel.launch(stream, (qa, ka, va, *descs, pa, la, oa, loa, *before, layer_a, *after))
    if merge is not None:
        kernel, indices = merge
        kernel.launch(stream, (pa, la, oa, loa, *indices))


def pack_launches(kept: tuple, addr: tuple, k_cache: torch.Tensor, v_cache: torch.Tensor, layer_stride: int,
                  cache: dict) -> tuple | None:
    """A call's kept launches (:func:`partial_attention`'s return) with every argument but the
    stream packed: ``((C launch, grid x, y, z, arguments after the stream), ...)`` for
    :func:`launch_packed`, so that repeating that exact call (same addresses, layouts and
    scalars) builds no argument tuple. None where a kernel takes Triton's runner (no C
    launcher)."""
    launches, merge = kept
    qa, ka, va, pa, la, oa, loa, layer_a = addr
    packed = []
    for kernel, before, after, block_n in launches:
        if not kernel.direct:
            return None
        descs = (_descriptor_args(kernel, True, k_cache, v_cache, layer_stride, block_n, cache) if block_n
                 else (None, None))
        packed.append((kernel, (qa, ka, va, *descs, pa, la, oa, loa, *before, layer_a, *after)))
    if merge is not None:
        kernel, indices = merge
        if not kernel.direct:
            return None
        packed.append((kernel, (pa, la, oa, loa, *indices)))
    return tuple((k.c_launch, *k.grid, (*k.options, *args, *k.tail)) for k, args in packed)


def launch_packed(packed: tuple, stream: int) -> None:
    """Launch :func:`pack_launches`'s launches on ``stream`` (:func:`~treeattn.compiled.launch_stream`)."""
    for launch, x, y, z, args in packed:
        launch(x, y, z, stream, *args)


def merge_partials(o_part: torch.Tensor, lse_part: torch.Tensor, merge_q_indices: torch.Tensor,
                   merge_indptr: torch.Tensor, merge_indices: torch.Tensor, out: torch.Tensor,
                   lse_out: torch.Tensor | None, *, max_rows: int = 4, block_h: int | None = None,
                   num_warps: int | None = None, row_tile: int | None = None, pdl: bool = False) -> None:
    """Merge the partial rows of queries ``merge_q_indices [M]`` (int32) into ``out [N, H, D]``
    (and ``lse_out [N, H]`` fp32 when given); query ``n``'s rows are
    ``merge_indices[merge_indptr[n]:merge_indptr[n + 1]]``. ``max_rows``: the most rows a merged
    query has (``Plan.merge_rows_max``), which sizes the row tile of few queries' merges; any
    count merges correctly. ``block_h`` (heads per program, a power of two), ``num_warps`` and
    ``row_tile`` (0: the row loop) override :func:`merge_config`.
    With ``pdl`` (after :func:`partial_attention` with ``pdl``) it is a programmatic dependent
    launch that waits for the partial rows on the device."""
    for name, t in (("merge_q_indices", merge_q_indices), ("merge_indptr", merge_indptr),
                    ("merge_indices", merge_indices)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor (got {t.dtype}, strides {t.stride()})")
    _merge_launch(o_part, lse_part, merge_q_indices, merge_indptr, merge_indices, out, lse_out, max_rows=max_rows,
                  block_h=block_h, num_warps=num_warps, row_tile=row_tile, pdl=pdl)


def _merge_launch(o_part, lse_part, merge_q_indices, merge_indptr, merge_indices, out, lse_out, *, max_rows: int,
                  block_h: int | None = None, num_warps: int | None = None, row_tile: int | None = None,
                  pdl: bool = False) -> tuple | None:
    """:func:`merge_partials` through Triton, its index tensors taken as checked: ``(kept
    kernel, its arguments after the partial rows and outputs)`` for :func:`_launch_kept` (None
    under the interpreter or with nothing to merge)."""
    n = merge_q_indices.numel()
    if n == 0:  # (every query's row was final: nothing to merge)
        return None
    check_triton_device(o_part)
    heads, d = out.shape[1:]
    block_d = triton.next_power_of_2(d)
    cfg = merge_config(n, heads, d, max_rows)
    if row_tile is None:  # the config's kernel; its tile resized only for overridden heads or warps
        row_tile = cfg[2]
        if row_tile and (block_h or num_warps):
            row_tile = merge_row_tile(max_rows, block_h or cfg[0], block_d, num_warps or cfg[1])
    block_h, num_warps = block_h or cfg[0], num_warps or cfg[1]
    lse_arg = lse_out if lse_out is not None else lse_part
    indices = (merge_q_indices, merge_indptr, merge_indices)
    scalars = (heads, o_part.stride(0), o_part.stride(1), lse_part.stride(0), out.stride(0), out.stride(1),
               lse_arg.stride(0))
    kwargs = dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=block_h, WRITE_LSE=lse_out is not None,
                  num_warps=num_warps, **_pdl_kwargs(pdl))
    kernel = _merge_states_kernel
    if row_tile:
        kernel, kwargs = _merge_tile_kernel, {**kwargs, "BLOCK_R": row_tile}
    kept = _keep(kernel, (n, triton.cdiv(heads, block_h)), (o_part, lse_part, out, lse_arg, *indices, *scalars), kwargs)
    return None if kept is None else (kept, tuple(t.data_ptr() for t in indices) + scalars)


def default_scale(head_dim: int, sm_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def _row_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, rows: int, device: torch.device) -> None:
    if not (t.dtype == dtype and t.shape == (rows,) and t.device == device):
        raise ValueError(f"{name} must be a {dtype} [{rows}] tensor on {device}, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")


def gumbel_argmax(logits: torch.Tensor, *, streams: torch.Tensor | None = None,
                  counter: int | torch.Tensor = 0, scale: float | torch.Tensor = 1.0, stats: bool = False,
                  block: int | None = None, parts: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row of ``logits``, in one pass over it: the Gumbel-max token ``argmax(x + G)`` of
    ``x = logits.float() * scale`` (float32 products) and ``G = gumbel_noise(streams, counter, V)``
    (:func:`treeattn.engine.sampling.gumbel_noise`, the same values), or ``argmax(x)`` without
    ``streams``; with ``stats``, also ``x``'s max and log-sum-exp.

    Parameters
    ----------
    logits : [n, V] float16, bfloat16 or float32, any strides
    streams : int64 [n], optional
        The rows' random streams (see ``gumbel_noise``); None: no noise (greedy).
    counter : int in ``[0, 2**32)`` or int64 ``[n]`` tensor
        The noise's counter, for every row or per row.
    scale : float or float32 ``[n]`` tensor
        Multiplies the logits: the inverse temperature, rounded to float32 (> 0).
    stats : bool
        Also return ``norm``.
    block, parts : int, optional
        Vocabulary entries a program reads per iteration (a power of two) and programs per row
        (default: about 8 programs a multiprocessor over all rows, at most one per ``block``).

    Returns
    -------
    tokens : int64 [n]
        Ties go to the first index; a NaN counts as larger than every number (``torch.argmax``'s
        rule), so a row with a NaN in ``x + G`` gives its first NaN's index, as the torch path
        does (raising instead would need a read on the host).
    norm : float32 [n, 2] or None
        ``(max, log(sum(exp(x - max))))`` of each row: token ``t``'s log-probability under
        ``softmax(x)`` is ``(x[t] - max) - norm[:, 1]``, as ``torch.log_softmax`` computes it
        (NaN for a row with a NaN or +inf in ``x``, or only -inf).

    Nothing is read back to the host, so the call can be queued ahead of the device.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in SUPPORTED_DTYPES:
        raise ValueError("logits must be a float16 / bfloat16 / float32 [n, vocab] tensor, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} {tuple(getattr(logits, 'shape', ()))}")
    n, vocab = logits.shape
    if not 0 < vocab < 1 << 31:
        raise ValueError(f"vocab must be in [1, 2**31), got {vocab}")
    dev = logits.device
    dummy = logits  # (pointer arguments a constexpr flag leaves unread)
    if streams is not None:
        _row_tensor(streams, "streams", torch.int64, n, dev)
    row_counter = isinstance(counter, torch.Tensor)
    if row_counter:
        _row_tensor(counter, "counter", torch.int64, n, dev)
    elif not 0 <= counter < 1 << 32:
        raise ValueError(f"counter must be in [0, 2**32), got {counter}")
    row_scale = isinstance(scale, torch.Tensor)
    if row_scale:
        _row_tensor(scale, "scale", torch.float32, n, dev)
    elif not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    cuda = dev.type == "cuda"
    block = block or (1024 if cuda else 128)
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    check_triton_device(logits)
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    norm = torch.empty(n, 2, dtype=torch.float32, device=dev) if stats else None
    if n == 0:
        return tokens, norm
    tiles = triton.cdiv(vocab, block)
    if parts is None:  # ~8 programs per multiprocessor over all rows (the H200's best, 4..256 rows)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if cuda else 1
        parts = triton.cdiv(8 * sms, n)
    chunk = triton.cdiv(tiles, max(1, min(parts, tiles))) * block
    parts = triton.cdiv(vocab, chunk)
    part_y = torch.empty(n, parts, dtype=torch.float32, device=dev)
    part_i = torch.empty(n, parts, dtype=torch.int32, device=dev)
    part_m, part_s = (torch.empty_like(part_y), torch.empty_like(part_y)) if stats else (part_y, part_y)
    c = 0 if row_counter else int(counter) - (1 << 32) * (counter >= 1 << 31)  # int32 bits
    # (no fused multiply-adds: ``x * scale + G`` rounds twice, as the torch reference does)
    _sample_partial_kernel[(n, parts)](
        logits, streams if streams is not None else dummy, counter if row_counter else dummy,
        scale if row_scale else dummy, part_y, part_i, part_m, part_s,
        logits.stride(0), logits.stride(1), vocab, chunk // block, parts, c, 1.0 if row_scale else float(scale),
        NOISE=streams is not None, ROW_COUNTER=row_counter, ROW_SCALE=row_scale, STATS=stats, BLOCK=block,
        num_warps=8, enable_fp_fusion=False)
    # (one BLOCK_P per vocabulary, whatever the rows: a batch that shrinks compiles no new variant)
    _sample_combine_kernel[(n,)](part_y, part_i, part_m, part_s, tokens, norm if stats else part_y, parts,
                                 STATS=stats, BLOCK_P=triton.next_power_of_2(tiles), num_warps=1)
    return tokens, norm


#: The candidate counts :func:`row_topk_candidates` selects per chunk (one compiled variant each)
TOPK_CANDIDATES = (16, 32)


def row_topk_candidates(logits: torch.Tensor, k: int, *, block: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates for the ``k`` largest entries of each row of ``logits``, in one launch: each
    chunk of ``block`` entries gives its ``K`` largest (``K``: the least of
    :data:`TOPK_CANDIDATES` >= ``k``), so the row's ``k`` largest are among them. ``torch.topk``
    of the candidates then finishes the selection (beam search: over every row's candidates at
    once) over a few thousand entries instead of the whole vocabulary, where ``torch.topk`` keeps
    each 128K-entry row on one or two multiprocessors (75-90 us for 4-16 rows on an H200).

    Parameters
    ----------
    logits : [n, V] float16, bfloat16 or float32, unit last stride
    k : int in ``[1, max(TOPK_CANDIDATES)]``
    block : int, optional
        Entries a chunk, a power of two >= ``k`` (default 4096 on CUDA, 64 in the interpreter).

    Returns
    -------
    values : float32 [n, C]
        ``C = K * cdiv(V, block)``; -inf past a row's end.
    indices : int32 [n, C]
        Column of each value (-1 past a row's end).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in SUPPORTED_DTYPES:
        raise ValueError("logits must be a float16 / bfloat16 / float32 [n, vocab] tensor, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} {tuple(getattr(logits, 'shape', ()))}")
    if logits.stride(1) != 1 and logits.shape[1] > 1:
        raise ValueError("logits must have a unit last stride")
    if not 1 <= k <= TOPK_CANDIDATES[-1]:
        raise ValueError(f"k must be in [1, {TOPK_CANDIDATES[-1]}], got {k}")
    n, vocab = logits.shape
    block = block or (4096 if logits.is_cuda else 64)
    if block & (block - 1) or block < k:
        raise ValueError(f"block must be a power of two >= k, got {block}")
    check_triton_device(logits)
    kk = next(c for c in TOPK_CANDIDATES if c >= k)
    chunks = triton.cdiv(vocab, block)
    values = torch.empty(n, chunks * kk, dtype=torch.float32, device=logits.device)
    indices = torch.empty(n, chunks * kk, dtype=torch.int32, device=logits.device)
    if n and vocab:
        _topk_partial_kernel[(n, chunks)](logits, values, indices, logits.stride(0), vocab, chunks, K=kk,
                                          BLOCK=block, num_warps=8)
    return values, indices
