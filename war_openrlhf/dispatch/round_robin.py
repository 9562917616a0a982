"""Round robin: every turn goes to the next healthy engine in cyclic order.

No affinity, no load, no cache awareness: the floor every other policy must beat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .base import DispatchPolicy, EngineState, PolicyOptions, TurnRequest


@dataclass(frozen=True)
class RoundRobinOptions(PolicyOptions):
    """``round_robin`` has no options."""


class RoundRobinPolicy(DispatchPolicy):
    name = "round_robin"
    Options = RoundRobinOptions

    def __init__(self, num_engines: int) -> None:
        super().__init__(num_engines)
        self._next = 0  # engine id to try first on the next turn

    def choose(self, request: TurnRequest, engines: Sequence[EngineState]) -> int:
        healthy_ids = {e.engine_id for e in self._healthy(engines)}
        for step in range(self.num_engines):
            eid = (self._next + step) % self.num_engines
            if eid in healthy_ids:
                self._next = (eid + 1) % self.num_engines
                return eid
        raise AssertionError("unreachable: _healthy() returned a healthy engine")
