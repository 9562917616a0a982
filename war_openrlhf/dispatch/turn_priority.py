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

from .remaining_work import SiblingRecords

__all__ = ["TurnPriorities"]


class TurnPriorities:
    """The vLLM priority of each trajectory's next turn, from the pool's sibling records."""

    def __init__(self, history_groups: int = 512) -> None:
        self.records = SiblingRecords(history_groups)
        self.predictions = 0

    def start_batch(self) -> None:
        """A new batch: the last batch's groups become fit data, the predictors are refitted."""
        self.records.start_batch()

    def seed(self, groups) -> None:
        """Fit data from elsewhere (each item: one finished group's turn counts), e.g. the tasks
        of a recorded trace a benchmark does not replay; refits the predictors."""
        self.records.seed(groups)

    def priority(self, trajectory_id: str, group_id: str, turn_index: int) -> int:
        """The vLLM priority of this trajectory's turn ``turn_index`` (0: no prediction yet)."""
        self.records.running(trajectory_id, group_id, turn_index)
        remaining = self.records.remaining(trajectory_id, group_id, turn_index)
        if remaining is None:
            return 0
        self.predictions += 1
        return -int(round(10.0 * remaining))

    def finished(self, trajectory_id: str, group_id: str, turns: int) -> None:
        """A trajectory ended after ``turns`` model turns."""
        self.records.finished(trajectory_id, group_id, turns)
