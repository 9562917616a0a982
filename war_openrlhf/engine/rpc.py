"""Driver side of the WAR worker extension: RPC names, engine arguments, request tags.

Why it exists: everything the driver needs to start an engine with the WAR drafter
and to talk to its replica, without importing the worker-side code (vLLM's model
runner, the index). Runs in the driver process (the ``WarEngine`` actor, tests,
tools); the worker extension imports only its constants.

- ``RPC_*``: the worker extension's method names, defined here once; the driver
  calls ``llm.collective_rpc(RPC_..., args=(...))`` and
  :class:`~war_openrlhf.engine.worker_extension.WarWorkerExtension` defines a method
  of each name (checked by the tests).
- :func:`war_engine_kwargs` / :func:`war_speculative_config`: the ``vllm.LLM`` /
  ``EngineArgs`` arguments that install the extension and vLLM's ``suffix`` method.
- :func:`war_extra_args`: ``SamplingParams.extra_args`` naming a request's
  trajectory and group (read by the worker under :data:`EXTRA_ARGS_KEY`).
- :class:`EngineIndexClient`: a blocking handle on one engine's replica.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Iterable, Mapping

from war_openrlhf.speculation.index import SuffixIndexConfig
from war_openrlhf.speculation.log import CompletedSequenceLog, LogEntry

from .wire import entries_to_wire

__all__ = [
    "EXTRA_ARGS_KEY",
    "RPC_APPLY_LOG",
    "RPC_INDEX_STATS",
    "RPC_INSTALL_INDEX",
    "RPC_LOAD_WEIGHTS",
    "RPC_METHODS",
    "RPC_SEED_VLLM_SUFFIX_CACHE",
    "RPC_SET_MODE",
    "RPC_SET_SPECULATION",
    "RPC_SET_SWITCH",
    "WAR_OPENRLHF_WORKER_EXTENSION",
    "WORKER_EXTENSION",
    "EngineIndexClient",
    "war_engine_kwargs",
    "war_extra_args",
    "war_speculative_config",
]

#: ``worker_extension_cls`` for a plain vLLM engine.
WORKER_EXTENSION = "war_openrlhf.engine.worker_extension.WarWorkerExtension"
#: ``worker_extension_cls`` for OpenRLHF's engines: a class combining OpenRLHF's
#: ``WorkerWrap`` (its CPU stand-in without CUDA) with WAR's extension.
WAR_OPENRLHF_WORKER_EXTENSION = "war_openrlhf.engine.worker_extension.OpenRLHFWarWorkerWrap"
#: Key in ``SamplingParams.extra_args`` holding ``{"trajectory_id", "group_id"}``.
EXTRA_ARGS_KEY = "war"

# The worker extension's RPCs (``collective_rpc`` method names).
#: Replace the drafter's cache by a fresh replica: ``(config, switch_config=None, mode=None)``.
RPC_INSTALL_INDEX = "war_install_index"
#: Apply log entries (``entries_to_wire`` dicts): ``(entries,)``.
RPC_APPLY_LOG = "war_apply_log"
#: Adapter counters and replica stats: ``(reset=False,)``.
RPC_INDEX_STATS = "war_index_stats"
#: Force drafting on/off: ``(enabled,)``.
RPC_SET_SPECULATION = "war_set_speculation"
#: ``auto`` / ``on`` / ``off``: ``(mode,)``.
RPC_SET_MODE = "war_set_mode"
#: Replace the load-aware switch: ``(switch_config,)``.
RPC_SET_SWITCH = "war_set_switch"
#: Load ``tensors_to_wire`` weights: ``(wire_tensors,)``.
RPC_LOAD_WEIGHTS = "war_load_weights"
#: Baselines: seed vLLM's own suffix cache: ``(items,)``.
RPC_SEED_VLLM_SUFFIX_CACHE = "war_seed_vllm_suffix_cache"
#: Every RPC name above.
RPC_METHODS = (
    RPC_INSTALL_INDEX,
    RPC_APPLY_LOG,
    RPC_INDEX_STATS,
    RPC_SET_SPECULATION,
    RPC_SET_MODE,
    RPC_SET_SWITCH,
    RPC_LOAD_WEIGHTS,
    RPC_SEED_VLLM_SUFFIX_CACHE,
)


def war_speculative_config(num_speculative_tokens: int = 16, max_tree_depth: int = 32) -> dict[str, Any]:
    """``speculative_config`` for an engine whose drafts come from a WAR replica.

    ``num_speculative_tokens`` is the per-step cap the scheduler reserves slots for
    (the replica drafts up to that, fewer when its match is short).
    ``suffix_decoding_max_cached_requests=0`` keeps vLLM's own cache (used until
    :meth:`~war_openrlhf.engine.worker_extension.WarWorkerExtension.war_install_index`)
    from growing a global tree.
    """
    return {
        "method": "suffix",
        "num_speculative_tokens": int(num_speculative_tokens),
        "suffix_decoding_max_tree_depth": int(max_tree_depth),
        "suffix_decoding_max_cached_requests": 0,
    }


def war_engine_kwargs(
    num_speculative_tokens: int = 16, max_tree_depth: int = 32, *, openrlhf: bool = False
) -> dict[str, Any]:
    """The two ``vllm.LLM`` / ``EngineArgs`` arguments the hook needs."""
    return {
        "speculative_config": war_speculative_config(num_speculative_tokens, max_tree_depth),
        "worker_extension_cls": WAR_OPENRLHF_WORKER_EXTENSION if openrlhf else WORKER_EXTENSION,
    }


def war_extra_args(
    trajectory_id: str | None = None, group_id: str | None = None, extra_args: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``SamplingParams.extra_args`` naming a request's trajectory and GRPO group.

    The trajectory's tree is then extended turn over turn; the group selects the
    group tree (``SuffixIndexConfig.group_trees``). Merges into ``extra_args``.
    """
    meta = {}
    if trajectory_id is not None:
        meta["trajectory_id"] = str(trajectory_id)
    if group_id is not None:
        meta["group_id"] = str(group_id)
    return {**(extra_args or {}), EXTRA_ARGS_KEY: meta}


class EngineIndexClient:
    """Driver-side handle on one engine's replica (all of its workers).

    ``llm`` is a ``vllm.LLM`` (or anything with a blocking ``collective_rpc``).
    Every call returns rank 0's answer; with tensor parallelism each rank holds an
    identical replica (only the last PP rank drafts).
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _call(self, method: str, *args: Any) -> Any:
        return self.llm.collective_rpc(method, args=args)[0]

    def install(self, config: SuffixIndexConfig | Mapping[str, Any] | None = None) -> dict[str, Any]:
        if isinstance(config, SuffixIndexConfig):
            config = asdict(config)
        return self._call(RPC_INSTALL_INDEX, dict(config or {}))

    def apply(self, entries: Iterable[LogEntry]) -> int:
        return self._call(RPC_APPLY_LOG, entries_to_wire(entries))

    def sync(self, log: CompletedSequenceLog, batch: int = 4096) -> int:
        """Send the entries the replica has not applied yet; returns how many it applied."""
        applied = self.stats()["index"]["applied_seq"]
        n = 0
        while applied < log.last_seq:
            entries = log.read(applied, batch)
            n += self.apply(entries)
            applied = entries[-1].seq
        return n

    def stats(self, reset: bool = False) -> dict[str, Any]:
        return self._call(RPC_INDEX_STATS, reset)

    def set_speculation(self, enabled: bool) -> bool:
        return self._call(RPC_SET_SPECULATION, bool(enabled))
