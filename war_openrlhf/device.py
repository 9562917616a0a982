"""The package's device decisions: whether this process runs on CUDA or on the CPU.

Everything in ``war_openrlhf`` that picks a CUDA or a CPU path (engine start-up and
placement, the OpenRLHF baseline, applying :mod:`war_openrlhf.cpu`, the Ray arguments)
asks :func:`cuda_available`, so that one answer holds for the whole process. The CPU
patches of :mod:`war_openrlhf.cpu.openrlhf_patches` that re-check CUDA inside a patched
OpenRLHF function keep their own check, as OpenRLHF's code does.
"""

from __future__ import annotations

__all__ = ["cuda_available"]


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
