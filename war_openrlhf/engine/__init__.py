"""Rollout engines: vLLM engines whose speculation drafts from the global index and
switches on and off with measured load.

- :mod:`config`: :class:`EngineConfig` and start-up checks that name the setting to change.
- :mod:`worker_extension`: the vLLM worker extension that puts the WAR replica behind vLLM's
  ``suffix`` drafter (worker process); :mod:`suffix_cache`: that replica, as the drafter's cache.
- :mod:`rpc`: the driver side: the extension's RPC names, engine arguments, request tags,
  :class:`~war_openrlhf.engine.rpc.EngineIndexClient`.
- :mod:`wire`: log entries and tensors as msgpack/pickle-safe data (driver <-> worker).
- :mod:`spec_switch`: the load-aware switch (online step-latency curve).
- :mod:`engine`: :class:`WarEngine`, one async vLLM engine (also OpenRLHF's rollout-actor surface).
- :mod:`actors`: :func:`create_war_engines`, the Ray actors.
"""

from .config import EngineConfig, check_startup
from .spec_switch import SpecSwitchConfig

__all__ = ["EngineConfig", "SpecSwitchConfig", "check_startup"]
