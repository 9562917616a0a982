"""OpenRLHF 0.11.2's dispatch (``SamplesGenerator._dispatch_prompts_to_vllm``), per turn.

OpenRLHF snapshots ``get_num_unfinished_requests()`` of every engine once per dispatch call
(= once per rollout batch), heapifies ``(count, engine_idx)``, and sends each prompt with all
its ``n_samples_per_prompt`` samples to the engine on top of the heap, pushing it back with
``count + n``. The multi-turn agent executor then runs inside that engine actor, so every turn
of those trajectories stays on that engine. No cache or progress awareness.

Mapped onto per-turn ``choose()``:

* the first turn seen of a group decides its engine: snapshot ``running + waiting`` of the
  engines (taken at the first new group after construction or after :meth:`start_batch`),
  pick the minimum ``(load, engine_id)`` (heap order: ties go to the lower id), then
  ``load += n_samples_per_prompt`` in the policy's local copy of the snapshot;
* every later turn of any trajectory of the group follows the group's engine.

Call :meth:`start_batch` at the start of each rollout batch (each ``_dispatch_prompts_to_vllm``
call) so that the next group takes a fresh snapshot. Only deviation, needed by the interface's
contract: unhealthy engines are skipped, and a group whose engine became unhealthy is
re-placed by the same rule (OpenRLHF has no health notion).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .base import DispatchPolicy, EngineState, PolicyOptions, TurnRequest


@dataclass(frozen=True)
class LeastLoadedOptions(PolicyOptions):
    """Options of ``least_loaded``."""

    n_samples_per_prompt: int = field(default=1, metadata={
        "help": "samples per prompt: a group of this many consecutive trajectories goes to one engine"})

    def __post_init__(self) -> None:
        if self.n_samples_per_prompt <= 0:
            raise ValueError(f"n_samples_per_prompt must be positive, got {self.n_samples_per_prompt}")


def openrlhf_group_placement(group_sizes: Sequence[int], num_engines: int,
                             loads: Sequence[int] | None = None) -> list[int]:
    """OpenRLHF's rule for one dispatch call, for whole groups at once: each prompt (with
    its ``group_sizes[i]`` samples) goes to the engine on top of a min-heap of
    ``(unfinished requests, engine_id)`` snapshotted at the call (ties: lower id), which
    is pushed back with ``load + n``. :class:`LeastLoadedPolicy` applies the same rule
    turn by turn."""
    heap = [(int(loads[i]) if loads is not None else 0, i) for i in range(num_engines)]
    heapq.heapify(heap)
    placement = []
    for n in group_sizes:
        load, eid = heapq.heappop(heap)
        placement.append(eid)
        heapq.heappush(heap, (load + int(n), eid))
    return placement


class LeastLoadedPolicy(DispatchPolicy):
    name = "least_loaded"

    Options = LeastLoadedOptions

    def __init__(self, num_engines: int, n_samples_per_prompt: int = 1) -> None:
        super().__init__(num_engines)
        options = LeastLoadedOptions(n_samples_per_prompt=n_samples_per_prompt)
        self.n_samples_per_prompt = int(options.n_samples_per_prompt)
        self._heap: Optional[List[Tuple[int, int]]] = None  # (load, engine_id), batch snapshot
        self._group_engine: Dict[str, int] = {}
        self._group_members: Dict[str, Set[str]] = {}
        self._traj_group: Dict[str, str] = {}

    def start_batch(self) -> None:
        """Next new group takes a fresh load snapshot (OpenRLHF: one per dispatch call)."""
        self._heap = None

    def _place_group(self, healthy: Sequence[EngineState]) -> int:
        healthy_ids = {e.engine_id for e in healthy}
        if self._heap is None:
            self._heap = [(e.load, e.engine_id) for e in healthy]
            heapq.heapify(self._heap)
        # Pop until a healthy engine (engines that went unhealthy since the snapshot drop out).
        skipped = []
        while self._heap and self._heap[0][1] not in healthy_ids:
            skipped.append(heapq.heappop(self._heap))
        if not self._heap:  # every snapshotted engine is now unhealthy: snapshot again
            self._heap = [(e.load, e.engine_id) for e in healthy]
            heapq.heapify(self._heap)
            skipped = []
        load, eid = heapq.heappop(self._heap)
        heapq.heappush(self._heap, (load + self.n_samples_per_prompt, eid))
        for item in skipped:
            heapq.heappush(self._heap, item)
        return eid

    def choose(self, request: TurnRequest, engines: Sequence[EngineState]) -> int:
        healthy = self._healthy(engines)
        healthy_ids = {e.engine_id for e in healthy}
        gid = request.group_id
        eid = self._group_engine.get(gid)
        if eid is None or eid not in healthy_ids:
            eid = self._place_group(healthy)
            self._group_engine[gid] = eid
        self._group_members.setdefault(gid, set()).add(request.trajectory_id)
        self._traj_group[request.trajectory_id] = gid
        return eid

    def on_trajectory_finished(self, trajectory_id: str) -> None:
        gid = self._traj_group.pop(trajectory_id, None)
        if gid is None:
            return
        members = self._group_members.get(gid)
        if members is not None:
            members.discard(trajectory_id)
            if not members:
                del self._group_members[gid]
                self._group_engine.pop(gid, None)
