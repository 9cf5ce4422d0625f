"""Launching a Triton kernel that is already compiled, without Triton's per-call work.

``kernel[grid](...)`` binds and specialises every argument on each call, and its launcher asks
the driver about every tensor it is given (``cuPointerGetAttribute``). A plan's launches repeat
with the same specialisation on every layer and step, so :mod:`treeattn.launchers` keeps each
one's compiled kernel as a :class:`KeptKernel` and launches it with tensors given as device
addresses. Where the installed Triton's generated C launcher has the argument layout this module
knows (:data:`C_LAUNCH_FORMAT`), that C function is called directly: ~4 us a launch on the H200's
host, against ~8 us through the compiled kernel's runner, which on every launch reads the current
device and stream, builds launch metadata and calls Triton's launch hooks. Any other Triton, a
kernel that needs scratch memory, or a registered launch hook (a profiler's) takes the runner.
"""
from __future__ import annotations

import inspect
import types

import torch
from triton import knobs

try:  # (absent from CPU-only Triton builds)
    from triton.backends.nvidia import driver as _nvidia
except ImportError:  # pragma: no cover
    _nvidia = None

__all__ = ["C_LAUNCH_FORMAT", "KeptKernel", "launch_stream"]

#: The leading arguments' format of Triton's generated C ``launch`` that :class:`KeptKernel`
#: calls (Triton 3.6): grid x, y, z, stream, function, cooperative, PDL, the two scratch
#: buffers, kernel metadata, launch metadata and the two hooks; the kernel's arguments follow.
C_LAUNCH_FORMAT = "iiiKKppOOOOOO"


def _hook_set(hook) -> bool:
    """Whether a Triton launch hook (a ``HookChain`` since Triton 3.5, else a callable or None)
    would do something."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_stream(device_index: int) -> int | None:
    """The current CUDA stream of device ``device_index`` as Triton's C launcher takes it, or None
    while a Triton launch hook is set (launches then take the runner, which calls the hooks)."""
    runtime = knobs.runtime
    if _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook):
        return None
    return torch._C._cuda_getCurrentRawStream(device_index)


def _c_launch(compiled) -> tuple:
    """``(launch, options, descriptor metadata)``: the generated C function that launches
    ``compiled``, the arguments it takes between the stream and the kernel's own, and the
    kernel's tensor-descriptor metadata; ``(None, None, None)`` where this Triton's launcher is
    not the layout :data:`C_LAUNCH_FORMAT` or the kernel needs scratch memory."""
    run = getattr(compiled, "run", None)
    if (_nvidia is None or getattr(_nvidia, "_BASE_ARGS_FORMAT", None) != C_LAUNCH_FORMAT
            or not isinstance(run, getattr(_nvidia, "CudaLauncher", ())) or run.global_scratch_size
            or run.profile_scratch_size):
        return None, None, None
    fn = run.launch
    if not isinstance(fn, types.BuiltinFunctionType):
        # kernels with tensor descriptors: Triton wraps the C function to expand them each call
        fn = inspect.getclosurevars(fn).nonlocals.get("launcher")
        if not isinstance(fn, types.BuiltinFunctionType):
            return None, None, None
    options = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
               None, None, None)
    return fn, options, getattr(compiled.metadata, "tensordesc_meta", None) or None


class KeptKernel:
    """A compiled kernel bound to its grid and trailing (constexpr) arguments.

    ``launch(stream, args)`` runs it with ``args`` (tensors given as device addresses, ints that
    Triton's launcher takes as they are): through the C launcher on ``stream`` where
    :func:`_c_launch` allows and ``stream`` is given (:func:`launch_stream`), else through the
    compiled kernel's runner on the current stream.
    """

    __slots__ = ("runner", "tail", "grid", "c_launch", "options", "descriptor_meta")

    def __init__(self, compiled, grid: tuple, tail: tuple):
        self.runner, self.tail, self.grid = compiled[grid], tail, grid
        self.c_launch, self.options, self.descriptor_meta = _c_launch(compiled)

    @property
    def direct(self) -> bool:
        """Whether ``launch`` given a stream calls the C launcher (tensor descriptors then go
        expanded: :meth:`descriptor_args`)."""
        return self.c_launch is not None

    def descriptor_args(self, descriptors: tuple) -> tuple:
        """What the C launcher takes for ``descriptors`` (the kernel's tensor descriptors, in
        order): each one expanded as Triton's launcher expands it on every call (the CUtensorMap
        it encodes, its shape and strides). Made once for a cache's address and reused."""
        meta = self.descriptor_meta
        return tuple(a for j, d in enumerate(descriptors)
                     for a in _nvidia.make_tensordesc_arg(d, meta[j] if meta else None))

    def launch(self, stream: int | None, args: tuple) -> None:
        if stream is not None and self.c_launch is not None:
            self.c_launch(*self.grid, stream, *self.options, *args, *self.tail)
        else:
            self.runner(*args, *self.tail)
