"""verl's sticky dispatch (``AsyncLLMServerManager`` / ``GlobalRequestLoadBalancer``).

verl keeps an LRU map (capacity 10000) from request/trajectory id to server so that every turn
of a trajectory returns to the server holding its prefix; a trajectory not in the map goes to
the server with the fewest in-flight requests (here ``running + waiting``; ties go to the lower
engine id), and the entry is (re)inserted as most recently used. Entries are not deleted when a
trajectory finishes (verl relies on the LRU to age them out). Only deviation, needed by the
interface's contract: if the mapped engine is unhealthy the trajectory is re-placed by the
least-in-flight rule.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from .base import DispatchPolicy, EngineState, TurnRequest

DEFAULT_LRU_CAPACITY = 10000


class StickyPolicy(DispatchPolicy):
    name = "sticky"

    def __init__(self, num_engines: int, lru_capacity: int = DEFAULT_LRU_CAPACITY) -> None:
        super().__init__(num_engines)
        if lru_capacity <= 0:
            raise ValueError(f"lru_capacity must be positive, got {lru_capacity}")
        self.lru_capacity = int(lru_capacity)
        self._lru: "OrderedDict[str, int]" = OrderedDict()

    def choose(self, request: TurnRequest, engines: Sequence[EngineState]) -> int:
        healthy = self._healthy(engines)
        tid = request.trajectory_id
        eid = self._lru.get(tid)
        if eid is not None and any(e.engine_id == eid for e in healthy):
            self._lru.move_to_end(tid)
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
