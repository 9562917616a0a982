"""verl's sticky dispatch: ``GlobalRequestLoadBalancer`` (sticky sessions + least in-flight).

Source: ``VERL = verl-project/verl@483b8a009ba3a97563edee3a19887e4862b8094a`` (tag v0.9.0, the
current release; the repository moved from volcengine/verl), ``LS =
verl/workers/rollout/llm_server.py``.

The rules
---------
* **Key**: the agent loop draws one ``request_id = uuid4().hex`` per trajectory and passes it
  on every turn (VERL ``verl/experimental/agent_loop/tool_agent_loop.py:136, 146, 236``); the
  engine gets a fresh id per turn (LS:231-237). Here: ``trajectory_id``.
* **Map**: a ``cachetools.LRUCache(maxsize=10000)`` request_id -> server (LS:43, 80, 600-605),
  one for the whole rollout (a Ray actor shared by every AgentLoopWorker). A hit returns the
  mapped server and, read through ``__getitem__``, makes the entry most recently used
  (LS:89-95); a new entry evicts the least recently used one when the map is full. Entries are
  never deleted when a trajectory finishes; only the LRU ages them out (or
  ``clear_sticky_cache``, LS:159-181, which the fully-async rollouter calls when it rebalances
  onto new replicas: VERL ``verl/experimental/fully_async_policy/fully_async_rollouter.py:1240``).
* **Load**: in-flight requests per server, counted by the balancer itself: ``acquire_server``
  increments the chosen server's count (LS:94, 113) and the client's ``finally`` releases it
  when the turn's ``generate`` returns (LS:116-121, 262, 288-289; a fire-and-forget call,
  LS:226-229, so the count lags by one RPC). Not cumulative. (Up to
  v0.7.0 the per-worker ``AsyncLLMServerManager`` counted requests ever assigned, in a heap
  over shuffled servers: ``volcengine/verl@f9c855f7cf04d603c9546bc01776c74806a879c1``
  ``verl/experimental/agent_loop/agent_loop.py:57-92``; v0.7.1 introduced the in-flight
  balancer.) Here: ``EngineState.running + waiting``, which is that count: the simulator
  enqueues a dispatched turn at once and removes it when it finishes, and the rollout pool
  increments ``in_flight`` right after ``choose()`` and decrements it when the turn returns.
* **New request**: the server with the fewest in-flight requests, ties to the first server in
  the balancer's dict, i.e. the replicas' order (LS:108-111, 603). Here: the lowest
  ``(load, engine_id)`` among healthy engines.
* **Removed server**: a hit on a server no longer in the pool deletes the entry and places the
  request as a new one (LS:96-97); the new binding then stays. Here an unhealthy engine stands
  for a removed one.

Deviations: ``full_determinism`` (``hash(request_id) % len(servers)``, LS:103-107) is not
modelled. verl re-adds a server at the end of its dict (LS:133-135), so after a remove/re-add
its ties go to the other servers first; here ties always go to the lower engine id.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from .base import DispatchPolicy, EngineState, PolicyOptions, TurnRequest

DEFAULT_LRU_CAPACITY = 10000  # verl DEFAULT_ROUTING_CACHE_SIZE (LS:43)


@dataclass(frozen=True)
class StickyOptions(PolicyOptions):
    """Options of ``sticky``."""

    lru_capacity: int = field(default=DEFAULT_LRU_CAPACITY, metadata={
        "help": "trajectories the trajectory -> engine map remembers (least recently used forgotten)"})

    def __post_init__(self) -> None:
        if self.lru_capacity <= 0:
            raise ValueError(f"lru_capacity must be positive, got {self.lru_capacity}")


class StickyPolicy(DispatchPolicy):
    name = "sticky"

    Options = StickyOptions

    def __init__(self, num_engines: int, lru_capacity: int = DEFAULT_LRU_CAPACITY) -> None:
        super().__init__(num_engines)
        self.lru_capacity = int(StickyOptions(lru_capacity=lru_capacity).lru_capacity)
        self._lru: "OrderedDict[str, int]" = OrderedDict()

    def choose(self, request: TurnRequest, engines: Sequence[EngineState]) -> int:
        healthy = self._healthy(engines)
        tid = request.trajectory_id
        eid = self._lru.get(tid)
        if eid is not None and any(e.engine_id == eid for e in healthy):
            self._lru.move_to_end(tid)  # LRUCache.__getitem__ touches the entry
            return eid
        eid = min(healthy, key=lambda e: (e.load, e.engine_id)).engine_id
        self._lru[tid] = eid
        self._lru.move_to_end(tid)
        while len(self._lru) > self.lru_capacity:
            self._lru.popitem(last=False)
        return eid

    def engine_of(self, trajectory_id: str):
        """The engine the LRU map binds the trajectory to (None if absent); no LRU touch."""
        return self._lru.get(trajectory_id)

    def __len__(self) -> int:
        return len(self._lru)
