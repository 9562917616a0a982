"""What an engine drafts from: WAR's global index (switched by load) or vLLM's own ``suffix`` method.

One object per kind instead of ``speculation == "vllm_suffix"`` tests across the engine, its launch
arguments and the pool: each kind says whether the engine holds a WAR index replica (so the pool
ships the global log to it and the switch RPCs apply) and which speculative arguments vLLM gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Drafting", "WarIndexDrafting", "PlainEngine", "VllmSuffixDrafting", "drafting_for"]


@dataclass(frozen=True)
class Drafting:
    """A drafting kind (use :func:`drafting_for`)."""

    mode: str

    #: the engine holds a WAR index replica fed by the pool's log (and answers the switch RPCs)
    has_war_index: bool = False

    def engine_kwargs(self, num_speculative_tokens: int, max_tree_depth: int, *, openrlhf_worker: bool) -> dict[str, Any]:
        raise NotImplementedError

    def refuse_index_call(self, method: str) -> None:
        """Raise the error an index or switch RPC gets on an engine without a WAR replica."""
        if not self.has_war_index:
            what = "vLLM's own suffix method" if self.mode == "vllm_suffix" else "no speculative config"
            raise ValueError(f"{method}: this engine has no WAR index replica: it runs {what} (speculation={self.mode!r})")


@dataclass(frozen=True)
class WarIndexDrafting(Drafting):
    """Drafts from the WAR replica behind vLLM's suffix drafter; ``mode`` is the switch's start
    (``auto``: by measured load, ``on``, ``off``)."""

    has_war_index: bool = True

    def engine_kwargs(self, num_speculative_tokens: int, max_tree_depth: int, *, openrlhf_worker: bool) -> dict[str, Any]:
        from .rpc import war_engine_kwargs

        return war_engine_kwargs(num_speculative_tokens, max_tree_depth, openrlhf=openrlhf_worker)


@dataclass(frozen=True)
class PlainEngine(Drafting):
    """No speculative config at all: a plain vLLM engine, as OpenRLHF starts them. Nothing drafts and
    nothing is paid for drafting: no drafter call per step, and on GPUs none of what a speculative
    config changes in vLLM 0.29 (async scheduling off, the V1 model runner, CUDA-graph sizes rounded
    to multiples of K+1, one-token steps no longer uniform decode; docs/gpu.md)."""

    def engine_kwargs(self, num_speculative_tokens: int, max_tree_depth: int, *, openrlhf_worker: bool) -> dict[str, Any]:
        from .rpc import war_engine_kwargs

        # the worker extension stays (weight sync, index RPCs answer "no replica"); no speculative config
        return {"worker_extension_cls": war_engine_kwargs(openrlhf=openrlhf_worker)["worker_extension_cls"]}


@dataclass(frozen=True)
class VllmSuffixDrafting(Drafting):
    """vLLM's own per-engine suffix method (the one-flag option a user already has); no WAR replica."""

    def engine_kwargs(self, num_speculative_tokens: int, max_tree_depth: int, *, openrlhf_worker: bool) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"speculative_config": {"method": "suffix",
                                                         "num_speculative_tokens": num_speculative_tokens}}
        if openrlhf_worker:
            kwargs["worker_extension_cls"] = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"
        return kwargs


def drafting_for(speculation: str) -> Drafting:
    """The drafting kind of ``EngineConfig.speculation`` (``auto`` | ``on`` | ``off`` | ``none`` | ``vllm_suffix``)."""
    if speculation == "vllm_suffix":
        return VllmSuffixDrafting(speculation)
    if speculation == "none":
        return PlainEngine(speculation)
    if speculation in ("auto", "on", "off"):
        return WarIndexDrafting(speculation)
    raise ValueError(f"speculation: must be one of auto, on, off, none, vllm_suffix, got {speculation!r}")
