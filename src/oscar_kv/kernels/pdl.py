"""Programmatic dependent launch (PDL) for the decode step's kernels (sm_90 and later).

A decode step at small batch is a chain of short kernels (per layer: norm, q|k|v GEMV, RoPE, cache write,
attention, o_proj GEMV, norm, gate|up GEMV, down GEMV), each waiting for the one before it to finish and flush.
Launched with PDL, a kernel's programs may be placed on the SMs while the kernel before it is still running; they
do what needs none of its results, then wait for it (``griddepcontrol.wait``: the whole earlier grid done and its
memory visible).  Each of our kernels lets the next one launch (``griddepcontrol.launch_dependents``) right after its
own wait, so at most one kernel ahead waits for the one behind it.  The Triton kernels call
``common.wait_for_inputs`` first thing; the CUDA decode attention loads its page ids and R^T before the wait, and
its query and window rows after (int2_decode.cu).  A GEMV that loaded its first weight tile before the wait was
slower (benchmarks/NOTES.md, run PDL1), so the Triton kernels wait first.

The rule every kernel launched with PDL keeps: before the wait it reads only tensors that no kernel of the step
writes (weights, rotations, the plan's tensors uploaded before the step) and writes nothing.  A kernel launched
without PDL (cuBLAS, torch's own) waits for everything before it, as usual.

``launch_options(device)``: the keyword arguments of a Triton launch (``PDL`` for the kernel's constexpr,
``launch_pdl`` for Triton's launcher); ``launch_cuda``: a kernel from ``torch.cuda._compile_kernel`` launched through
``cuLaunchKernelEx`` with the PDL attribute.  On by default on CUDA devices of compute capability 9 or more;
``$OSCAR_KV_PDL=off`` (or ``set_enabled(False)``, for benchmarks comparing both) turns it off.  Triton's CPU
interpreter never takes it (its programs run one after another, and inline PTX does not run there).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

ENV = "OSCAR_KV_PDL"  # on | off (default on where the device has it)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_forced: bool | None = None  # set_enabled's choice, over $OSCAR_KV_PDL


def set_enabled(enabled: bool | None) -> None:
    """Force PDL on or off for launches from now on (None: back to $OSCAR_KV_PDL and the device).  A CUDA graph
    keeps how its kernels were launched when it was captured."""
    global _forced
    _forced = enabled


@functools.cache
def _device_has_pdl(index: int) -> bool:
    # an NVIDIA GPU of compute capability 9 or more (ROCm reports its own architectures as capabilities too)
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL now."""
    if INTERPRET or device.type != "cuda":
        return False
    wanted = _forced
    if wanted is None:
        choice = os.environ.get(ENV, "on")
        if choice not in ("on", "off"):
            raise ValueError(f"${ENV} must be on or off, got {choice!r}")
        wanted = choice == "on"
    return wanted and _device_has_pdl(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """``PDL`` (the kernels' constexpr) and, where it is on, ``launch_pdl`` for a Triton launch on ``device``."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


# ---- cuLaunchKernelEx through ctypes (cuda.h's structs) -------------------------------------------------------

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


def _kernel_arguments(args: list) -> tuple[ctypes.Array, list]:
    """The kernel's parameter array as torch's ``_CudaKernel`` builds it: tensors as device pointers, Python ints as
    C ints, floats as doubles.  Returns the array and the values it points to (kept alive through the launch)."""
    values = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            values.append(ctypes.c_void_p(arg.data_ptr()))
        elif isinstance(arg, int):  # bool included
            values.append(ctypes.c_int(int(arg)))
        elif isinstance(arg, float):
            values.append(ctypes.c_double(arg))
        else:
            raise TypeError(f"unsupported kernel argument type {type(arg).__name__}")
    array = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    return array, values


def launch_cuda(kernel, grid: tuple[int, int, int], block: tuple[int, int, int], args: list,
                device: torch.device) -> None:
    """Launch ``kernel`` (from ``torch.cuda._compile_kernel``) on the current stream, with PDL where
    ``enabled(device)``, else as torch launches it."""
    if not enabled(device):
        kernel(grid=grid, block=block, args=args)
        return
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    array, _values = _kernel_arguments(args)
    attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), 0,
                           ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream),
                           ctypes.pointer(attribute), 1)
    _check_cuda(_get_gpu_runtime_library().cuLaunchKernelEx(ctypes.byref(config), kernel.func, array, None))
