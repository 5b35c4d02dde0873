"""TVM start-up: import TVM the way edgeq needs it, with a CUDA driver library loaded first (the real one,
else edgeq's stub, so that TVM's CUDA code generation runs on a GPU-less build host) and its thread pool
sized to this process's CPUs. Every module that needs TVM gets it from ``import_tvm`` here."""

from __future__ import annotations

import inspect
import os
import shutil
import sys
from functools import cache
from importlib import resources
from pathlib import Path

from edgeq.cache import cached_build
from edgeq.errors import ToolchainError


@cache
def cuda_driver() -> str:
    """Load ``libcuda.so.1`` (the real driver, else edgeq's stub) and say which. Call before importing TVM."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        return "driver"
    except OSError:
        pass
    try:
        stub = _build_driver_stub()
    except ToolchainError as err:
        return f"none ({err})"
    ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)
    return "stub"


def _build_driver_stub() -> Path:
    source = resources.files("edgeq").joinpath("native/cuda_driver_stub.c").read_bytes()
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ToolchainError("no C compiler (cc) to build the CUDA driver stub; install gcc")
    return cached_build("the CUDA driver stub", "libcuda.so.1", "stub.c", source, compiler,
                        ["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1"])


def import_tvm():
    """Import TVM the way edgeq needs it: with a CUDA driver library (real or stub) loaded first, and its
    thread pool sized to the CPUs this process may use (TVM otherwise assumes two hardware threads per
    core and uses half of them; TVM_NUM_THREADS still decides where set)."""
    if hasattr(os, "sched_getaffinity"):
        os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    cuda_driver()
    import tvm

    cheap_script_stacks()
    return tvm


class _InspectWithCheapStack:
    """``inspect`` as TVMScript's decorators see it, with a ``stack()`` that reads the source line of only the three
    innermost frames. ``@T.prim_func``, ``@I.ir_module`` and ``@R.function`` call ``inspect.stack()`` to find the
    caller's class line (``frames[2].code_context``) and its frames' locals; the full stack reads a source line for
    every frame, and for each frame without a file on disk (importlib's, ``runpy``'s) ``inspect.getmodule`` walks
    all of ``sys.modules``. Importing ``tvm.s_tir.tensor_intrin`` (254 prim_funcs, which every CUDA build and every
    tune loads) took 21 s on 2 cores with onnxruntime, scipy and xgboost loaded, and 2.8 s with this. A frame
    without a file (``<frozen importlib._bootstrap>``: the third frame of a prim_func at a module's top level, as it
    is imported) has no source line either, and ``getframeinfo`` would walk ``sys.modules`` twice to find that out:
    it gets none without asking (that import with 2,147 modules loaded, three runs each: 6.2 s -> 3.9 s)."""

    def __getattr__(self, name):
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list:
        frame, out = sys._getframe(1), []
        while frame is not None:
            if len(out) < 3 and not frame.f_code.co_filename.startswith("<"):
                out.append(inspect.FrameInfo(frame, *inspect.getframeinfo(frame, context)))
            else:
                out.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name,
                                             None, None))
            frame = frame.f_back
        return out


def cheap_script_stacks() -> None:
    """TVMScript's decorators with ``_InspectWithCheapStack`` (idempotent): ``import_tvm`` runs it, and so does
    each worker process meta_schedule starts (their ``initializer``: a candidate's build in a fresh worker loaded
    ``tensor_intrin`` in 18 s of its 18.5, 4.4 s with it)."""
    import importlib

    for name in ("tvm.tirx.script.parser.entry", "tvm.script.parser.ir.entry", "tvm.relax.script.parser.entry"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # another TVM layout: its decorators keep the full stack
            continue
        if getattr(module, "inspect", None) is inspect:
            module.inspect = _InspectWithCheapStack()


# What edgeq's modules take from TVM, imported on first use, after ``import_tvm``: a module writes
# ``from edgeq.tvm_env import relax, Schedule`` and never imports ``tvm`` itself, so no import order can load
# TVM before the CUDA driver (tests/test_architecture.py holds every module under packager/ to this).
_EXPORTS = {
    "tvm": ("tvm", None),
    "relax": ("tvm.relax", None),
    "te": ("tvm.te", None),
    "topi": ("tvm.topi", None),
    "tirx": ("tvm.tirx", None),
    "dlight": ("tvm.s_tir.dlight", None),
    "onnx_frontend": ("tvm.relax.frontend.onnx.onnx_frontend", None),
    "Schedule": ("tvm.s_tir", "Schedule"),
    "ScheduleError": ("tvm.s_tir", "ScheduleError"),
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'edgeq.tvm_env' has no attribute '{name}'")
    import importlib

    import_tvm()
    module, attr = _EXPORTS[name]
    value = importlib.import_module(module)
    return getattr(value, attr) if attr else value
