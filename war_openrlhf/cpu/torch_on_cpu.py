"""``torch`` with CUDA mapped to the CPU, for the OpenRLHF modules that call ``torch.cuda``.

OpenRLHF calls ``torch.cuda.*`` unconditionally, builds a ``"cuda"`` device mesh and
moves tensors to ``torch.cuda.current_device()``. ``torch.cuda`` itself is never
touched: the OpenRLHF modules that call it get a module-level ``torch`` stand-in
(:class:`_TorchOnCpu`, installed by :mod:`war_openrlhf.cpu.openrlhf_patches`) whose
``cuda`` namespace maps devices to the CPU and turns synchronisation, streams and
cache calls into no-ops; every other attribute is the real ``torch``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch


def _cpu_device(device: Any = None, index: Any = None) -> torch.device:
    """``torch.device`` with every CUDA device (``"cuda"``, ``"cuda:0"``, ``"cuda:cpu"``, an
    int, a CUDA ``torch.device``) mapped to the CPU; anything else unchanged."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    return torch.device(device) if index is None else torch.device(device, index)


class _DeviceMeta(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> torch.device:
        return _cpu_device(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.device)


class _CpuDevice(metaclass=_DeviceMeta):
    """``torch.device`` as OpenRLHF's CPU-patched modules see it (see :func:`_cpu_device`)."""


class _NullStream:
    """A CUDA stream stand-in: waits and synchronisation are no-ops (CPU work is synchronous)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_NullStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _CudaOnCpu:
    """``torch.cuda`` as OpenRLHF's CPU-patched modules see it.

    ``current_device()`` is the CPU device, so ``tensor.to(torch.cuda.current_device())``
    and ``torch.tensor(..., device=torch.cuda.current_device())`` stay on the CPU;
    ``set_device``, ``synchronize``, ``empty_cache`` and stream calls are no-ops; memory
    statistics are 0. Anything else is the real ``torch.cuda``.
    """

    Stream = _NullStream

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def current_stream(device: Any = None) -> None:
        # Passed through as `stream=` to a broadcast, which ignores it on CPU.
        return None

    @staticmethod
    def default_stream(device: Any = None) -> None:
        return None

    @staticmethod
    def stream(stream: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def device(device: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def memory_stats(device: Any = None) -> dict:
        return {}

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        try:
            pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            total = os.sysconf("SC_PHYS_PAGES") * size
            return pages * size, total
        except (ValueError, OSError, AttributeError):
            return 0, 0


class _TorchOnCpu:
    """The module-level ``torch`` of OpenRLHF's CPU-patched modules: the real ``torch``
    except ``torch.cuda`` (:class:`_CudaOnCpu`) and ``torch.device`` (CUDA -> CPU)."""

    cuda = _CudaOnCpu()
    device = _CpuDevice

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def __reduce__(self):
        # Ray ships @ray.remote classes by value with their globals: rebuild the
        # stand-in (not the real torch) in the worker.
        return (_torch_on_cpu, ())

    def __repr__(self) -> str:
        return f"<torch with CUDA mapped to CPU ({__name__})>"


_TORCH_ON_CPU = _TorchOnCpu()


def _torch_on_cpu() -> _TorchOnCpu:
    return _TORCH_ON_CPU


def _cpu_if_cuda(device: Any) -> Any:
    if isinstance(device, (str, int, torch.device)):
        return _cpu_device(device)
    return device

