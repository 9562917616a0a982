"""Turn dispatch for multi-engine agentic rollouts: one interface, seven policies.

``make_policy(name, num_engines, **options)`` builds one of (each declares its options as a typed
dataclass next to it, ``POLICIES[name].Options``: what ``RolloutConfig.dispatch_kwargs``, the
command line and ``war-train --help`` read):

- ``round_robin``: next healthy engine, per turn.
- ``least_loaded``: OpenRLHF 0.11.2 -- a group to the engine with the fewest unfinished
  requests (heap over a snapshot, load += n), all its turns stay there.
- ``sticky``: verl -- LRU(10000) trajectory -> engine, new ones to the fewest in-flight.
- ``sglang_cache_aware``: SGLang router ``cache_aware`` over token ids.
- ``dynamo_kv``: NVIDIA Dynamo's KV router cost (overlap-weighted prefill blocks + active
  decode blocks, lowest wins).
- ``verl_kv_aware``: verl's KV-cache-aware router (pull request #7115): sticky unless the
  bound engine is overloaded, else ``alpha * S_cache + (1 - alpha) * (1 - load)``.
- ``war``: WAR's cache- and queue-aware placement with hysteresis, a tail bias and KV-aware
  admission of new trajectories (it may answer ``DEFER`` for a first turn).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Dict, Type

from .base import DEFER, DispatchPolicy, EngineState, NoHealthyEngineError, PolicyOptions, TurnRequest
from .dynamo_kv import DynamoKvPolicy
from .least_loaded import LeastLoadedPolicy
from .round_robin import RoundRobinPolicy
from .sglang_cache_aware import SGLangCacheAwarePolicy
from .sticky import StickyPolicy
from .verl_kv_aware import VerlKvAwarePolicy
from .war import WarDispatchPolicy

POLICIES: Dict[str, Type[DispatchPolicy]] = {
    cls.name: cls
    for cls in (RoundRobinPolicy, LeastLoadedPolicy, StickyPolicy, SGLangCacheAwarePolicy,
                DynamoKvPolicy, VerlKvAwarePolicy, WarDispatchPolicy)
}


def make_policy(name: str, num_engines: int, options: PolicyOptions | None = None, /, **kwargs) -> DispatchPolicy:
    """Build a dispatch policy by name, from its typed ``options`` (``POLICIES[name].Options``)
    or from keyword arguments (the same fields); ValueError for an unknown name, an unknown
    option or a bad value, naming it."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown dispatch policy {name!r}; known: {sorted(POLICIES)}")
    if not isinstance(num_engines, int) or isinstance(num_engines, bool) or num_engines <= 0:
        raise ValueError(f"num_engines must be a positive int, got {num_engines!r}")
    if options is None:
        known = [f.name for f in fields(cls.Options)]
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ValueError(f"bad configuration for {name!r}: unknown option '{unknown[0]}' "
                             f"(options of {name}: {', '.join(known) or 'none'})")
        options = cls.Options(**kwargs)
    elif kwargs or not isinstance(options, cls.Options):
        raise ValueError(f"bad configuration for {name!r}: pass a {cls.Options.__name__} or keyword options, "
                         f"not {type(options).__name__}{' and keywords' if kwargs else ''}")
    options.check_engines(num_engines)
    return cls(num_engines, **options.as_kwargs())


__all__ = ["DEFER", "DispatchPolicy", "EngineState", "PolicyOptions", "TurnRequest", "NoHealthyEngineError", "POLICIES",
           "make_policy", "RoundRobinPolicy", "LeastLoadedPolicy", "StickyPolicy", "DynamoKvPolicy", "VerlKvAwarePolicy",
           "SGLangCacheAwarePolicy", "WarDispatchPolicy"]
