"""Ray arguments that let OpenRLHF's Ray actors run on CPU, with the CPU patches in every worker.

Ray runs OpenRLHF's actors in other processes. :func:`ray_init_kwargs` returns the
``ray.init`` arguments that (a) declare logical GPUs, so OpenRLHF's ``num_gpus=1`` actors
and its ``{"GPU": 1, "CPU": 1}`` placement-group bundles schedule, and (b) install
:func:`~war_openrlhf.cpu.apply_cpu_support` as every worker's ``worker_process_setup_hook``
(:data:`SETUP_HOOK`). Ray ships ``@ray.remote`` classes by value, with the module globals
the *driver* holds when the class is first used, so call ``apply_cpu_support`` in the
driver too, before the first OpenRLHF actor is created (see :mod:`war_openrlhf.cpu`).
"""

from __future__ import annotations

import os
from typing import Any

from ..device import cuda_available

__all__ = ["SETUP_HOOK", "ray_init_kwargs"]

#: Ray's setup hook value: every Ray worker process calls this at start (Ray imports
#: it by this name: the package's public :func:`~war_openrlhf.cpu.apply_cpu_support`).
SETUP_HOOK = f"{__package__}.apply_cpu_support"


def ray_init_kwargs(num_gpus: int | None = None, runtime_env: dict | None = None) -> dict[str, Any]:
    """Keyword arguments for ``ray.init`` that let OpenRLHF's Ray actors run on CPU.

    OpenRLHF's actor groups are ``@ray.remote(num_gpus=1)`` and its placement groups
    use ``{"GPU": 1, "CPU": 1}`` bundles; without GPU resources they never schedule.
    On CPU this declares ``num_gpus`` logical GPUs (default: one per core, so every
    bundle also finds a CPU) and adds :func:`~war_openrlhf.cpu.apply_cpu_support` as the
    ``worker_process_setup_hook`` of every worker. ``runtime_env`` is merged in.
    With CUDA it returns only what was passed (``{}`` by default): nothing changes.
    """
    kwargs: dict[str, Any] = {}
    if runtime_env is not None:
        kwargs["runtime_env"] = dict(runtime_env)
    if cuda_available():
        return kwargs
    if num_gpus is None:
        num_gpus = os.cpu_count() or 1
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"ray_init_kwargs.num_gpus: must be an int >= 1 (logical GPUs on CPU), got {num_gpus!r}")
    env = dict(kwargs.get("runtime_env") or {})
    hook = env.get("worker_process_setup_hook")
    if hook not in (None, SETUP_HOOK):
        raise ValueError(
            f"ray_init_kwargs.runtime_env: worker_process_setup_hook is already {hook!r}; Ray allows one hook - "
            f"call {SETUP_HOOK} from yours and drop it from runtime_env"
        )
    env["worker_process_setup_hook"] = SETUP_HOOK
    kwargs["runtime_env"] = env
    kwargs["num_gpus"] = num_gpus
    return kwargs
