"""What follows every weight sync to the rollout engines, in the sync and the async trainer alike.

OpenRLHF broadcasts new weights to the engines (NCCL, CUDA IPC, or gloo on CPU) and, only
with ``--vllm.enable_prefix_caching``, resets their prefix caches. WAR engines always cache
prefixes, and the rollout pool must know which weights produced each turn. So after the
broadcast, both trainers call :func:`after_weight_sync` on the engines, which in each engine
(:meth:`~war_openrlhf.engine.engine.WarEngine.weights_updated`):

- drops the prefix cache (its KV was computed with the old weights), and
- counts the new weight version; every turn then reports the versions it ran under.

The pool learns the version from the turns themselves (``RolloutPool.generate_turn``) or
from this hook's return value: the index's records carry it, so ``max_policy_lag`` ages
them, dumps and trajectories record it per turn, and the dispatcher forgets its model of
the engines' caches. One rule for both trainers: the async trainer's rollout actor is
another process than the trainer that broadcasts, and needs no call between them.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["after_weight_sync"]


def after_weight_sync(engines: Sequence[Any], *, timeout_s: float = 300.0) -> int:
    """Tell every engine actor its weights changed; returns the new weight version (the
    largest the engines report; they agree unless one was started later)."""
    import ray

    versions = ray.get([e.weights_updated.remote() for e in engines], timeout=timeout_s)
    return int(max(versions)) if versions else 0
