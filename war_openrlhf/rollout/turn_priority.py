"""Longest first: each turn's vLLM request priority from its trajectory's predicted remaining work.

A synchronous step ends with its slowest trajectory, so a turn of a trajectory with many turns
left should not wait behind one that is nearly done (Seer, arXiv 2511.14617: learn a group's
lengths from its siblings, run the longest first). :class:`TurnPriorities` predicts each
trajectory's remaining turns when its turn is dispatched (``dispatch/remaining_work.py``: its
GRPO siblings' finished totals and running count, the workload's fit from earlier finished
groups; before two finished groups, the survival curve of finished trajectories; before any,
nothing: priority 0) and hands vLLM ``-round(10 x remaining)`` (lower is served first), on
engines started with ``scheduling_policy: priority``. Rollout setting ``turn_priority``.
"""

from __future__ import annotations

from collections import deque

from ..dispatch.remaining_work import SiblingPredictor, SurvivalPrior

__all__ = ["TurnPriorities"]


class TurnPriorities:
    """The pool's record of trajectories per GRPO group and the priority of their next turn."""

    def __init__(self, history_groups: int = 512) -> None:
        self._alive: dict[str, dict[str, int]] = {}  # group -> alive trajectory -> turns done
        self._finished: dict[str, list[int]] = {}  # group -> finished members' turn counts
        self._history: deque[list[int]] = deque(maxlen=history_groups)  # finished groups (fit data)
        self._sib: SiblingPredictor | None = None
        self._prior: SurvivalPrior | None = None
        self.predictions = 0

    def start_batch(self) -> None:
        """A new batch: the last batch's groups become fit data, the predictors are refitted."""
        self._history.extend(self._finished.values())
        self._alive.clear()
        self._finished.clear()
        groups = {str(i): g for i, g in enumerate(self._history) if len(g) >= 2}
        totals = [t for g in self._history for t in g]
        self._prior = SurvivalPrior(totals) if totals else None
        try:
            self._sib = SiblingPredictor.fit(groups) if len(groups) >= 2 else None
        except ValueError:
            self._sib = None

    def seed(self, groups) -> None:
        """Fit data from elsewhere (each item: one finished group's turn counts), e.g. the tasks
        of a recorded trace a benchmark does not replay; refits the predictors."""
        for g in groups:
            self._history.append([int(t) for t in g])
        self.start_batch()

    def priority(self, trajectory_id: str, group_id: str, turn_index: int) -> int:
        """The vLLM priority of this trajectory's turn ``turn_index`` (0: no prediction yet)."""
        members = self._alive.setdefault(group_id, {})
        members[trajectory_id] = turn_index
        if self._sib is not None:
            remaining = self._sib.remaining(turn_index, self._finished.get(group_id, ()), len(members) - 1)
        elif self._prior is not None:
            remaining = self._prior.remaining(turn_index)
        else:
            return 0
        self.predictions += 1
        return -int(round(10.0 * remaining))

    def finished(self, trajectory_id: str, group_id: str, turns: int) -> None:
        """A trajectory ended after ``turns`` model turns."""
        self._alive.get(group_id, {}).pop(trajectory_id, None)
        self._finished.setdefault(group_id, []).append(int(turns))
